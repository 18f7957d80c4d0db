"""What one warm send costs on its way to the transport: frames, modules, threads, microseconds.

Runs, side by side in one process, on the ``local`` backend (memmove between buffers of this process):

* ``Connection.send_kvcache``: the public call (checks, plan, the backend's write);
* ``backend.send_kvcache``: the backend's hook called directly (its own checks and plan, no Connection);
* ``transport.write``: the transport's write of an already-made plan (the floor: no checks, no planning).

Frames are Python calls (``sys.setprofile`` / ``threading.setprofile``) during one warm send, modules the
distinct source files they run in, threads the distinct threads they run on. Time: the median of
``--sends`` warm sends after ``--warmup``, alternating the three round by round. Prints a table with the
ratios against the direct hook.

    .venv/bin/python bench/send_path.py [--pages 16] [--sends 2000] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import numpy as np

import kvwire
from kvwire.planning.planner import plan_transfer

KVWIRE_DIR = kvwire.__file__.rsplit("/", 1)[0]


def fresh_threads(conn: kvwire.Connection) -> None:
    """End a Connection's idle call threads (if it has any), so the traced call starts one the profile sees.

    ``threading.setprofile`` reaches only threads started after it (Python 3.11 has no ``setprofile_all_threads``).
    """
    calls = getattr(conn, "_calls", None)
    idle = getattr(calls, "_idle", None)
    if calls is not None and idle:
        calls._idle = []
        for inbox in idle:
            inbox.put(None)


def trace(fn: Callable[[], object]) -> tuple[int, int, int, int, int]:
    """(frames, modules, kvwire frames, kvwire modules, threads) of the Python calls ``fn()`` makes."""
    calls: list[tuple[str, int]] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            calls.append((frame.f_code.co_filename, threading.get_ident()))

    threading.setprofile(profile)
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    ours = [f for f, _ in calls if f.startswith(KVWIRE_DIR)]
    return len(calls), len({f for f, _ in calls}), len(ours), len(set(ours)), len({t for _, t in calls})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=16, help="pages per send (default 16)")
    parser.add_argument("--sends", type=int, default=2000, help="timed sends per path (default 2000)")
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)

    layers, page_bytes = 4, 4096
    src = [np.random.default_rng(i).integers(0, 255, (256, page_bytes), np.uint8) for i in range(layers)]
    dst = [np.zeros_like(a) for a in src]
    with kvwire.connect("local") as sender, kvwire.connect("local") as receiver:
        sender.register_kv_buffers(kvwire.KVLayout.mla(src))
        receiver.register_kv_buffers(kvwire.KVLayout.mla(dst))
        peer, layout = receiver.endpoint(), kvwire.KVLayout.mla(dst)
        sender.add_peer(peer, layout)
        ptrs = [int(a.ctypes.data) for a in dst]
        ids = np.arange(args.pages, dtype=np.int32) * 2  # every other page: one descriptor per page and layer
        backend = sender.backend
        plan = plan_transfer(kvwire.KVLayout.mla(src), layout, ids, ptrs, ids)
        paths: dict[str, Callable[[], object]] = {
            "Connection.send_kvcache": lambda: sender.send_kvcache(peer, ids, ptrs, ids),
            "backend.send_kvcache": lambda: backend.send_kvcache(peer, ids, ptrs, ids, None),
            "transport.write": lambda: backend.transport.write(peer, plan),
        }
        times: dict[str, list[float]] = {name: [] for name in paths}
        for round_ in range(args.warmup + args.sends):
            order = list(paths.items())
            order = order[round_ % 3 :] + order[: round_ % 3]
            for name, fn in order:
                started = time.perf_counter()
                fn()
                if round_ >= args.warmup:
                    times[name].append(time.perf_counter() - started)
        assert all(np.array_equal(d[ids], s[ids]) for d, s in zip(dst, src))
        rows = []
        base = statistics.median(times["backend.send_kvcache"])
        for name, fn in paths.items():
            fresh_threads(sender)
            frames, modules, own_frames, own_modules, threads = trace(fn)
            median = statistics.median(times[name])
            rows.append(
                {
                    "path": name,
                    "frames": frames,
                    "modules": modules,
                    "kvwire_frames": own_frames,
                    "kvwire_modules": own_modules,
                    "threads": threads,
                    "median_us": round(median * 1e6, 1),
                    "vs_direct_hook": round(median / base, 2),
                }
            )
    if args.json:
        print(json.dumps({"kvwire": kvwire.__version__, "pages": args.pages, "rows": rows}, indent=2))
        return 0
    print(f"kvwire {kvwire.__version__}, backend local, {args.pages} pages x {layers} layers of {page_bytes} B, "
          f"median of {args.sends} warm sends each, alternating")  # fmt: skip
    print("frames and modules: all Python calls (kvwire's own in brackets); ratio: median over the direct hook's")
    print(f"{'path':<26}{'frames':>12}{'modules':>10}{'threads':>9}{'median us':>11}{'ratio':>8}")
    for r in rows:
        frames, modules = f"{r['frames']} ({r['kvwire_frames']})", f"{r['modules']} ({r['kvwire_modules']})"
        print(
            f"{r['path']:<26}{frames:>12}{modules:>10}{r['threads']:>9}{r['median_us']:>11.1f}"
            f"{r['vs_direct_hook']:>7.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
