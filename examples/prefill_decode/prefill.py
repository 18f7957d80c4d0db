"""Prefill side: start decode.py, read its kvwire.PeerDescription from a pipe, send KV pages into it.

    python examples/prefill_decode/prefill.py [BACKEND]    # default mooncake (TCP on 127.0.0.1)

Any backend with the ``interprocess`` and ``notifications`` capabilities works;
``local`` is refused at connect (it only reaches endpoints of its own process).
The send is non-blocking (``submit_kvcache``) and carries a notification: the
decode side learns from kvwire that the pages have landed.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

import kvwire

LAYERS, PAGES, PAGE_BYTES = 4, 256, 2048
CONFIG = kvwire.BackendConfig(process_settings=True)  # a standalone process: the engine's log lines are captured


def main(backend: str) -> int:
    rng = np.random.default_rng(0)
    bufs = [rng.integers(0, 256, (PAGES, PAGE_BYTES), np.uint8) for _ in range(2 * LAYERS)]  # K of each layer, then V
    src = rng.choice(PAGES, 64, replace=False).astype(np.int32)  # scattered pages on both sides
    dst = rng.choice(PAGES, 64, replace=False).astype(np.int32)
    with kvwire.connect(backend, CONFIG, features={"interprocess", "notifications"}) as conn:  # refuses `local`
        conn.register_kv_buffers(kvwire.KVLayout.mha(bufs[:LAYERS], bufs[LAYERS:]))
        command = [sys.executable, str(Path(__file__).with_name("decode.py")), backend]
        with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as decode:
            assert decode.stdin is not None and decode.stdout is not None
            peer = kvwire.PeerDescription.from_dict(json.loads(decode.stdout.readline()))
            conn.add_peer(peer.endpoint, peer.layout)
            ptrs = [b.base for b in peer.layout.buffers]
            future = conn.submit_kvcache(peer.endpoint, src, ptrs, dst, notification=b"request-1")
            print(f"prefill: sent {future.result(timeout=30)} bytes to {peer.endpoint}")
            digest = hashlib.blake2b(b"".join(buf[src].tobytes() for buf in bufs)).hexdigest()
            decode.stdin.write(json.dumps({"pages": dst.tolist(), "digest": digest}) + "\n")
            decode.stdin.close()
            return decode.wait()


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "mooncake"))
    except kvwire.KvwireError as exc:
        sys.exit(f"prefill: {exc}")
