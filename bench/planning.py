"""Benchmark: kvwire's transfer planning against sglang's per-layer loops, and against kvwire before.

Three tables, medians of repeated runs in one process (ratios are meaningful
even on a noisy machine; absolute times are this machine's):

1. Same TP. Layout like Llama-3-8B: 32 layers x (K, V) = 64 buffers of 32 KiB
   pages on both sides (synthetic base addresses: only addresses are computed).
   Requests of 256, 2048 and 8192 pages, fragmented on both sides into runs of
   random length (geometric, mean 1, 8 or 64) placed from a shuffled free list.
   Baseline: sglang's Mooncake connector per request (``group_concurrent_contiguous``
   then Python lists of addresses per buffer). Same descriptor set, checked.
2. kvwire's own cost per request: 2,048 pages x 64 buffers in runs of mean 4,
   and a one-page request, planned by this kvwire and by the kvwire of
   ``--before`` (a git revision, extracted and imported side by side), in
   fresh processes with glibc's defaults and with freed memory kept resident
   (the old planner's page faults depend on the allocator's state).
3. Heterogeneous attention TP: a 4,096-token Llama-3-8B request (32 layers,
   K and V, 8 KV heads of 128 fp16, 16 tokens a page, 256 pages) from prefill
   rank p of P to decode rank d of D. Baseline: sglang's ``send_kvcache_slice``
   transliterated (per layer: numpy addresses, then ``tolist`` for the engine);
   "no tolist" is the same loop stopping at the numpy arrays. Same descriptor
   set, checked.

    python bench/planning.py [--json] [--before REV]
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from numpy.typing import NDArray

try:
    import kvwire  # noqa: F401
except ImportError:  # a source checkout without kvwire installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core" / "src"))

from kvwire.layout.buffers import HeadLayout, KVBuffer, Role
from kvwire.layout.kv_layout import KVLayout
from kvwire.planning.head_slicing import senders
from kvwire.planning.planner import plan_transfer
from kvwire.workload.fragment import place, run_lengths

ROOT = Path(__file__).resolve().parents[1]
LAYERS = 32
PAGE_BYTES = 32 * 1024
PAGES_PER_BUFFER = 65536
PAGES = (256, 2048, 8192)
MEAN_RUNS = (1, 8, 64)
#: the last kvwire before this benchmark's per-request work (pooled output, one-page path, TP slicing)
BEFORE = "1fedbcc0d96706723e5b596f03be3aa02ed074e6"
KV_HEADS, HEAD_DIM, ELEM, TOKENS, TP_PAGES = 8, 128, 2, 16, 256
TP_CASES: tuple[tuple[int, int, int, int], ...] = (
    (1, 0, 2, 0),
    (1, 0, 2, 1),
    (2, 1, 1, 0),
    (1, 0, 4, 3),
    (8, 4, 2, 1),
    (2, 0, 8, 1),
)


def make_layout(first_base: int, kinds: Any = None, pages: int = PAGES_PER_BUFFER) -> Any:
    """sglang's order: K of every layer, then V of every layer; buffers back to back (``kinds``: a module)."""
    buf, lay = (KVBuffer, KVLayout) if kinds is None else (kinds.KVBuffer, kinds.KVLayout)
    stride = PAGE_BYTES * pages
    specs: list[tuple[int, Role]] = [(layer, role) for role in ("k", "v") for layer in range(LAYERS)]
    return lay(
        tuple(buf(first_base + i * stride, PAGE_BYTES, pages, layer, role) for i, (layer, role) in enumerate(specs))
    )


def make_request(rng: np.random.Generator, pages: int, mean_run: int) -> tuple[NDArray[np.int32], NDArray[np.int32]]:
    lengths = run_lengths(rng, pages, mean_run)
    return place(rng, lengths, PAGES_PER_BUFFER).astype(np.int32), place(rng, lengths, PAGES_PER_BUFFER).astype(
        np.int32
    )


