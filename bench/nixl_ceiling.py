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

``--with-nixl`` also runs the main job, ``kvwire bench --backend nixl --json``
with the same preset, requests, tokens, mean run and seed (a subprocess; it
builds the very same plans: the same pools, the same random stream, the same
planner, checked by its descriptor counts; not for split presets, whose decode
side the bench also gives device pages), ``--rounds`` times, alternating
with the memcpy passes (memcpy, nixl, memcpy, nixl, ...) so that the load of a
shared machine falls on both alike, and prints the medians and the ratio
kvwire-nixl / 2-thread memcpy (also the median of the per-round ratios).
``--option KEY=VALUE`` is passed on to ``kvwire bench`` (e.g. ``streams=3``).

``--with-cma`` (Linux) also times the kernel's cross-process copy of the same
descriptors, with no transport: the same number of threads each call
``process_vm_writev`` (up to 1,024 descriptors a call) into a child process
holding an identical destination pool. UCX's ``cma`` transport, which
kvwire-nixl uses between processes of one host, copies with that call, so
this row separates what the kernel's copy costs from what UCX, NIXL and
kvwire add. Pools are private mappings advised to use transparent huge pages
(:func:`kvwire.workload.memory.allocate`): the kernel pins every page it
writes in the other process, and with 4 KiB pages that pinning cost
kvwire-nixl about a quarter of its throughput here.

    python bench/nixl_ceiling.py [--preset llama3-8b] [--requests 8] [--tokens 4096] [--threads 2] [--backing auto]
                                 [--with-nixl [--rounds 5] [--option KEY=VALUE ...]] [--with-cma] [--json]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import itertools
import json
import statistics
import subprocess
import sys
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


#: What the child of ``--with-cma`` runs: the destination pool, its buffer bases on stdout, then wait for EOF.
_CMA_CHILD = """
import json, sys
import numpy as np
from kvwire.benchmark.presets import get_preset
from kvwire.workload.memory import allocate
preset, pages, backing, seed = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
p = get_preset(preset)
dst = allocate(p.entries(decode_side=False), pages, p.page_bytes, backing=backing)
dst.fill_random(seed)
print(json.dumps([b.base for b in dst.layout.buffers]), flush=True)
for line in sys.stdin:  # page ids: answer their digest, from the child's own view of its pool
    print(dst.digest(np.array(json.loads(line), dtype=np.int64)), flush=True)
"""
_IOV_MAX = 1024


class _Cma:
    """A child process holding a pool laid out like ``dst``; copies plans into it with ``process_vm_writev``."""

    def __init__(self, args: argparse.Namespace, dst: KVMemory, pool_pages: int) -> None:
        command = [sys.executable, "-c", _CMA_CHILD, args.preset, str(pool_pages), args.backing, str(args.seed + 1)]
        self.child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.child.stdout is not None
        line = self.child.stdout.readline()
        if not line:
            self.close()
            raise SystemExit(f"the cma child exited before it held its pool (exit {self.child.returncode})")
        child_bases = json.loads(line)
        here = [b.base for b in dst.layout.buffers]
        order = np.argsort(here)
        self.here = np.array(here, dtype=np.int64)[order]  # dst's bases, sorted
        self.there = np.array(child_bases, dtype=np.int64)[order]  # the child's base of the same buffer
        self.libc = ctypes.CDLL(None, use_errno=True)
        for call in (self.libc.process_vm_writev, self.libc.process_vm_readv):
            call.restype = ctypes.c_ssize_t
            call.argtypes = [
                ctypes.c_int,
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_void_p,
                ctypes.c_ulong,
                ctypes.c_ulong,
            ]

    def iovecs(self, plan: kvwire.TransferPlan) -> tuple[NDArray[np.uint64], NDArray[np.uint64]]:
        """(local, remote) iovec arrays of ``plan``: its sources as they are, its targets moved into the child."""
        b = np.searchsorted(self.here, plan.dst, side="right") - 1
        local = np.stack([plan.src, plan.length], axis=1).astype(np.uint64)
        remote = np.stack([plan.dst - self.here[b] + self.there[b], plan.length], axis=1).astype(np.uint64)
        return np.ascontiguousarray(local), np.ascontiguousarray(remote)

    def write(self, local: NDArray[np.uint64], remote: NDArray[np.uint64], rows: slice) -> None:
        """Write descriptors ``rows``, at most ``_IOV_MAX`` a call; the whole length, or SystemExit."""
        start, stop, _ = rows.indices(local.shape[0])
        for lo in range(start, stop, _IOV_MAX):
            hi = min(stop, lo + _IOV_MAX)
            want = int(local[lo:hi, 1].sum())
            got = self.libc.process_vm_writev(
                self.child.pid, local[lo:].ctypes.data, hi - lo, remote[lo:].ctypes.data, hi - lo, 0
            )
            if got != want:
                raise SystemExit(f"process_vm_writev wrote {got} of {want} bytes (errno {ctypes.get_errno()})")

    def digest(self, pages: NDArray[np.integer[Any]]) -> str:
        """The child's digest of ``pages`` of its pool (every buffer, in layout order), computed in the child."""
        assert self.child.stdin is not None and self.child.stdout is not None
        self.child.stdin.write(json.dumps(pages.tolist()) + "\n")
        self.child.stdin.flush()
        return self.child.stdout.readline().strip()

    def close(self) -> None:
        """End the child: EOF on its stdin, then kill it if it has not exited within 30 s."""
        assert self.child.stdin is not None
        with contextlib.suppress(OSError):
            self.child.stdin.close()
        try:
            self.child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.child.kill()
            self.child.wait()


