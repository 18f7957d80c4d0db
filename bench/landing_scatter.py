"""Benchmark: the decode rank's landing scatter against a contiguous copy of the same bytes.

``kvwire bench --landing`` (prefill TP > decode TP, token-major pages) moves
every byte twice: the transport writes whole pages into landing pages, then
:meth:`kvwire.Landing.scatter` copies each sender's heads into place, in
slices of one token's heads (1 KiB for llama3-8b at TP 2 -> 1). This bench
times that scatter alone, one request's pages from every sender, with 1 and 2
threads, next to ``numpy.copyto`` of the same number of bytes from the same
landing pages into one contiguous block (1 and 2 threads): the scatter's cost
over the cheapest copy there is. Rounds alternate; medians; every scatter is
checked against the bench's per-head digest of the senders' pages.

    python bench/landing_scatter.py [--preset llama3-8b] [--prefill-tp 2] [--tokens 2048] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from kvwire.benchmark.presets import get_preset
from kvwire.benchmark.tp import expected_digest
from kvwire.landing import Landing
from kvwire.layout.hugepages import host_bytes
from kvwire.workload.fragment import place, run_lengths
from kvwire.workload.memory import allocate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--preset", default="llama3-8b")
    parser.add_argument("--prefill-tp", type=int, default=2, help="senders per decode rank (decode TP is 1)")
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the request (default 2048)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", action="store_true", help="print a JSON object instead of the table")
    args = parser.parse_args(argv)
    preset = get_preset(args.preset)
    p_tp = args.prefill_tp
    n = -(-args.tokens // preset.page_tokens)
    pool_pages = 2 * n + 64
    rng = np.random.default_rng(0)
    lengths = run_lengths(rng, n, 4, "geometric")
    src, dst = place(rng, lengths, pool_pages), place(rng, lengths, pool_pages)
    entries = preset.entries(decode_side=False)
    senders = []
    for p in range(p_tp):
        pool = allocate(entries, pool_pages, preset.heads(p_tp).page_bytes)
        pool.layout = preset.rank_layout(pool.layout, p_tp, p)
        pool.fill_random(10 + p)
        senders.append(pool)
    final = allocate(preset.entries(decode_side=True), pool_pages, preset.heads(1).page_bytes)
    final.layout = preset.rank_layout(final.layout, 1, 0)
    final.fill_random(1)
    expected = expected_digest(preset, senders, 1, 0, src)
    landings = {t: Landing(final.layout, p_tp, n * p_tp, threads=t) for t in (1, 2)}
    views = {
        t: [host_bytes(b.base, b.num_pages, b.page_bytes) for b in lt.layout.buffers] for t, lt in landings.items()
    }
    pages: dict[int, dict[int, Any]] = {}
    for t, landing in landings.items():
        reserved = landing.reserve(n)
        assert reserved is not None
        pages[t] = reserved
        for p, landed in reserved.items():  # what each sender's whole-page write puts there
            for i, view in enumerate(views[t]):
                view[landed] = senders[p].views[i][src]
    moved = sum(int(v.nbytes) for v in views[1])
    block = np.empty(moved, np.uint8)
    pool = ThreadPoolExecutor(2)

    def contiguous(threads: int) -> Callable[[], None]:
        sources = [v.reshape(-1) for v in views[1]]
        offsets = np.cumsum([0] + [s.size for s in sources])
        parts = [list(range(k, len(sources), threads)) for k in range(threads)]

        def copy(part: list[int]) -> None:
            for i in part:
                np.copyto(block[offsets[i] : offsets[i + 1]], sources[i])

        return lambda: list(pool.map(copy, parts)) and None

    def scatter(threads: int) -> Callable[[], None]:
        landing = landings[threads]

        def run() -> None:
            for p, landed in pages[threads].items():
                landing.scatter(p, landed, dst)

        return run

    runs = {
        "contiguous copy, 1 thread": contiguous(1),
        "contiguous copy, 2 threads": contiguous(2),
        "scatter, 1 thread": scatter(1),
        "scatter, 2 threads": scatter(2),
    }
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    verified = True
    for r in range(args.rounds + 1):  # round 0 warms up (page faults), untimed
        for name, fn in runs.items():
            if name.startswith("scatter"):
                final.fill_pages(dst, r % 256)
            t0 = time.perf_counter()
            fn()
            if r:
                seconds[name].append(time.perf_counter() - t0)
            if name.startswith("scatter"):
                verified = verified and final.digest(dst) == expected
    median = {name: statistics.median(s) for name, s in seconds.items()}
    rows = []
    for name, s in median.items():
        threads = "2 threads" if name.endswith("2 threads") else "1 thread"
        base = median[f"contiguous copy, {threads}"]
        rows.append(
            {
                "what": name,
                "GB/s": round(moved / s / 1e9, 2),
                "ms": round(s * 1e3, 2),
                "vs contiguous": round(base / s, 3),
            }
        )
    result = {
        "preset": args.preset,
        "prefill_tp": p_tp,
        "tokens": args.tokens,
        "bytes": moved,
        "slice_bytes": preset.heads(p_tp).row_bytes,
        "verified": verified,
        "rows": rows,
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.preset}, prefill TP {p_tp} -> decode TP 1, {args.tokens} tokens: {moved / 2**20:.0f} MiB in "
            f"{preset.heads(p_tp).row_bytes}-byte slices, {args.rounds} rounds, scatter "
            f"{'verified' if verified else 'MISMATCH'}"
        )
        width = max(len(r["what"]) for r in rows)
        print(f"{'what':<{width}}  {'GB/s':>7}  {'ms':>8}  vs contiguous (same threads)")
        for row in rows:
            print(f"{row['what']:<{width}}  {row['GB/s']:>7}  {row['ms']:>8}  {row['vs contiguous']}")
    for landing in landings.values():
        landing.close()
    pool.shutdown()
    return 0 if verified else 1


if __name__ == "__main__":
    raise SystemExit(main())
