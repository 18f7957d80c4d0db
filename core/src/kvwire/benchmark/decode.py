"""The bench's decode process: allocate, register, publish, then scramble and verify pages on request.

Run by ``kvwire bench`` as ``python -m kvwire.benchmark.decode '<json args>'``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.benchmark.pools import Pool
from kvwire.benchmark.presets import get_preset
from kvwire.benchmark.wire import digest, is_split, peer_description
from kvwire.config import BackendConfig
from kvwire.control import read_command, reply
from kvwire.registry import connect


def _views(pool: Pool, kind: str | None) -> list[NDArray[np.uint8]]:
    """Host-readable views of the buffers of one memory kind (all buffers when ``kind`` is None)."""
    out = []
    for i, buf in enumerate(pool.layout.buffers):
        if kind is None or buf.memory == kind:
            view = pool.views[i]
            out.append(view if view.size else pool.tensors[i].cpu().numpy())
    return out


def _page_sets(pool: Pool, message: dict[str, Any]) -> list[tuple[str | None, NDArray[np.int64]]]:
    """(memory kind, pages) addressed by a request: split layouts have two page-id spaces."""
    host = np.asarray(message["host_pages"], np.int64)
    if not is_split(pool.layout):
        return [(None, host)]
    return [("host", host), ("device", np.asarray(message["device_pages"], np.int64))]


def main(raw: str) -> int:
    args = json.loads(raw)
    try:
        preset = get_preset(args["preset"])
        pool = Pool(preset, int(args["pages"]), decode_side=True, device=args.get("device", "cpu"))
        pool.fill_random(int(args["seed"]))
        conn = connect(args["backend"], BackendConfig.from_dict(args.get("config", {})))
        conn.register_kv_buffers(pool.layout)
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    reply(peer_description(conn.endpoint(), pool.layout))
    rng = np.random.default_rng(int(args["seed"]) + 1)
    with conn:
        while (message := read_command()) is not None and message.get("cmd") != "quit":
            if message.get("cmd") == "scramble":  # make stale bytes from an earlier write detectable
                for kind, pages in _page_sets(pool, message):
                    for i, buf in enumerate(pool.layout.buffers):
                        if kind is None or buf.memory == kind:
                            fresh = rng.integers(0, 256, (pages.size, buf.page_bytes), dtype=np.uint8)
                            if pool.views[i].size:
                                pool.views[i][pages] = fresh
                            else:
                                import torch

                                idx = torch.from_numpy(pages).to(pool.tensors[i].device)
                                pool.tensors[i][idx] = torch.from_numpy(fresh).to(pool.tensors[i].device)
                reply({"ok": True})
            elif message.get("cmd") == "verify":
                results = [
                    digest(_views(pool, kind), pages) == message["digest"] for kind, pages in _page_sets(pool, message)
                ]
                reply({"ok": all(results)})
            else:
                reply({"error": f"unknown command {message.get('cmd')!r}"})
    if message is not None:
        reply({"ok": True})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
