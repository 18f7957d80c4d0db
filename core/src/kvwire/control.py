"""A JSON-lines control channel to a child process (peer descriptions, commands, completion).

The bench's decode process and the contract kit's receivers both speak it: one
JSON object per line on the child's stdin/stdout, no pickle on the wire. The
child may be buggy or hostile, so the parent side reads bytes on demand with a
deadline, a line length, a buffer size and a nesting depth (see
:mod:`kvwire.jsonlines`): whatever the child does ends in one
:class:`ControlError` naming it, never a hang or unbounded memory. After a
protocol violation the channel is poisoned (every later call raises the same
error) and :meth:`ChildProcess.close` kills and reaps the child. A child reports
its own failure as ``{"error": "..."}``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from types import TracebackType
from typing import IO, Any

from kvwire.errors import ConfigError, KvwireError
from kvwire.jsonlines import (
    DEFAULT_MAX_BUFFERED,
    DEFAULT_MAX_DEPTH,
    DEFAULT_MAX_LINE,
    LineError,
    parse_object,
    preview,
)

__all__ = [
    "ChildProcess",
    "ControlClosedError",
    "ControlError",
    "ControlProtocolError",
    "ControlTimeoutError",
    "Handler",
    "read_command",
    "reply",
    "serve",
]

#: A child's handler of one command: the message in, the reply out.
Handler = Callable[[dict[str, Any]], dict[str, Any]]

_CHUNK = 1 << 16  # bytes per read from the child
_SLICE_S = 0.05  # how often a waiting read checks whether the child exited
_EXIT_WAIT_S = 1.0  # after EOF: how long to wait for the exit status
_REAP_S = 10.0  # after SIGKILL: how long to wait for the kernel to reap


class ControlError(KvwireError, RuntimeError):
    """The child failed, exited, sent garbage, or did not answer in time (this class: it reported a failure)."""


class ControlProtocolError(ControlError):
    """The child sent something that is not a bounded JSON-object line (garbage, too long, too deep, a flood)."""


class ControlTimeoutError(ControlError):
    """The child did not answer, or stopped in the middle of a line, within the deadline."""


class ControlClosedError(ControlError):
    """The child could not start, exited, or closed its end of the channel."""


def _exit_status(code: int) -> str:
    if code >= 0:
        return f"code {code}"
    try:
        return f"code {code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"code {code}"


# -- child side ------------------------------------------------------------------------------------------------


def reply(message: dict[str, Any], stream: IO[str] | None = None) -> None:
    """Child side: send one message to the parent."""
    out = stream if stream is not None else sys.stdout
    out.write(json.dumps(message, separators=(",", ":")) + "\n")
    out.flush()


def read_command(
    stream: IO[bytes] | None = None, *, max_line: int = DEFAULT_MAX_LINE, max_depth: int = DEFAULT_MAX_DEPTH
) -> dict[str, Any] | None:
    """Child side: the parent's next message, None at EOF; ControlProtocolError for a bad line (consumed whole)."""
    source = stream if stream is not None else sys.stdin.buffer
    line = source.readline(max_line + 1)
    if not line:
        return None
    if line.endswith(b"\n"):
        line = line[:-1]
    elif len(line) > max_line:
        head = line
        while (rest := source.readline(_CHUNK)) and not rest.endswith(b"\n"):
            pass  # skip the rest of the line, a chunk at a time
        raise ControlProtocolError(f"bad command: a line over {max_line} bytes: {preview(head)}")
    try:
        return parse_object(line, max_depth)
    except LineError as exc:
        raise ControlProtocolError(f"bad command: {exc}") from None


