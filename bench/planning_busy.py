"""Benchmark: kvwire's transfer planning in a busy process, against planning alone.

One process, one request shape (2,048 pages x 64 buffers of 32 KiB pages, runs
of mean length 4 on both sides: 32,512 descriptors) and a one-page request.
Each kvwire planner (this kvwire, and the kvwire of ``--before`` imported side
by side) is timed three ways, rounds interleaved so that noise hits all alike:

* alone: plan after plan, nothing else in between;
* interleaved: before each timed plan, one untimed sglang-style loop (sglang's
  Mooncake connector building its per-buffer Python lists of (src, dst, len)
  from ``group_concurrent_contiguous`` runs, for the same request), whose lists
  stay alive while kvwire plans, as in a serving process;
* after a busy-wait: the same plan after spinning as long as that loop took,
  allocating nothing (a control: what time away alone costs);
* the sglang-style loop alone, for scale;
* ``floor``: twelve numpy calls on the request's page ids, about the fewest a
  vectorised run-finder needs (differences, breaks, starts, counts, gathers, a
  bound, the address arithmetic), validating nothing and writing no plan. It is
  no planner; it shows what a process that was busy elsewhere costs this
  machine's CPU for any numpy code of this shape.

Medians in microseconds; ``busy/alone`` is interleaved over alone, ``now/before``
compares the two kvwires. Absolute times are this machine's; the targets
(<= 150 us interleaved, <= 10 us for one page) are issue 24's.

    python bench/planning_busy.py [--json] [--before REV] [--rounds N]
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from planning import _planner, baseline_plan, load_before, make_layout, make_request, print_table

from kvwire.planning.planner import plan_transfer

#: this kvwire before the busy-process work (issue 24, deliverable 4)
BEFORE = "df0cf45d70e54dfe9fcce5e1ad54d5dda43bf104"


def _time_ns(fn: Callable[[], object]) -> int:
    t0 = time.perf_counter_ns()
    fn()
    return time.perf_counter_ns() - t0


def measure(
    planners: dict[str, Callable[[], object]], busy: Callable[[], object], rounds: int, reps: int
) -> tuple[dict[str, list[int]], dict[str, list[int]], dict[str, list[int]], list[int]]:
    """(alone, interleaved, after a busy-wait) samples per planner, and the busy loop's; rounds alternate them."""
    alone: dict[str, list[int]] = {name: [] for name in planners}
    inter: dict[str, list[int]] = {name: [] for name in planners}
    wait: dict[str, list[int]] = {name: [] for name in planners}
    loop: list[int] = []
    for fn in planners.values():  # warm-up: pairing cache, output pool
        fn()
        fn()
    names = list(planners)
    for k in range(rounds):
        order = names[k % len(names) :] + names[: k % len(names)]  # who goes first changes each round
        for name in order:
            fn = planners[name]
            fn()  # untimed: the first plan after the busy part of the round is not alone
            alone[name].extend(_time_ns(fn) for _ in range(reps))
        for name in order:
            fn = planners[name]
            for _ in range(reps):
                t0 = time.perf_counter_ns()
                held = busy()  # alive while kvwire plans, as sglang's lists are
                t1 = time.perf_counter_ns()
                inter[name].append(_time_ns(fn))
                loop.append(t1 - t0)
                del held
                end = time.perf_counter_ns() + t1 - t0
                while time.perf_counter_ns() < end:  # control: as long, allocating nothing
                    pass
                wait[name].append(_time_ns(fn))
    return alone, inter, wait, loop


def numpy_floor(src: np.ndarray, dst: np.ndarray, page_bytes: int) -> Callable[[], object]:
    """Twelve numpy calls on ``src`` and ``dst`` (see the module docstring): a floor, not a planner."""

    def floor() -> object:
        brk = np.subtract(src[1:], src[:-1]) != 1
        brk |= np.subtract(dst[1:], dst[:-1]) != 1
        starts = np.flatnonzero(brk)
        counts = np.diff(starts)
        first_src, first_dst = src.take(starts), dst.take(starts)
        size = np.int64(page_bytes)
        return np.maximum.reduce(counts, initial=0), np.multiply(first_src, size), np.multiply(first_dst, size)

    return floor


def run(before_rev: str | None, rounds: int, reps: int, seed: int) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    s, d = make_request(rng, 2048, 4)
    local, peer = make_layout(1 << 40), make_layout(1 << 44)
    src_ptrs, dst_ptrs = [b.base for b in local.buffers], [b.base for b in peer.buffers]
    item_lens = [b.page_bytes for b in local.buffers]

    def busy() -> object:
        return baseline_plan(src_ptrs, dst_ptrs, item_lens, s, d)

    before = None
    if before_rev and load_before(before_rev) is not None:
        before = importlib.import_module("kvwire_before.planning.planner")
    kinds = None
    if before is not None:  # what make_layout needs of the old kvwire
        kinds = SimpleNamespace(
            KVBuffer=importlib.import_module("kvwire_before.layout.buffers").KVBuffer,
            KVLayout=importlib.import_module("kvwire_before.layout.kv_layout").KVLayout,
        )
    rows = []
    for request, (src, dst), target in (("2048 pages, mean run 4", (s, d), 150.0), ("1 page", (s[:1], d[:1]), 10.0)):
        planners = {"now": _planner(plan_transfer, local, peer, src, dst)}
        if len(src) > 1:
            planners["floor"] = numpy_floor(src, dst, item_lens[0])
        if before is not None:
            old_local, old_peer = make_layout(1 << 40, kinds), make_layout(1 << 44, kinds)
            planners["before"] = _planner(before.plan_transfer, old_local, old_peer, src, dst)
        alone, inter, wait, loop = measure(planners, busy, rounds, reps)
        med = {name: [float(np.median(x[name])) / 1e3 for x in (alone, inter, wait)] for name in planners}
        for name in planners:
            a, i, w = med[name]
            row: dict[str, Any] = {
                "request": request,
                "kvwire": name,
                "alone_us": round(a, 1),
                "busy_us": round(i, 1),
                "busy/alone": round(i / a, 2),
                "after_wait_us": round(w, 1),
                "now/before_alone": "",
                "now/before_busy": "",
                "sglang_loop_us": round(float(np.median(loop)) / 1e3, 1),
                "target_busy_us": target,
            }
            if name == "now" and "before" in med:
                row["now/before_alone"] = round(a / med["before"][0], 2)
                row["now/before_busy"] = round(i / med["before"][1], 2)
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the request (default 0)")
    parser.add_argument("--before", default=BEFORE, help="git revision of the kvwire to compare with ('' for none)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds of alone and interleaved runs (default 20)")
    parser.add_argument("--reps", type=int, default=5, help="timed plans per planner, mode and round (default 5)")
    args = parser.parse_args(argv)
    rows = run(args.before or None, args.rounds, args.reps, args.seed)
    if args.json:
        print(json.dumps(rows))
        return 0
    print(
        "kvwire planning alone and in a busy process (each plan right after an sglang-style per-buffer list loop "
        "for the same request); median us, one process"
    )
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
