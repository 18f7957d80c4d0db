"""``kvwire bench``: orchestrate a decode process, send requests from this (prefill) process.

Each request takes random fragmented pages (mean run ``--mean-run``) on both
sides, is sent through the chosen backend, timed, and verified on the decode
side by a digest of every page. ``--compare-raw`` sends the identical
descriptors through the backend's raw engine call in the same run;
``--compare-uncoalesced`` sends one descriptor per page instead.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.benchmark.fragment import place, run_lengths
from kvwire.benchmark.pools import Pool
from kvwire.benchmark.presets import PRESETS, get_preset
from kvwire.benchmark.wire import digest, is_split, parse_peer_description
from kvwire.config import BackendConfig
from kvwire.connection import Connection
from kvwire.control import ChildProcess
from kvwire.errors import ConfigError
from kvwire.layout import KVLayout
from kvwire.planning import plan_transfer
from kvwire.registry import connect

__all__ = ["add_arguments", "run"]

RawWrite = Callable[[str, NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]], None]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="mooncake", help="backend name (default: mooncake)")
    parser.add_argument("--preset", default="llama3-8b", help=f"layout preset: {', '.join(PRESETS)}")
    parser.add_argument("--requests", type=int, default=16, help="number of requests (default 16)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per request (default 4096)")
    parser.add_argument("--mean-run", type=int, default=8, help="mean run of consecutive pages (default 8)")
    parser.add_argument(
        "--run-shape",
        choices=("geometric", "fixed"),
        default="geometric",
        help="run lengths: geometric with mean --mean-run (default), or all exactly --mean-run",
    )
    parser.add_argument("--device", default="cpu", help="where decode-side device buffers live (cpu, cuda)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=10.0, help="transfer timeout in seconds")
    parser.add_argument(
        "--inflight",
        type=int,
        default=1024,
        help="descriptors in flight per peer (BackendConfig.max_inflight_per_peer)",
    )
    parser.add_argument("--compare-raw", action="store_true", help="also time the raw engine call, same descriptors")
    parser.add_argument("--compare-uncoalesced", action="store_true", help="also time one descriptor per page")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def _engine(conn: Connection) -> object:
    return getattr(getattr(conn.backend, "transport", None), "engine", None)


def _raw_writer(conn: Connection) -> RawWrite | None:
    """The backend engine's bare call (kvwire-mooncake's ``MooncakeEngine.raw_write``), if it has one."""
    raw = getattr(_engine(conn), "raw_write", None)
    return raw if callable(raw) else None


def _engine_writer(conn: Connection) -> RawWrite | None:
    """The backend engine's checked write, to send a plan kvwire did not coalesce."""
    write = getattr(_engine(conn), "write", None)
    return write if callable(write) else None


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0

    def step(self, label: str) -> None:
        self.done += 1
        if self.enabled:
            filled = int(30 * self.done / self.total)
            sys.stderr.write(f"\r  [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label}   ")
            sys.stderr.flush()
            if self.done == self.total:
                sys.stderr.write("\n")


def _percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q)) if values else 0.0


