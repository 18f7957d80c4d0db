"""``ChildProcess``: the control channel to a child running ``python -m <module>`` (stdin/stdout)."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from kvwire.control.channel import Channel
from kvwire.control.errors import ControlClosedError, ControlError
from kvwire.control.jsonlines import DEFAULT_MAX_BUFFERED, DEFAULT_MAX_DEPTH, DEFAULT_MAX_LINE, preview

__all__ = ["ChildProcess"]

_EXIT_WAIT_S = 1.0  # after EOF: how long to wait for the exit status
_REAP_S = 10.0  # after SIGKILL: how long to wait for the kernel to reap


def _exit_status(code: int) -> str:
    if code >= 0:
        return f"code {code}"
    try:
        return f"code {code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"code {code}"


class ChildProcess(Channel):
    """Parent side: a child running ``python -m <module> <args>`` with a bounded JSON-lines channel.

    ``timeout_s`` is the deadline of every read and send; ``grace_s`` how long
    :meth:`close` lets an acknowledged ``quit`` take before it kills.
    """

    def __init__(
        self,
        module: str,
        args: Sequence[str],
        *,
        what: str,
        timeout_s: float = 60.0,
        max_line: int = DEFAULT_MAX_LINE,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        max_depth: int = DEFAULT_MAX_DEPTH,
        grace_s: float = 30.0,
    ) -> None:
        try:
            self.check_limits(
                timeout_s=timeout_s, grace_s=grace_s, max_line=max_line, max_buffered=max_buffered, max_depth=max_depth
            )
        except Exception as exc:
            raise type(exc)(f"ChildProcess: {exc}") from None
        self.grace_s = grace_s
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
            )
        except (OSError, ValueError) as exc:
            raise ControlClosedError(f"{what} could not be started: {exc}") from None
        assert self.proc.stdin is not None and self.proc.stdout is not None
        super().__init__(
            self.proc.stdout.fileno(),
            self.proc.stdin.fileno(),
            what=what,
            timeout_s=timeout_s,
            max_line=max_line,
            max_buffered=max_buffered,
            max_depth=max_depth,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def label(self) -> str:
        return f"{self.what} (pid {self.proc.pid})"

    def _gone(self) -> bool:
        return self.proc.poll() is not None

    def _error_reply(self, text: str) -> ControlError:
        return ControlError(f"{self.what} failed: {text[:1000]} (pid {self.proc.pid})")

    def _closed_error(self, deadline: float) -> ControlError:
        """The channel's end: the exit status if the child exits soon, else that it closed stdout alive."""
        wait = max(0.0, min(deadline - time.monotonic(), _EXIT_WAIT_S))
        try:
            code = self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return self._poison(ControlClosedError(f"{self.label} closed its stdout but is still running"))
        cut = f" in the middle of a line ({preview(bytes(self._partial))})" if self._partial else ""
        return self._poison(ControlClosedError(f"{self.label} exited with {_exit_status(code)} before answering{cut}"))

    def _send_failed(self, exc: OSError) -> ControlError:
        code = self.proc.poll()
        what = f"exited with {_exit_status(code)}" if code is not None else f"closed its stdin ({exc})"
        return self._poison(ControlClosedError(f"{self.label} {what} before reading a command"))

    # ending

    def close(self) -> None:
        """Ask the child to quit; kill it if it does not, and always reap it (never hangs)."""
        if self._closed:
            return
        self._closed = True
        try:
            acknowledged = False
            if self.proc.poll() is None and self._error is None:
                with contextlib.suppress(ControlError):
                    self.request({"cmd": "quit"}, timeout_s=min(self.timeout_s, self.grace_s))
                    acknowledged = True
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # EOF: a child in serve() returns
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=self.grace_s if acknowledged else min(self.grace_s, _EXIT_WAIT_S))
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            try:
                self.proc.wait(timeout=_REAP_S)
            except subprocess.TimeoutExpired:
                raise ControlClosedError(f"{self.label} could not be reaped {_REAP_S:g} s after SIGKILL") from None
            finally:
                for stream in (self.proc.stdin, self.proc.stdout):
                    if stream is not None:
                        with contextlib.suppress(OSError):
                            stream.close()
                if self._error is None:  # never touch the closed descriptors again
                    self._poison(ControlClosedError(f"{self.label}: the channel is closed"))