def _nixl_bench(args: argparse.Namespace) -> dict[str, Any]:
    """One ``kvwire bench --backend nixl --json`` run with this run's preset, sizes and seed."""
    command = [sys.executable, "-m", "kvwire", "bench", "--backend", "nixl", "--preset", args.preset]
    command += ["--requests", str(args.requests), "--tokens", str(args.tokens), "--mean-run", str(args.mean_run)]
    command += ["--seed", str(args.seed), "--json"]
    for option in args.option:
        command += ["--option", option]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"kvwire bench failed (exit {done.returncode}): {done.stderr.strip()[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout[done.stdout.index("{") :])
    return result


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
    parser.add_argument("--with-nixl", action="store_true", help="also run kvwire bench --backend nixl, alternating")
    parser.add_argument("--rounds", type=int, default=5, help="--with-nixl: memcpy/nixl rounds (default 5)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE", help="for kvwire bench")
    parser.add_argument(
        "--with-cma", action="store_true", help="also time process_vm_writev of the same descriptors (Linux)"
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
    before = 0
    for _ in range(args.requests):
        lengths = run_lengths(rng, pages, args.mean_run)
        s = place(rng, lengths, pool_pages).astype(np.int32)
        d = place(rng, lengths, pool_pages).astype(np.int32)
        plans.append(kvwire.plan_transfer(src.layout, dst.layout, s, ptrs, d))
        last = (s, d)
        before += plans[-1].descriptors_before
    nbytes = sum(p.nbytes for p in plans)
    block_src, block_dst = np.ones(plans[0].nbytes, np.uint8), np.zeros(plans[0].nbytes, np.uint8)
    np.copyto(block_dst, block_src)  # fault every page in before timing

    fragmented, contiguous, parallel, nixl, ratios, cma_passes = [], [], [], [], [], []
    pool = ThreadPoolExecutor(max(1, args.threads))
    cma = _Cma(args, dst, pool_pages) if args.with_cma else None
    if cma is not None:
        atexit.register(cma.close)  # also on an error's SystemExit; closing twice is harmless
    cma_iovecs = [cma.iovecs(plan) for plan in plans] if cma is not None else []
    rounds = args.rounds if args.with_nixl else 1
    bench: dict[str, Any] = {}
    for _ in range(rounds):
        passes = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            for plan in plans:
                _copy(plan, src, dst)
            fragmented.append(nbytes / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            for plan in plans:
                list(pool.map(lambda rows, plan=plan: _copy(plan, src, dst, rows), _slices(plan, max(1, args.threads))))
            passes.append(nbytes / (time.perf_counter() - start) / 1e9)
            start = time.perf_counter()
            for _ in plans:
                np.copyto(block_dst, block_src)
            contiguous.append(block_src.nbytes * len(plans) / (time.perf_counter() - start) / 1e9)
            if cma is not None:
                start = time.perf_counter()
                for plan, (local, remote) in zip(plans, cma_iovecs, strict=True):
                    parts = _slices(plan, max(1, args.threads))
                    list(pool.map(lambda rows, local=local, remote=remote: cma.write(local, remote, rows), parts))
                cma_passes.append(nbytes / (time.perf_counter() - start) / 1e9)
        parallel += passes
        if args.with_nixl:
            bench = _nixl_bench(args)
            if (bench["descriptors_before"], bench["descriptors_after"]) != (
                before // len(plans),
                sum(len(p) for p in plans) // len(plans),
            ):
                raise SystemExit(f"kvwire bench planned other descriptors: {bench}")
            if not (bench["verified"] and bench["guards_unchanged"]):
                raise SystemExit(f"kvwire bench did not verify: {bench}")
            nixl.append(float(bench["gbps"]))
            ratios.append(nixl[-1] / statistics.median(passes))
            if not args.json:
                print(
                    f"  round {len(nixl)}: memcpy 2 threads {statistics.median(passes):.3f} GB/s, "
                    f"kvwire-nixl {nixl[-1]:.3f} GB/s (p50 {bench['p50_ms']} ms), ratio {ratios[-1]:.3f}",
                    file=sys.stderr,
                )
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
    if cma is not None:
        result["cma_threads_gbps"] = round(statistics.median(cma_passes), 3)
        # The last request's pages (an earlier request's may be rewritten by a later one): the child's digest of
        # its target pages against this process's of the source pages, page for page.
        result["cma_verified"] = cma.digest(last[1]) == src.digest(last[0].astype(np.int64))
        if not result["cma_verified"]:
            raise SystemExit("process_vm_writev left other bytes in the child than the plans' sources")
    if args.with_nixl:
        result.update(
            rounds=rounds,
            options=args.option,
            nixl_gbps=round(statistics.median(nixl), 3),
            nixl_gbps_rounds=[round(x, 3) for x in nixl],
            memcpy_threads_gbps_rounds=[round(x, 3) for x in parallel],
            ratio=round(statistics.median(nixl) / statistics.median(parallel), 3),
            ratio_per_round=round(statistics.median(ratios), 3),
        )
    pool.shutdown()
    if cma is not None:
        cma.close()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"one-process numpy copy, {preset.name} ({src.backing} pools), {args.requests} x {args.tokens} tokens "
            f"({result['bytes_per_request'] / 2**20:.0f} MiB, {result['descriptors_per_request']} descriptors each)"
        )
        print(f"  same descriptors   {result['memcpy_descriptors_gbps']:7.3f} GB/s")
        print(f"  one block          {result['memcpy_contiguous_gbps']:7.3f} GB/s")
        print(f"  same, {args.threads} threads   {result['memcpy_descriptors_threads_gbps']:7.3f} GB/s")
        if cma is not None:
            cma_gbps = result["cma_threads_gbps"]
            print(f"  cma, {args.threads} threads    {cma_gbps:7.3f} GB/s   (process_vm_writev into a child, verified)")
        if args.with_nixl:
            options = f", options {' '.join(args.option)}" if args.option else ""
            print(f"  kvwire-nixl        {result['nixl_gbps']:7.3f} GB/s   (kvwire bench --backend nixl{options})")
            print(
                f"  kvwire-nixl / {args.threads} threads = {result['ratio']:.3f} "
                f"(medians, {rounds} alternating rounds; per-round median {result['ratio_per_round']:.3f})"
            )
            if cma is not None:
                print(f"  kvwire-nixl / cma = {result['nixl_gbps'] / result['cma_threads_gbps']:.3f} (medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