def _check_arguments(args: argparse.Namespace) -> None:
    for name in ("requests", "tokens", "mean_run"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.timeout <= 0:
        raise ConfigError(f"--timeout must be > 0, got {args.timeout}")
    get_preset(args.preset)


def run(args: argparse.Namespace) -> int:
    _check_arguments(args)
    preset = get_preset(args.preset)
    pages_per_request = -(-args.tokens // preset.page_tokens)
    pool_pages = 4 * pages_per_request + 64  # room for the runs and the 1-3 free pages after each
    config = BackendConfig(
        timeout_s=args.timeout,
        max_inflight_per_peer=args.inflight,
        max_descriptors_per_call=min(1024, args.inflight),
    )
    decode_args = {
        "backend": args.backend,
        "preset": preset.name,
        "pages": pool_pages,
        "seed": args.seed + 1,
        "device": args.device,
        "config": config.to_dict(),
    }
    decode = ChildProcess("kvwire.benchmark.decode", [json.dumps(decode_args)], what="decode process")
    try:
        endpoint, peer_layout = parse_peer_description(decode.read())
        pool = Pool(preset, pool_pages, decode_side=False)
        pool.fill_random(args.seed)
        with connect(args.backend, config) as conn:
            conn.register_kv_buffers(pool.layout)
            conn.add_peer(endpoint, peer_layout)
            result = _measure(args, conn, pool, endpoint, peer_layout, pages_per_request, decode)
    finally:
        decode.close()
    result.update(backend=args.backend, preset=preset.name, backing=pool.backing)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    return 0 if result["verified"] else 1


def _measure(
    args: argparse.Namespace,
    conn: Connection,
    pool: Pool,
    endpoint: str,
    peer_layout: KVLayout,
    pages_per_request: int,
    decode: ChildProcess,
) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed + 7)
    ptrs = [b.base for b in peer_layout.buffers]
    split = is_split(peer_layout)
    raw = _raw_writer(conn) if args.compare_raw else None
    if args.compare_raw and raw is None:
        raise ConfigError(f"--compare-raw: backend {args.backend!r} exposes no raw engine call")
    engine_write = _engine_writer(conn) if args.compare_uncoalesced else None
    if args.compare_uncoalesced and engine_write is None:
        raise ConfigError(f"--compare-uncoalesced: backend {args.backend!r} exposes no engine write")
    latencies: list[float] = []
    seconds_by_mode = {"raw": 0.0, "uncoalesced": 0.0}
    paired: dict[str, list[float]] = {"raw": [], "uncoalesced": []}  # per request: other mode's time / kvwire's
    total = 0
    verified = True
    before = after = 0
    progress = _Progress(args.requests, not args.json)
    one = np.array([0], np.int32)
    conn.send_kvcache(endpoint, one, ptrs, one, None, None, one if split else None)  # warm-up: handshake
    for i in range(args.requests):
        # The same run lengths on both sides, so a request's mean run really is --mean-run after coalescing.
        lengths = run_lengths(rng, pages_per_request, args.mean_run, args.run_shape)
        peer_pages = peer_layout.buffers[0].num_pages
        src = place(rng, lengths, pool.num_pages).astype(np.int32)
        dst = place(rng, lengths, peer_pages).astype(np.int32)
        dev = place(rng, lengths, peer_pages).astype(np.int32) if split else None
        plan = plan_transfer(pool.layout, peer_layout, src, ptrs, dst, None, dev)
        before += plan.descriptors_before
        after += len(plan)
        pages = {"host_pages": dst.tolist(), "device_pages": None if dev is None else dev.tolist()}
        modes: list[tuple[str, Callable[[], object]]] = [
            ("kvwire", partial(conn.send_kvcache, endpoint, src, ptrs, dst, None, None, dev)),
        ]
        if raw is not None:
            modes.append(("raw", partial(raw, endpoint, plan.src, plan.dst, plan.length)))
        if engine_write is not None:
            flat = plan_transfer(pool.layout, peer_layout, src, ptrs, dst, None, dev, coalesce=False)
            modes.append(("uncoalesced", partial(engine_write, endpoint, flat.src, flat.dst, flat.length)))
        # Identical bytes to identical places in every mode; the order rotates per request so that
        # drift in the machine's load falls on every mode alike.
        ok = False
        timings: dict[str, float] = {}
        for name, call in modes[i % len(modes) :] + modes[: i % len(modes)]:
            if name == "kvwire":  # fresh random bytes in the target pages: only kvwire's own write can pass
                decode.request({"cmd": "scramble", **pages})
            start = time.perf_counter()
            outcome = call()
            elapsed = time.perf_counter() - start
            if name == "kvwire":
                assert isinstance(outcome, int)
                latencies.append(elapsed)
                total += outcome
                expected = digest(pool.views, src.astype(np.int64))
                ok = bool(decode.request({"cmd": "verify", "digest": expected, **pages})["ok"])
            else:
                seconds_by_mode[name] += elapsed
            timings[name] = elapsed
        for name in paired.keys() & timings.keys():
            paired[name].append(timings[name] / timings["kvwire"])
        verified = verified and ok
        progress.step("verified" if ok else "MISMATCH")
    seconds = sum(latencies)
    result: dict[str, Any] = {
        "requests": args.requests,
        "tokens": args.tokens,
        "bytes": total,
        "verified": verified,
        "gbps": round(total / seconds / 1e9, 3) if seconds else 0.0,
        "p50_ms": round(_percentile(latencies, 50) * 1e3, 2),
        "p99_ms": round(_percentile(latencies, 99) * 1e3, 2),
        "descriptors_before": before // args.requests,
        "descriptors_after": after // args.requests,
    }
    if raw is not None:
        result["raw_gbps"] = round(total / seconds_by_mode["raw"] / 1e9, 3)
        # Paired per request (the same bytes, back to back), then the median: robust to a noisy machine.
        result["ratio"] = round(statistics.median(paired["raw"]), 3)
    if engine_write is not None:
        result["uncoalesced_gbps"] = round(total / seconds_by_mode["uncoalesced"] / 1e9, 3)
        result["coalescing_speedup"] = round(statistics.median(paired["uncoalesced"]), 2)
    return result


def _print_table(r: dict[str, Any]) -> None:
    rows = [
        ("backend", f"{r['backend']} ({r['preset']}, pools: {r['backing']})"),
        ("requests", f"{r['requests']} x {r['tokens']} tokens"),
        ("bytes", f"{r['bytes'] / 2**30:.2f} GiB"),
        ("verified", "every byte" if r["verified"] else "MISMATCH"),
        ("throughput", f"{r['gbps']:.3f} GB/s"),
        ("latency p50 / p99", f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f} ms"),
        ("descriptors/request", f"{r['descriptors_before']} pages -> {r['descriptors_after']} after coalescing"),
    ]
    if "raw_gbps" in r:
        rows.append(
            ("raw engine call", f"{r['raw_gbps']:.3f} GB/s   (kvwire/raw = {r['ratio']:.3f}, median per request)")
        )
    if "uncoalesced_gbps" in r:
        rows.append(
            (
                "one descriptor/page",
                f"{r['uncoalesced_gbps']:.3f} GB/s   "
                f"(coalescing speedup = {r['coalescing_speedup']:.2f}x, median per request)",
            )
        )
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key.ljust(width)}  {value}")