# -- baselines: sglang's mooncake connector ----------------------------------------


def group_concurrent_contiguous(src: NDArray[Any], dst: NDArray[Any]) -> tuple[list[list[int]], list[list[int]]]:
    """sglang's grouping of page ids into runs consecutive on both sides."""
    if src.size == 0:
        return [], []
    brk = np.where((np.diff(src) != 1) | (np.diff(dst) != 1))[0] + 1
    return [g.tolist() for g in np.split(src, brk)], [g.tolist() for g in np.split(dst, brk)]


def baseline_plan(
    src_ptrs: list[int], dst_ptrs: list[int], item_lens: list[int], src_idx: NDArray[Any], dst_idx: NDArray[Any]
) -> list[tuple[list[int], list[int], list[int]]]:
    """Per buffer: Python lists of (src address, dst address, length), as sglang's ``send_kvcache`` builds them."""
    prefill_blocks, dst_blocks = group_concurrent_contiguous(src_idx, dst_idx)
    out = []
    for src_ptr, dst_ptr, item_len in zip(src_ptrs, dst_ptrs, item_lens, strict=True):
        src_list = [src_ptr + int(p[0]) * item_len for p in prefill_blocks]
        dst_list = [dst_ptr + int(d[0]) * item_len for d in dst_blocks]
        out.append((src_list, dst_list, [item_len * len(p) for p in prefill_blocks]))
    return out


