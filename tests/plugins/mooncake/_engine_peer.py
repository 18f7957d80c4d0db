"""Receiver process for the MooncakeEngine tests: one real Mooncake engine and one buffer.

Run as ``python _engine_peer.py --size N --seed S``. It fills an N-byte buffer with
seeded random bytes (never zeros, so a missed write is visible), registers it with a
raw ``mooncake.engine.TransferEngine`` (TCP, P2P handshake) and prints one JSON line::

    {"endpoint": "127.0.0.1:15123", "addr": 140..., "size": N, "pid": 1234}

Then it reads commands from stdin, one per line, and answers each with one JSON line:

* ``hash`` -> ``{"sha256": "..."}`` of the whole buffer;
* ``quit`` (or end of input) -> exits 0.

The peer deliberately uses the raw engine, not ``MooncakeEngine``, so the wrapper
under test is only ever the sender. The tests import :func:`initial_buffer` from
this file (pytest puts the test directory on ``sys.path``; there are no packages).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys


def initial_buffer(size: int, seed: int) -> bytes:
    """The bytes the peer starts with; the tests compute the same to build the expected buffer."""
    import numpy as np

    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args()

    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    import numpy as np
    from mooncake.engine import TransferEngine

    buf = np.frombuffer(bytearray(initial_buffer(args.size, args.seed)), dtype=np.uint8)
    addr = int(buf.ctypes.data)
    engine = TransferEngine()
    rc = engine.initialize(args.host, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        print(json.dumps({"error": f"initialize returned {rc}"}), flush=True)
        return 1
    rc = engine.register_memory(addr, args.size)
    if rc != 0:
        print(json.dumps({"error": f"register_memory returned {rc}"}), flush=True)
        return 1
    endpoint = f"{args.host}:{engine.get_rpc_port()}"
    print(json.dumps({"endpoint": endpoint, "addr": addr, "size": args.size, "pid": os.getpid()}), flush=True)

    for line in sys.stdin:
        command = line.strip()
        if command == "hash":
            print(json.dumps({"sha256": hashlib.sha256(buf.tobytes()).hexdigest()}), flush=True)
        elif command == "quit":
            break
        elif command:
            print(json.dumps({"error": f"unknown command {command!r}"}), flush=True)
    engine.unregister_memory(addr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
