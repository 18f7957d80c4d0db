"""A misbehaving child for the control channel's tests: ``python control_peer.py MODE``.

Every mode misbehaves at once and then stays alive (ignoring stdin, SIGTERM
and quit) unless it exits, so the parent has to detect the fault and kill it.
"""

from __future__ import annotations

import os
import signal
import sys
import time

CHUNK = b"x" * (1 << 16)


def write(data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(1, view) :]


def linger() -> None:
    time.sleep(600)


def main(mode: str) -> int:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if mode == "deep":
        write(b"[" * 100_000 + b"]" * 100_000 + b"\n")
    elif mode == "not_utf8":
        write(b'\xff\xfe{"endpoint": "x"}\n')
    elif mode == "not_json":
        write(b"hello, parent\n")
    elif mode == "array":
        write(b'["endpoint", 1]\n')
    elif mode == "closed_stdout":
        os.close(1)
    elif mode == "stall":
        write(b'{"endpoint": "tcp://')
    elif mode == "huge_line":  # 100 MB endpoint
        write(b'{"format": "kvwire-peer", "endpoint": "')
        for _ in range(100 * 2**20 // len(CHUNK)):
            write(CHUNK)
        write(b'"}\n')
    elif mode == "flood":  # no newline, ever
        while True:
            write(CHUNK)
    elif mode == "flood_lines":  # valid short lines, forever
        while True:
            write(b"{}\n" * 10_000)
    elif mode == "exit3":
        return 3
    elif mode == "error":
        write(b'{"error": "cannot allocate pages"}\n')
    elif mode == "ignore_quit":  # a valid first message, then reads commands and never answers
        write(b'{"ok": true}\n')
        while sys.stdin.buffer.readline():
            pass
    elif mode == "noisy_library":  # a well-behaved child whose "native library" writes to fd 1, as UCX does
        from kvwire.control import claim_stdout, reply, serve

        channel = claim_stdout()
        write(b"[1796365956.045520] [vm:2620 :0]            sock.c:355  UCX  WARN  unable to read\n")
        print("and a Python library's print")
        reply({"ok": True}, channel)

        def echo(message: dict[str, object]) -> dict[str, object]:
            write(b"UCX  WARN  again, between two replies\n")
            return {"echo": message.get("x")}

        serve({"echo": echo}, stdout=channel)
        return 0
    elif mode != "silent":
        raise SystemExit(f"unknown mode {mode!r}")
    linger()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
