"""A JSON-lines control channel to a child process (peer descriptions, commands, completion).

The bench's decode process and the contract kit's receivers both speak it: one
JSON object per line on the child's stdin/stdout, no pickle on the wire. Every
read from the parent side has a deadline, so a dead or frozen child ends in an
error, never a hang; a child reports its own failure as ``{"error": "..."}``.
"""

from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import IO, Any

from kvwire.errors import KvwireError

__all__ = ["ChildProcess", "ControlError", "Handler", "read_command", "reply", "serve"]

#: A child's handler of one command: the message in, the reply out.
Handler = Callable[[dict[str, Any]], dict[str, Any]]


class ControlError(KvwireError, RuntimeError):
    """The child process failed, exited, sent garbage, or did not answer in time."""


def reply(message: dict[str, Any], stream: IO[str] | None = None) -> None:
    """Child side: send one message to the parent."""
    out = stream if stream is not None else sys.stdout
    out.write(json.dumps(message, separators=(",", ":")) + "\n")
    out.flush()


def read_command(stream: IO[str] | None = None) -> dict[str, Any] | None:
    """Child side: the next message from the parent, or None when the parent closed the channel."""
    line = (stream if stream is not None else sys.stdin).readline()
    if not line:
        return None
    message = json.loads(line)
    if not isinstance(message, dict):
        raise ControlError(f"control message must be a JSON object, got {line[:200]!r}")
    return message


def serve(handlers: Mapping[str, Handler]) -> None:
    """Child side: answer commands by name until the parent sends ``quit`` (answered) or closes the channel."""
    while (message := read_command()) is not None:
        command = message.get("cmd")
        if command == "quit":
            reply({"ok": True})
            return
        handler = handlers.get(command) if isinstance(command, str) else None
        reply(handler(message) if handler is not None else {"error": f"unknown command {command!r}"})


class ChildProcess:
    """Parent side: a child running ``python -m <module> <args>`` with a JSON-lines channel."""

    def __init__(self, module: str, args: Sequence[str], *, what: str, timeout_s: float = 60.0) -> None:
        self.what = what
        self.timeout_s = timeout_s
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self._lines: queue.Queue[str] = queue.Queue()
        self._reader = threading.Thread(target=self._pump, name=f"kvwire-control-{self.proc.pid}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put("")  # end of stream

    def read(self, timeout_s: float | None = None) -> dict[str, Any]:
        """The child's next message; ControlError on error, exit, garbage or timeout."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        try:
            line = self._lines.get(timeout=wait)
        except queue.Empty:
            raise ControlError(f"{self.what} (pid {self.proc.pid}) did not answer within {wait:g} s") from None
        if not line:
            code = self.proc.wait(timeout=wait)
            raise ControlError(f"{self.what} (pid {self.proc.pid}) exited with code {code} before answering")
        try:
            message = json.loads(line)
        except ValueError:
            raise ControlError(f"{self.what} sent a line that is not JSON: {line[:200]!r}") from None
        if not isinstance(message, dict):
            raise ControlError(f"{self.what} sent {line[:200]!r}, not a JSON object")
        if "error" in message:
            raise ControlError(f"{self.what} failed: {message['error']}")
        return message

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(message, separators=(",", ":")) + "\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise ControlError(f"{self.what} (pid {self.proc.pid}) is gone: {exc}") from None

    def request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        self.send(message)
        return self.read(timeout_s)

    def close(self) -> None:
        """Ask the child to quit; kill it if it does not, and always reap it."""
        if self.proc.poll() is None:
            try:
                self.request({"cmd": "quit"}, timeout_s=min(self.timeout_s, 30.0))
                self.proc.wait(timeout=min(self.timeout_s, 30.0))
            except (ControlError, subprocess.TimeoutExpired):
                self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=5.0)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()
