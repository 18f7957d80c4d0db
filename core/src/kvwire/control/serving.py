"""The answering side of the control channel: read commands, dispatch them to handlers, reply.

The same functions serve a child process over stdin/stdout and a decode process
over a TCP connection (pass the connection's binary reader and text writer).
Every line is bounded and parsed by :func:`kvwire.control.jsonlines.parse_object`; a bad
line or a failing handler is answered with ``{"error": ...}``, never a crash.
Over a keyed TCP connection the reader and writer are :func:`~kvwire.control.accept_one`'s
framed ones (:mod:`kvwire.control.frames`): a frame that fails authentication is not a
bad line to answer but the end of the connection, so :func:`read_command` and
:func:`serve` raise its :class:`~kvwire.control.ControlAuthError` (nothing of it
reaches a handler) and the caller closes the connection.

A child's stdout is its channel, and only its: :func:`claim_stdout` keeps a private
descriptor for the replies and points file descriptor 1 at stderr, so a native
library a backend loads (UCX under NIXL prints its warnings to fd 1) cannot put a
line of its own between two replies.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from collections.abc import Callable, Mapping
from typing import IO, Any

from kvwire.control.errors import ControlProtocolError
from kvwire.control.jsonlines import DEFAULT_MAX_DEPTH, DEFAULT_MAX_LINE, LineError, parse_object, preview
from kvwire.stdout import take_stdout

__all__ = ["Handler", "claim_stdout", "read_command", "reply", "serve"]

#: A handler of one command: the message in, the reply out.
Handler = Callable[[dict[str, Any]], dict[str, Any]]

_CHUNK = 1 << 16
_claimed: IO[str] | None = None
_claim_lock = threading.Lock()


def claim_stdout() -> IO[str]:
    """Child side, first thing: the channel's own writer; fd 1 and ``sys.stdout`` go to stderr from now on.

    Measured: under load, NIXL's UCX printed ``[...] sock.c:355 UCX WARN ...`` to fd 1 of a contract-kit
    receiver, and the parent refused the line as "not JSON". Whatever a library writes to stdout after
    this call goes to the child's stderr (the parent's, inherited). It takes fd 1 over for the rest of the
    process, so only a child's entry point calls it; a second call returns the same writer.
    """
    global _claimed
    with _claim_lock:
        if _claimed is None:
            channel = os.fdopen(take_stdout(), "w", encoding="utf-8")
            sys.stdout = sys.stderr
            _claimed = channel
        return _claimed


def reply(message: dict[str, Any], stream: IO[str] | None = None) -> None:
    """Child side: send one message to the parent."""
    out = stream if stream is not None else sys.stdout
    out.write(json.dumps(message, separators=(",", ":")) + "\n")
    out.flush()


def read_command(
    stream: IO[bytes] | None = None, *, max_line: int = DEFAULT_MAX_LINE, max_depth: int = DEFAULT_MAX_DEPTH
) -> dict[str, Any] | None:
    """Child side: the parent's next message, None at EOF; ControlProtocolError for a bad line (consumed whole).

    From a framed reader, ControlAuthError (or ControlClosedError, cut in the middle of a frame) ends the connection.
    """
    source = stream if stream is not None else sys.stdin.buffer
    line = source.readline(max_line + 1)
    if not line:
        return None
    if line.endswith(b"\n"):
        line = line[:-1]
        if len(line) > max_line:  # a framed reader's payload (its frame was read whole, within the bound)
            raise ControlProtocolError(f"bad command: a line over {max_line} bytes: {preview(line)}")
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
