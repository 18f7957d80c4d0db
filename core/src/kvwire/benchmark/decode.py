"""The bench's decode process: allocate, register, publish, then verify each request's pages.

Run by ``kvwire bench`` as ``python -m kvwire.benchmark.decode '<json args>'``.
"""

from __future__ import annotations

import json
import sys

import numpy as np

from kvwire.benchmark.pools import Pool
from kvwire.benchmark.presets import get_preset
from kvwire.benchmark.wire import digest, peer_description, read_message, send_message
from kvwire.config import BackendConfig
from kvwire.registry import connect


def main(raw: str) -> int:
    args = json.loads(raw)
    out = sys.stdout
    try:
        preset = get_preset(args["preset"])
        pool = Pool(preset, int(args["pages"]), decode_side=True, device=args.get("device", "cpu"))
        pool.fill_random(int(args["seed"]))
        conn = connect(args["backend"], BackendConfig(timeout_s=float(args.get("timeout_s", 10.0))))
        conn.register_kv_buffers(pool.layout)
    except Exception as exc:
        send_message(out, {"error": f"{type(exc).__name__}: {exc}"})
        return 1
    send_message(out, peer_description(conn.endpoint(), pool.layout))
    kinds = [b.memory for b in pool.layout.buffers]
    with conn:
        while True:
            try:
                message = read_message(sys.stdin)
            except EOFError:
                return 0
            if message.get("cmd") != "verify":
                send_message(out, {"ok": True})
                return 0
            results = {}
            for kind, key in (("host", "host_pages"), ("device", "device_pages")):
                if key in message and message[key] is not None:
                    views = [
                        v if v.size else pool.tensors[i][:].cpu().numpy()
                        for i, v in enumerate(pool.views)
                        if kinds[i] == kind
                    ]
                    results[kind] = digest(views, np.asarray(message[key], np.int64)) == message["digest"]
            send_message(out, {"id": message["id"], "ok": all(results.values()) and bool(results)})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