def _short(value: object, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def serve(
    handlers: Mapping[str, Handler],
    *,
    stdin: IO[bytes] | None = None,
    stdout: IO[str] | None = None,
    max_line: int = DEFAULT_MAX_LINE,
    max_depth: int = DEFAULT_MAX_DEPTH,
) -> None:
    """Child side: answer commands until ``quit`` (answered) or EOF; a bad line or a failed handler gets an error."""
    while True:
        try:
            message = read_command(stdin, max_line=max_line, max_depth=max_depth)
        except ControlProtocolError as exc:
            answer: dict[str, Any] = {"error": str(exc)}
        else:
            if message is None:
                return
            command = message.get("cmd")
            if command == "quit":
                with contextlib.suppress(OSError):
                    reply({"ok": True}, stdout)
                return
            handler = handlers.get(command) if isinstance(command, str) else None
            if handler is None:
                answer = {"error": f"unknown command {_short(command)}"}
            else:
                try:
                    answer = handler(message)
                    json.dumps(answer)
                except Exception as exc:  # a handler's failure is the parent's to report, not a crash here
                    answer = {"error": f"{type(exc).__name__}: {exc}"}
        try:
            reply(answer, stdout)
        except OSError:  # the parent is gone
            return


# -- parent side -----------------------------------------------------------------------------------------------


class ChildProcess:
    """Parent side: a child running ``python -m <module> <args>`` with a bounded JSON-lines channel.

    ``timeout_s`` is the deadline of every read and send; ``grace_s`` how long
    :meth:`close` lets an acknowledged ``quit`` take before it kills. Not
    thread-safe: one caller at a time.
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
        limits = {"timeout_s": timeout_s, "grace_s": grace_s, "max_line": max_line, "max_buffered": max_buffered}
        for name, value in {**limits, "max_depth": max_depth}.items():
            if not value > 0:
                raise ConfigError(f"ChildProcess: {name} must be > 0, got {value!r}")
        self.what = what
        self.timeout_s, self.grace_s = timeout_s, grace_s
        self.max_line, self.max_buffered, self.max_depth = max_line, max_buffered, max_depth
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
            )
        except (OSError, ValueError) as exc:
            raise ControlClosedError(f"{what} could not be started: {exc}") from None
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        os.set_blocking(self._in, False)  # sends have a deadline too
        self._readable, self._writable = select.poll(), select.poll()
        self._readable.register(self._out, select.POLLIN)
        self._writable.register(self._in, select.POLLOUT)
        self._lines: deque[bytes] = deque()  # complete lines not read yet
        self._queued = 0  # their bytes
        self._partial = bytearray()  # the line in progress
        self._eof = False
        self._error: ControlError | None = None  # set once the channel is poisoned
        self._closed = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def label(self) -> str:
        return f"{self.what} (pid {self.proc.pid})"

    def __enter__(self) -> ChildProcess:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _poison(self, error: ControlError) -> ControlError:
        self._error = error
        self._lines.clear()
        self._partial = bytearray()
        self._queued = 0
        return error

    def _raise_if_poisoned(self) -> None:
        if self._error is not None:
            raise self._error.with_traceback(None)

    # reading

    def _take(self, data: bytes) -> None:
        """Split ``data`` into lines, enforcing the line length and the buffer size."""
        start = 0
        while (end := data.find(b"\n", start)) >= 0:
            if len(self._partial) + end - start > self.max_line:
                raise self._too_long((bytes(self._partial[:60]) + data[start : start + 60])[:60])
            line = bytes(self._partial) + data[start:end]
            self._partial.clear()
            self._lines.append(line)
            self._queued += len(line)
            start = end + 1
        self._partial += data[start:]
        if len(self._partial) > self.max_line:
            raise self._too_long(bytes(self._partial[:60]))
        if self._queued + len(self._partial) > self.max_buffered:
            raise self._poison(ControlProtocolError(
                f"{self.label} flooded the channel: {self._queued + len(self._partial)} bytes of unread lines, "
                f"over the limit of {self.max_buffered}"
            ))

    def _too_long(self, head: bytes) -> ControlError:
        return self._poison(ControlProtocolError(
            f"{self.label} sent a line over {self.max_line} bytes (no newline within the limit), "
            f"starting {preview(head)}"
        ))

    def _closed_error(self, deadline: float) -> ControlError:
        """The channel's end: the exit status if the child exits soon, else that it closed stdout alive."""
        wait = max(0.0, min(deadline - time.monotonic(), _EXIT_WAIT_S))
        try:
            code = self.proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            return self._poison(ControlClosedError(f"{self.label} closed its stdout but is still running"))
        cut = f" in the middle of a line ({preview(bytes(self._partial))})" if self._partial else ""
        return self._poison(ControlClosedError(f"{self.label} exited with {_exit_status(code)} before answering{cut}"))

    def _fill(self, deadline: float) -> None:
        """Wait up to one slice for bytes from the child and take them; raises when the channel ends."""
        slice_s = max(0.0, min(deadline - time.monotonic(), _SLICE_S))
        if not self._readable.poll(int(slice_s * 1000) + 1):
            # exited, but no EOF: its stdout may be held open by a process it started
            if self.proc.poll() is not None and not self._readable.poll(0):
                raise self._closed_error(deadline)
            return
        try:
            data = os.read(self._out, _CHUNK)
        except OSError as exc:
            raise self._poison(ControlClosedError(f"{self.label}: reading its stdout failed: {exc}")) from None
        if not data:
            self._eof = True
            raise self._closed_error(deadline)
        self._take(data)

    def read(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The child's next message; a ControlError subclass on garbage, exit or timeout, ControlError on its error."""
        self._raise_if_poisoned()
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        while not self._lines:
            if self._eof:
                raise self._closed_error(deadline)
            self._fill(deadline)  # at least one look, even with no time left
            if not self._lines and time.monotonic() >= deadline:
                if self._partial:
                    raise self._poison(ControlTimeoutError(
                        f"{self.label} stalled in the middle of a line: {len(self._partial)} bytes and no newline "
                        f"within {wait:g} s: {preview(bytes(self._partial))}"
                    ))
                raise ControlTimeoutError(f"{self.label} did not answer within {wait:g} s")
        line = self._lines.popleft()
        self._queued -= len(line)
        try:
            message = parse_object(line, self.max_depth)
        except LineError as exc:
            raise self._poison(ControlProtocolError(f"{self.label} sent {exc}")) from None
        if "error" in message:
            raise ControlError(f"{self.what} failed: {str(message['error'])[:1000]} (pid {self.proc.pid})")
        return message

    # writing

    def send(self, message: dict[str, Any], timeout_s: float | None = None) -> None:
        """Send one message; ControlClosedError if the child is gone, ControlTimeoutError if it does not read."""
        self._raise_if_poisoned()
        data = memoryview((json.dumps(message, separators=(",", ":")) + "\n").encode())
        wait = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + wait
        sent = 0
        while sent < len(data):
            try:
                sent += os.write(self._in, data[sent:])
                continue
            except BlockingIOError:
                pass
            except OSError as exc:  # EPIPE: the child closed its stdin or exited
                code = self.proc.poll()
                what = f"exited with {_exit_status(code)}" if code is not None else f"closed its stdin ({exc})"
                raise self._poison(ControlClosedError(f"{self.label} {what} before reading a command")) from None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._poison(ControlTimeoutError(
                    f"{self.label} did not read its input within {wait:g} s ({sent} of {len(data)} bytes sent)"
                ))
            self._writable.poll(int(min(remaining, _SLICE_S) * 1000) + 1)

    def request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        self.send(message, timeout_s)
        return self.read(timeout_s)

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
