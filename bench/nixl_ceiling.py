"""Benchmark: the one-process memcpy ceiling for ``kvwire bench``'s descriptors (what NIXL's numbers compare with).

Builds the requests ``kvwire bench`` sends (a preset's pools, fragmented runs
of geometric length, planned by :func:`kvwire.plan_transfer`) and copies every
descriptor with numpy inside one process: no second process, no transport.
Also copies the same number of bytes as one contiguous block, and (``--threads``,
default 2) the same descriptors cut into that many byte-balanced slices copied by
as many threads at once: the ceiling for kvwire-nixl's ``streams``. Medians of
``--repeat`` passes over all requests; prints GB/s. Pools are torch CPU tensors
when torch is installed, like the bench's (``--backing numpy``: anonymous
mappings advised to use transparent huge pages).

    python bench/nixl_ceiling.py [--preset llama3-8b] [--requests 8] [--tokens 4096] [--threads 2] [--backing auto]
                                 [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire.benchmark.presets import get_preset
from kvwire.workload.fragment import place, run_lengths
from kvwire.workload.memory import KVMemory, allocate


def _views(memory: KVMemory) -> tuple[NDArray[np.int64], list[NDArray[np.uint8]]]:
    """Buffer bases (sorted) and a flat byte view of each buffer, in the same order."""
    order = sorted(range(len(memory.views)), key=lambda i: memory.layout.buffers[i].base)
    bases = np.array([memory.layout.buffers[i].base for i in order], dtype=np.int64)
    return bases, [memory.views[i].reshape(-1) for i in order]


def _copy(plan: kvwire.TransferPlan, src: KVMemory, dst: KVMemory, rows: slice = slice(None)) -> None:
    """Copy the descriptors ``rows`` of ``plan`` (all by default) with numpy slice assignment."""
    sbases, sviews = _views(src)
    dbases, dviews = _views(dst)
    psrc, pdst, plength = plan.src[rows], plan.dst[rows], plan.length[rows]
    si = np.searchsorted(sbases, psrc, side="right") - 1
    di = np.searchsorted(dbases, pdst, side="right") - 1
    soff, doff = (psrc - sbases[si]).tolist(), (pdst - dbases[di]).tolist()
    for s, d, so, do, n in zip(si.tolist(), di.tolist(), soff, doff, plength.tolist()):
        dviews[d][do : do + n] = sviews[s][so : so + n]


def _slices(plan: kvwire.TransferPlan, k: int) -> list[slice]:
    """``k`` byte-balanced row ranges of ``plan`` (as kvwire-nixl cuts a write over its streams)."""
    ends = np.cumsum(plan.length)
    cuts = np.searchsorted(ends, ends[-1] * np.arange(1, k) / k, side="left") + 1
    bounds = [0, *np.minimum(cuts, len(plan)).tolist(), len(plan)]
    return [slice(lo, hi) for lo, hi in itertools.pairwise(bounds) if hi > lo]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--mean-run", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="threads for the parallel copy (default 2)")
    parser.add_argument(
        "--backing", choices=("auto", "numpy", "torch"), default="auto", help="pool memory, as kvwire bench's (auto)"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    preset = get_preset(args.preset)
    pages = -(-args.tokens // preset.page_tokens)
    pool_pages = 2 * pages + 64  # as kvwire bench sizes its pools
    src = allocate(preset.entries(decode_side=False), pool_pages, preset.page_bytes, backing=args.backing)
    dst = allocate(preset.entries(decode_side=False), pool_pages, preset.page_bytes, backing=args.backing)
    src.fill_random(args.seed)
    dst.fill_random(args.seed + 1)
    rng = np.random.default_rng(args.seed + 7)
    ptrs = [b.base for b in dst.layout.buffers]
    plans = []
    for _ in range(args.requests):
        lengths = run_lengths(rng, pages, args.mean_run)
        s = place(rng, lengths, pool_pages).astype(np.int32)
        d = place(rng, lengths, pool_pages).astype(np.int32)
        plans.append(kvwire.plan_transfer(src.layout, dst.layout, s, ptrs, d))
    nbytes = sum(p.nbytes for p in plans)
    block_src, block_dst = np.ones(plans[0].nbytes, np.uint8), np.zeros(plans[0].nbytes, np.uint8)
    np.copyto(block_dst, block_src)  # fault every page in before timing

    fragmented, contiguous, parallel = [], [], []
    pool = ThreadPoolExecutor(max(1, args.threads))
    for _ in range(args.repeat):
        start = time.perf_counter()
        for plan in plans:
            _copy(plan, src, dst)
        fragmented.append(nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        for plan in plans:
            list(pool.map(lambda rows, plan=plan: _copy(plan, src, dst, rows), _slices(plan, max(1, args.threads))))
        parallel.append(nbytes / (time.perf_counter() - start) / 1e9)
        start = time.perf_counter()
        for _ in plans:
            np.copyto(block_dst, block_src)
        contiguous.append(block_src.nbytes * len(plans) / (time.perf_counter() - start) / 1e9)
    result: dict[str, Any] = {
        "preset": preset.name,
        "backing": src.backing,
        "requests": args.requests,
        "bytes_per_request": plans[0].nbytes,
        "descriptors_per_request": round(statistics.mean(len(p) for p in plans)),
        "memcpy_descriptors_gbps": round(statistics.median(fragmented), 3),
        "memcpy_contiguous_gbps": round(statistics.median(contiguous), 3),
        "threads": args.threads,
        "memcpy_descriptors_threads_gbps": round(statistics.median(parallel), 3),
    }
    pool.shutdown()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"one-process numpy copy, {preset.name} ({src.backing} pools), {args.requests} x {args.tokens} tokens "
              f"({result['bytes_per_request'] / 2**20:.0f} MiB, {result['descriptors_per_request']} descriptors each)")
        print(f"  same descriptors   {result['memcpy_descriptors_gbps']:7.3f} GB/s")
        print(f"  one block          {result['memcpy_contiguous_gbps']:7.3f} GB/s")
        print(f"  same, {args.threads} threads   {result['memcpy_descriptors_threads_gbps']:7.3f} GB/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