def sglang_slice_plan(
    src_ptrs: list[int],
    dst_ptrs: list[int],
    src_idx: NDArray[Any],
    dst_idx: NDArray[Any],
    tp: tuple[int, ...],
    *,
    tolist: bool = True,
) -> list[tuple[Any, Any, Any]]:
    """sglang 0.5.18 ``send_kvcache_slice``'s address arithmetic, per layer (K buffers, then V), for the engine."""
    p_tp, p_rank, d_tp, d_rank = tp
    src_item_len = KV_HEADS // p_tp * HEAD_DIM * ELEM * TOKENS
    dst_item_len = KV_HEADS // d_tp * HEAD_DIM * ELEM * TOKENS
    src_heads, dst_heads = max(1, KV_HEADS // p_tp), max(1, KV_HEADS // d_tp)
    head_bytes = dst_item_len // TOKENS // dst_heads
    if p_tp > d_tp:
        src_off, heads = 0, src_heads
        dst_off = (p_rank // max(1, p_tp // KV_HEADS) * src_heads) % dst_heads
    else:
        src_off, heads = (d_rank // max(1, d_tp // KV_HEADS) * dst_heads) % src_heads, dst_heads
        dst_off = 0
    prefill_pages = src_idx.reshape(-1, 1).astype(np.int64)
    decode_pages = dst_idx.reshape(-1, 1).astype(np.int64)
    tokens = np.arange(TOKENS, dtype=np.int64).reshape(1, -1)
    src_tok = tokens * (src_item_len // TOKENS) + src_off * head_bytes
    dst_tok = tokens * (dst_item_len // TOKENS) + dst_off * head_bytes
    out: list[tuple[Any, Any, Any]] = []
    for src_ptr, dst_ptr in zip(src_ptrs, dst_ptrs, strict=True):  # one executor task per layer and role
        src_addrs = (src_ptr + prefill_pages * src_item_len + src_tok).reshape(-1)
        dst_addrs = (dst_ptr + decode_pages * dst_item_len + dst_tok).reshape(-1)
        if tolist:
            src_list = src_addrs.tolist()
            out.append((src_list, dst_addrs.tolist(), [heads * head_bytes] * len(src_list)))
        else:
            out.append((src_addrs, dst_addrs, np.full(src_addrs.shape, heads * head_bytes)))
    return out


# -- measurement -----------------------------------------------------------------


def median_us(fn: Callable[[], object], budget_s: float = 1.0, min_reps: int = 7, max_reps: int = 2000) -> float:
    return paired_us([fn], budget_s, min_reps, max_reps)[0]


def paired_us(
    fns: list[Callable[[], object]], budget_s: float = 1.0, min_reps: int = 7, max_reps: int = 2000
) -> list[float]:
    """Median wall time (us) of each of ``fns``, called in turn, rep after rep (so noise hits all alike)."""
    for _ in range(3):  # warm-up (fills kvwire's pairing cache and output pool)
        for fn in fns:
            fn()
    t0 = time.perf_counter_ns()
    for fn in fns:
        fn()
    once = max(time.perf_counter_ns() - t0, 1)
    samples: list[list[int]] = [[] for _ in fns]
    for _ in range(int(min(max_reps, max(min_reps, budget_s * 1e9 / once)))):
        for fn, out in zip(fns, samples, strict=True):
            t0 = time.perf_counter_ns()
            fn()
            out.append(time.perf_counter_ns() - t0)
    return [float(np.median(out)) / 1000.0 for out in samples]


def descriptor_set(src: Any, dst: Any, length: Any) -> NDArray[np.int64]:
    table = np.stack([np.asarray(src), np.asarray(dst), np.asarray(length)], axis=1).astype(np.int64)
    return table[np.lexsort((table[:, 2], table[:, 1], table[:, 0]))]


def flatten(per_buffer: list[tuple[Any, Any, Any]]) -> list[NDArray[np.int64]]:
    return [np.concatenate([np.asarray(per[i], dtype=np.int64) for per in per_buffer]) for i in range(3)]


def bench_same_tp(rng: np.random.Generator) -> list[dict[str, Any]]:
    local, peer = make_layout(1 << 40), make_layout(1 << 44)
    src_ptrs, dst_ptrs = [b.base for b in local.buffers], [b.base for b in peer.buffers]
    item_lens = [b.page_bytes for b in local.buffers]
    rows = []
    for pages in PAGES:
        for mean_run in MEAN_RUNS:
            s, d = make_request(rng, pages, mean_run)
            plan = plan_transfer(local, peer, s, dst_ptrs, d)
            if not np.array_equal(
                descriptor_set(plan.src, plan.dst, plan.length),
                descriptor_set(*flatten(baseline_plan(src_ptrs, dst_ptrs, item_lens, s, d))),
            ):
                raise SystemExit(f"MISMATCH at pages={pages} mean_run={mean_run}: kvwire and baseline differ")
            kv = median_us(functools.partial(plan_transfer, local, peer, s, dst_ptrs, d))
            base = median_us(functools.partial(baseline_plan, src_ptrs, dst_ptrs, item_lens, s, d))
            rows.append(
                {
                    "pages": pages,
                    "mean_run": mean_run,
                    "buffers": len(local.buffers),
                    "kvwire_us": round(kv, 1),
                    "baseline_us": round(base, 1),
                    "speedup": round(base / kv, 1),
                    "descriptors_before": plan.descriptors_before,
                    "descriptors_after": len(plan),
                }
            )
    return rows


def load_before(rev: str) -> ModuleType | None:
    """``kvwire.planning`` of git revision ``rev``, imported as ``kvwire_before`` (None: no git or no such rev)."""
    try:
        tar = subprocess.run(
            ["git", "-C", str(ROOT), "archive", rev, "core/src/kvwire"], capture_output=True, check=True
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    tmp = Path(tempfile.mkdtemp(prefix="kvwire-before-"))
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as archive:
        if hasattr(tarfile, "data_filter"):
            archive.extractall(tmp, filter="data")
        else:  # Python without extraction filters: our own repository's archive
            archive.extractall(tmp)
    package = tmp / "kvwire_before"
    (tmp / "core" / "src" / "kvwire").rename(package)
    for path in package.rglob("*.py"):
        path.write_text(re.sub(r"\bkvwire\.", "kvwire_before.", path.read_text()))
    (package / "__init__.py").write_text("")  # import only what planning needs
    sys.path.insert(0, str(tmp))
    return importlib.import_module("kvwire_before.planning")


def _planner(plan: Callable[..., Any], local: Any, peer: Any, src: Any, dst: Any) -> Callable[[], Any]:
    ptrs = [b.base for b in peer.buffers]
    return lambda: plan(local, peer, src, ptrs, dst)


#: glibc settings that keep freed memory resident (what a long-running process that once freed big arrays gets)
RESIDENT_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 31)}


def own_cost_alone(rng: np.random.Generator, before: ModuleType | None) -> list[dict[str, Any]]:
    """Median us of each planner on its own, on the same requests (``before`` None: this kvwire only)."""
    s, d = make_request(rng, 2048, 4)
    rows = []
    for name, (src, dst) in (("2048 pages, mean run 4", (s, d)), ("1 page", (s[:1], d[:1]))):
        now = _planner(plan_transfer, make_layout(1 << 40), make_layout(1 << 44), src, dst)
        row: dict[str, Any] = {"request": name, "descriptors": len(now())}
        if before is not None:
            kinds = importlib.import_module("kvwire_before.layout")
            old = _planner(before.plan_transfer, make_layout(1 << 40, kinds), make_layout(1 << 44, kinds), src, dst)
            row["before_us"] = median_us(old, 2.0, max_reps=20000)
        row["now_us"] = median_us(now, 2.0, max_reps=20000)
        rows.append(row)
    return rows


def bench_own_cost(rng: np.random.Generator, before_rev: str) -> list[dict[str, Any]]:
    """kvwire's per-request cost against the kvwire of ``before_rev``, each in a fresh process, twice.

    "fresh": glibc's defaults, where freeing a plan's large arrays gives their
    pages back, so the old planner page-faults new ones on every request;
    "resident": glibc keeps freed memory (as in a process that has freed big
    arrays before), so no planner page-faults and the rest of the work shows.
    """
    del rng  # each child draws the same requests from the seed
    results = {}
    for label, env in (("fresh", {}), ("resident", RESIDENT_ENV)):
        child = subprocess.run(
            [sys.executable, __file__, "--tables", "own_cost_alone", "--json", "--before", before_rev],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, **env},
        )
        results[label] = json.loads(child.stdout)["own_cost_alone"]
    rows = []
    for fresh, resident, target in zip(results["fresh"], results["resident"], (150.0, 10.0), strict=True):
        row: dict[str, Any] = {"request": fresh["request"], "buffers": 2 * LAYERS, "descriptors": fresh["descriptors"]}
        for label, r in (("fresh", fresh), ("resident", resident)):
            row[f"before_{label}_us"] = round(r["before_us"], 1) if "before_us" in r else "n/a"
            row[f"now_{label}_us"] = round(r["now_us"], 1)
            row[f"speedup_{label}"] = round(r["before_us"] / r["now_us"], 1) if "before_us" in r else "n/a"
        row["target_us"] = target
        rows.append(row)
    return rows


def tp_layout(first_base: int, tp: int, rank: int) -> KVLayout:
    heads = HeadLayout(max(1, KV_HEADS // tp), KV_HEADS, HEAD_DIM, ELEM, TOKENS)
    stride = heads.page_bytes * 4096
    specs = [(layer, role) for role in ("k", "v") for layer in range(LAYERS)]
    bufs = tuple(
        KVBuffer(first_base + i * stride, heads.page_bytes, 4096, layer, role)  # type: ignore[arg-type]
        for i, (layer, role) in enumerate(specs)
    )
    return KVLayout(bufs, tp, rank, heads)


def _tp_row(tp: tuple[int, int, int, int], src: NDArray[np.int32], dst: NDArray[np.int32]) -> dict[str, Any]:
    p_tp, p, d_tp, d = tp
    assert p in senders(p_tp, d_tp, d)
    local, peer = tp_layout(1 << 40, p_tp, p), tp_layout(1 << 44, d_tp, d)
    src_ptrs, dst_ptrs = [b.base for b in local.buffers], [b.base for b in peer.buffers]
    plan = plan_transfer(local, peer, src, dst_ptrs, dst)
    ref = sglang_slice_plan(src_ptrs, dst_ptrs, src, dst, tp)
    if not np.array_equal(descriptor_set(plan.src, plan.dst, plan.length), descriptor_set(*flatten(ref))):
        raise SystemExit(f"MISMATCH at P={p_tp} p={p} D={d_tp} d={d}: kvwire and sglang's slicing differ")
    kv, base, arrays = paired_us(
        [
            lambda: plan_transfer(local, peer, src, dst_ptrs, dst),
            lambda: sglang_slice_plan(src_ptrs, dst_ptrs, src, dst, tp),
            lambda: sglang_slice_plan(src_ptrs, dst_ptrs, src, dst, tp, tolist=False),
        ],
        budget_s=3.0,
        max_reps=200,
    )
    return {
        "prefill": f"{p}/{p_tp}",
        "decode": f"{d}/{d_tp}",
        "descriptors": len(plan),
        "bytes_each": int(plan.length[0]),
        "kvwire_us": round(kv, 1),
        "sglang_us": round(base, 1),
        "speedup": round(base / kv, 1),
        "sglang_no_tolist_us": round(arrays, 1),
        "speedup_no_tolist": round(arrays / kv, 1),
    }


def bench_tp(rng: np.random.Generator) -> list[dict[str, Any]]:
    src = np.sort(rng.choice(4096, TP_PAGES, replace=False)).astype(np.int32)
    dst = rng.permutation(4096)[:TP_PAGES].astype(np.int32)
    return [_tp_row(tp, src, dst) for tp in TP_CASES]


def print_table(rows: list[dict[str, Any]]) -> None:
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print("  ".join(c.rjust(w) for c, w in zip(columns, widths, strict=True)))
    for r in rows:
        print("  ".join(str(r[c]).rjust(w) for c, w in zip(columns, widths, strict=True)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print a JSON object of the three tables instead")
    parser.add_argument("--seed", type=int, default=0, help="random seed of the requests (default 0)")
    parser.add_argument("--before", default=BEFORE, help="git revision of the kvwire to compare own cost with")
    parser.add_argument(
        "--tables", default="same_tp,own_cost,tp", type=lambda s: s.split(","), help="which tables (default: all)"
    )
    args = parser.parse_args(argv)
    runs: dict[str, Callable[[np.random.Generator], list[dict[str, Any]]]] = {
        "same_tp": bench_same_tp,
        "own_cost": lambda rng: bench_own_cost(rng, args.before),
        "own_cost_alone": lambda rng: own_cost_alone(rng, load_before(args.before)),
        "tp": bench_tp,
    }
    tables = {name: run(np.random.default_rng(args.seed)) for name, run in runs.items() if name in args.tables}
    if args.json:
        print(json.dumps(tables))
        return 0
    titles = {
        "same_tp": f"1. transfer planning, same TP: {LAYERS} layers x (K, V) = {2 * LAYERS} buffers, "
        f"{PAGE_BYTES // 1024} KiB pages; median wall time per request (both sides fragmented) against sglang's "
        "per-buffer loop",
        "own_cost": f"2. kvwire's own cost per request, this kvwire against {args.before[:12]} (median us, each in "
        "a fresh process; fresh: glibc defaults, resident: freed memory kept; targets: <= 150 us and <= 10 us)",
        "own_cost_alone": "kvwire's own cost per request (this process)",
        "tp": f"3. heterogeneous attention TP: Llama-3-8B, {TP_PAGES * TOKENS} tokens ({TP_PAGES} pages of {TOKENS}), "
        f"{KV_HEADS} KV heads x {HEAD_DIM} x fp16, rank/size; against sglang's send_kvcache_slice per layer "
        "(targets: P=1 -> D=2 under 5 ms and >= 10x)",
    }
    for name, rows in tables.items():
        print(("\n" if name != next(iter(tables)) else "") + titles[name])
        print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
