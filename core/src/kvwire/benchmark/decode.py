"""The bench's decode process: allocate, register, publish, then scramble and verify pages on request.

Run by ``kvwire bench`` as ``python -m kvwire.benchmark.decode '<json args>'``.
``scramble`` sets the target pages to a byte value (memset speed) and records a
digest of their guard pages (the pages just before and after every target
run); ``verify`` then checks the target pages against the sender's digest and
that the guard pages did not change, so a write that fell short or overran is
caught.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.benchmark.presets import get_preset
from kvwire.config import BackendConfig
from kvwire.control import reply, serve
from kvwire.layout import MemoryKind
from kvwire.peer import PeerDescription
from kvwire.registry import connect
from kvwire.workload.memory import KVMemory, allocate

PageSets = list[tuple[MemoryKind | None, NDArray[np.int64]]]


def page_sets(memory: KVMemory, message: dict[str, Any]) -> PageSets:
    """(memory kind, pages) addressed by a request: a split layout has two page-id spaces."""
    host = np.asarray(message["host_pages"], np.int64)
    if not memory.layout.is_split:
        return [(None, host)]
    return [("host", host), ("device", np.asarray(message["device_pages"], np.int64))]


def guard_pages(pages: NDArray[np.int64], num_pages: int) -> NDArray[np.int64]:
    """The pages next to ``pages`` that are not in it: where a write off by one page would land."""
    near = np.concatenate([pages - 1, pages + 1])
    near = near[(near >= 0) & (near < num_pages)]
    return np.setdiff1d(near, pages)


class DecodeSide:
    """The decode side's memory and the scramble/verify commands."""

    def __init__(self, memory: KVMemory) -> None:
        self.memory = memory
        self.fill = 0
        self.guards: list[str] = []

    def scramble(self, message: dict[str, Any]) -> dict[str, Any]:
        self.fill = (self.fill + 1) % 256  # a different value each time: stale bytes never pass
        self.guards = []
        for kind, pages in page_sets(self.memory, message):
            self.memory.fill_pages(pages, self.fill, kind)
            self.guards.append(self.memory.digest(guard_pages(pages, self.memory.num_pages), kind))
        return {"ok": True}

    def verify(self, message: dict[str, Any]) -> dict[str, Any]:
        sets = page_sets(self.memory, message)
        targets = [self.memory.digest(pages, kind) for kind, pages in sets]
        guards = [self.memory.digest(guard_pages(pages, self.memory.num_pages), kind) for kind, pages in sets]
        # every page set holds a full copy of the sender's pages (split presets mirror all layers per kind)
        ok = all(t == message["digest"] for t in targets)
        return {"ok": ok, "guards_ok": not self.guards or guards == self.guards}


def main(raw: str) -> int:
    args = json.loads(raw)
    try:
        preset = get_preset(args["preset"])
        device = args.get("device", "cpu")
        entries = preset.entries(decode_side=True, device=device)
        memory = allocate(entries, int(args["pages"]), preset.page_bytes, backing="auto", device=device)
        memory.fill_random(int(args["seed"]))
        conn = connect(args["backend"], BackendConfig.from_dict(args.get("config", {})))
        conn.register_kv_buffers(memory.layout)
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    reply(PeerDescription(conn.endpoint(), memory.layout).to_dict())
    side = DecodeSide(memory)
    with conn:
        serve({"scramble": side.scramble, "verify": side.verify})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
