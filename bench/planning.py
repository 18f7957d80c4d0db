"""Benchmark: kvwire's vectorised transfer planning against sglang's per-layer loop.

Layout like Llama-3-8B: 32 layers x (K, V) = 64 buffers of 32 KiB pages on
both sides (synthetic base addresses: nothing is allocated, only addresses are
computed). Requests of 256, 2048 and 8192 pages are fragmented on both sides
into runs of random length (geometric, mean 1, 8 or 64), each run placed from a
shuffled free list, so consecutive runs are adjacent on neither side.

The baseline is what sglang's Mooncake connector does per request: group the
page ids once into runs (``group_concurrent_contiguous``: ``np.diff``,
``np.split``, ``tolist``), then for every buffer build Python lists of source
addresses, destination addresses and lengths. Both produce the same descriptor
set (checked once per configuration); times are medians of repeated runs in one
process, so the ratio is meaningful even on a noisy machine.

    python bench/planning.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

try:
    import kvwire  # noqa: F401
except ImportError:  # a source checkout without kvwire installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "src"))

from kvwire.benchmark.fragment import place, run_lengths
from kvwire.layout import KVBuffer, KVLayout
from kvwire.planning import plan_transfer

LAYERS = 32
PAGE_BYTES = 32 * 1024
PAGES_PER_BUFFER = 65536
PAGES = (256, 2048, 8192)
MEAN_RUNS = (1, 8, 64)
COLUMNS = (
    "pages",
    "mean_run",
    "buffers",
    "kvwire_us",
    "baseline_us",
    "speedup",
    "descriptors_before",
    "descriptors_after",
)


def make_layout(first_base: int) -> KVLayout:
    """sglang's order: K of every layer, then V of every layer; buffers back to back."""
    stride = PAGE_BYTES * PAGES_PER_BUFFER
    specs = [(layer, role) for role in ("k", "v") for layer in range(LAYERS)]
    return KVLayout(
        tuple(
            KVBuffer(first_base + i * stride, PAGE_BYTES, PAGES_PER_BUFFER, layer, role)  # type: ignore[arg-type]
            for i, (layer, role) in enumerate(specs)
        )
    )


def make_request(rng: np.random.Generator, pages: int, mean_run: int) -> tuple[NDArray[np.int32], NDArray[np.int32]]:
    lengths = run_lengths(rng, pages, mean_run)
    src = place(rng, lengths, PAGES_PER_BUFFER).astype(np.int32)
    dst = place(rng, lengths, PAGES_PER_BUFFER).astype(np.int32)
    return src, dst


# -- the baseline: sglang's mooncake connector ---------------------------------


def group_concurrent_contiguous(
    src_indices: NDArray[Any], dst_indices: NDArray[Any]
) -> tuple[list[list[int]], list[list[int]]]:
    """sglang's grouping of page ids into runs consecutive on both sides."""
    if src_indices.size == 0:
        return [], []
    brk = np.where((np.diff(src_indices) != 1) | (np.diff(dst_indices) != 1))[0] + 1
    src_groups = [g.tolist() for g in np.split(src_indices, brk)]
    dst_groups = [g.tolist() for g in np.split(dst_indices, brk)]
    return src_groups, dst_groups


def baseline_plan(
    src_ptrs: list[int], dst_ptrs: list[int], item_lens: list[int], src_idx: NDArray[Any], dst_idx: NDArray[Any]
) -> list[tuple[list[int], list[int], list[int]]]:
    """Per buffer: Python lists of (src address, dst address, length), as sglang builds them."""
    prefill_blocks, dst_blocks = group_concurrent_contiguous(src_idx, dst_idx)
    out = []
    for src_ptr, dst_ptr, item_len in zip(src_ptrs, dst_ptrs, item_lens, strict=True):
        src_list = [src_ptr + int(p[0]) * item_len for p in prefill_blocks]
        dst_list = [dst_ptr + int(d[0]) * item_len for d in dst_blocks]
        len_list = [item_len * len(p) for p in prefill_blocks]
        out.append((src_list, dst_list, len_list))
    return out


# -- measurement -----------------------------------------------------------------


def median_us(fn: Callable[[], object], budget_s: float = 1.0, min_reps: int = 7, max_reps: int = 300) -> float:
    for _ in range(2):  # warm-up (fills kvwire's pairing cache, page-faults the allocator)
        fn()
    t0 = time.perf_counter_ns()
    fn()
    once = max(time.perf_counter_ns() - t0, 1)
    reps = int(min(max_reps, max(min_reps, budget_s * 1e9 / once)))
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t0)
    return float(np.median(samples)) / 1000.0


def descriptor_set(src: NDArray[np.int64], dst: NDArray[np.int64], length: NDArray[np.int64]) -> NDArray[np.int64]:
    table = np.stack([src, dst, length], axis=1)
    return table[np.lexsort((table[:, 2], table[:, 1], table[:, 0]))]


def bench(seed: int = 0) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    local = make_layout(1 << 40)
    peer = make_layout(1 << 44)
    src_ptrs = [b.base for b in local.buffers]
    dst_ptrs = [b.base for b in peer.buffers]
    item_lens = [b.page_bytes for b in local.buffers]
    rows = []
    for pages in PAGES:
        for mean_run in MEAN_RUNS:
            src_idx, dst_idx = make_request(rng, pages, mean_run)

            def ours(s: NDArray[np.int32] = src_idx, d: NDArray[np.int32] = dst_idx) -> Any:
                return plan_transfer(local, peer, s, dst_ptrs, d)

            def theirs(s: NDArray[np.int32] = src_idx, d: NDArray[np.int32] = dst_idx) -> Any:
                return baseline_plan(src_ptrs, dst_ptrs, item_lens, s, d)

            plan = ours()
            lists = theirs()
            flat = [np.array([x for per in lists for x in per[i]], dtype=np.int64) for i in range(3)]
            if not np.array_equal(descriptor_set(plan.src, plan.dst, plan.length), descriptor_set(*flat)):
                raise SystemExit(f"MISMATCH at pages={pages} mean_run={mean_run}: kvwire and baseline differ")
            kv_us = median_us(ours)
            base_us = median_us(theirs)
            rows.append(
                {
                    "pages": pages,
                    "mean_run": mean_run,
                    "buffers": len(local.buffers),
                    "kvwire_us": round(kv_us, 1),
                    "baseline_us": round(base_us, 1),
                    "speedup": round(base_us / kv_us, 1),
                    "descriptors_before": plan.descriptors_before,
                    "descriptors_after": len(plan),
                }
            )
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in COLUMNS]
    print("  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(COLUMNS, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print a JSON list of rows instead of a table")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the requests (default 0)")
    args = parser.parse_args(argv)
    rows = bench(args.seed)
    if args.json:
        print(json.dumps(rows))
    else:
        print(
            f"transfer planning: {LAYERS} layers x (K, V) = {2 * LAYERS} buffers, {PAGE_BYTES // 1024} KiB pages;"
            " median wall time per request (both sides fragmented)"
        )
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
