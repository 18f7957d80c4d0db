"""``kvwire bench --prefill-tp P --decode-tp D``: a KV cache moved between attention-TP groups.

The P prefill ranks are P connections in this process, each with its own pool
holding its head slice (the layout records TP size, rank and heads); the D
decode ranks are D decode child processes, likewise. Every request takes the
same fragmented page ids on every rank and is sent from every prefill rank to
each decode rank it is routed to (sglang's and vLLM's routing), one send after
another, timed as one request. Each decode rank then checks its target pages
against a digest this side computes independently from the prefill pools (the
decode rank's heads gathered per token, from the sender that holds them), and
its guard pages. With ``--landing`` (prefill TP > decode TP, token-major) each
prefill rank writes its pages whole into landing pages its decode rank reserved
(:mod:`kvwire.landing`), and the decode rank scatters them into its KV pages:
sender ``p``'s scatter runs while sender ``p + 1`` writes, and the request is
timed until the last scatter is done. ``--compare-same-tp`` sends the same pages, whole, from a
1-rank prefill pool to an extra 1-rank decode child, interleaved per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.benchmark.plot import Series
from kvwire.benchmark.presets import Preset, get_preset
from kvwire.benchmark.progress import Progress, Steps
from kvwire.benchmark.results import summary
from kvwire.config import BackendConfig
from kvwire.connection import Connection
from kvwire.control import ChildProcess
from kvwire.errors import ConfigError
from kvwire.layout.peer import PeerDescription
from kvwire.planning.planner import plan_transfer
from kvwire.registry.manager import connect
from kvwire.workload.fragment import place, run_lengths
from kvwire.workload.memory import KVMemory, allocate, digest

__all__ = [
    "add_tp_arguments",
    "check_tp_arguments",
    "expected_digest",
    "heads_of",
    "routed",
    "run_tp",
    "tp_rows",
    "uses_tp",
]

Row = tuple[str, str]


def add_tp_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill-tp", type=int, default=1, help="prefill attention-TP size (default 1; MHA presets)")
    parser.add_argument("--decode-tp", type=int, default=1, help="decode attention-TP size (default 1; MHA presets)")
    parser.add_argument(
        "--compare-same-tp",
        action="store_true",
        help="also time the same pages sent whole from a 1-rank prefill to a 1-rank decode (TP sizes other than 1)",
    )
    parser.add_argument(
        "--head-major",
        action="store_true",
        help="head-major pages on every rank (vLLM's HND): a rank's heads are one run of each page, so head "
        "slices move one descriptor per page (TP sizes other than 1)",
    )
    parser.add_argument(
        "--landing",
        action="store_true",
        help="prefill TP > decode TP, token-major: each prefill rank writes whole pages into landing pages of "
        "its decode rank, which scatters them into its KV pages (kvwire.landing); the scatter is timed",
    )


def uses_tp(args: argparse.Namespace) -> bool:
    """The TP path: a prefill or decode TP size other than 1."""
    return bool(args.prefill_tp != 1 or args.decode_tp != 1)


def check_tp_arguments(args: argparse.Namespace) -> None:
    """ConfigError for a TP combination the bench cannot run."""
    p, d = args.prefill_tp, args.decode_tp
    if not uses_tp(args):
        for flag, on in (
            ("--compare-same-tp", args.compare_same_tp),
            ("--head-major", args.head_major),
            ("--landing", args.landing),
        ):
            if on:
                raise ConfigError(f"{flag} is for different TP sizes: give --prefill-tp or --decode-tp other than 1")
        return
    if args.role == "decode":
        raise ConfigError("--prefill-tp and --decode-tp are the prefill side's options (the decode side is sent them)")
    preset = get_preset(args.preset)
    for flag, tp in (("--prefill-tp", p), ("--decode-tp", d)):
        if tp != 1:  # 1 always fits; the flag that asked for TP is the one named
            preset.check_tp(tp, flag)
    if max(p, d) % min(p, d):
        raise ConfigError(f"--prefill-tp {p} and --decode-tp {d}: the larger TP size must be a multiple of the smaller")
    if args.landing and (p <= d or args.head_major):
        raise ConfigError(
            f"--landing is for token-major pages with prefill TP > decode TP (got --prefill-tp {p} --decode-tp {d}"
            f"{' --head-major' if args.head_major else ''}): otherwise every decode page has one sender "
            "or its heads are one run already"
        )
    if args.peer:
        raise ConfigError("--peer: a remote decode side is one rank; use --prefill-tp 1 --decode-tp 1 with --peer")
    wanted = [
        f for f, on in (("--compare-raw", args.compare_raw), ("--compare-uncoalesced", args.compare_uncoalesced)) if on
    ]
    if wanted:
        raise ConfigError(f"{' and '.join(wanted)}: single-rank only (--prefill-tp 1 --decode-tp 1)")


def routed(prefill_tp: int, decode_tp: int, d: int) -> range:
    """The prefill ranks decode rank ``d`` receives from (sglang/vLLM routing)."""
    if prefill_tp <= decode_tp:
        return range(d * prefill_tp // decode_tp, d * prefill_tp // decode_tp + 1)
    ratio = prefill_tp // decode_tp
    return range(d * ratio, (d + 1) * ratio)


def heads_of(tp: int, rank: int, total: int) -> range:
    """The global KV heads a rank holds (one replicated head when there are fewer heads than ranks)."""
    if total >= tp:
        return range(rank * (total // tp), (rank + 1) * (total // tp))
    return range(rank // (tp // total), rank // (tp // total) + 1)


def expected_digest(
    preset: Preset, pools: Sequence[KVMemory], decode_tp: int, d: int, src: NDArray[np.int64], head_major: bool = False
) -> str:
    """Digest of decode rank ``d``'s target pages as the prefill pools say they must be, in its buffer order.

    Each of the rank's heads comes from the lowest-ranked of its senders that holds it. A token-major
    page is (tokens, heads, head bytes), a head-major one (heads, tokens, head bytes).
    """
    prefill_tp, total = len(pools), preset.kv_heads
    n, tokens, head_bytes = src.shape[0], preset.page_tokens, preset.head_dim * preset.dtype_bytes
    senders = routed(prefill_tp, decode_tp, d)
    source = []  # (prefill rank, its local head) of each of the decode rank's heads, in order
    for g in heads_of(decode_tp, d, total):
        p = next(p for p in senders if g in heads_of(prefill_tp, p, total))
        source.append((p, g - heads_of(prefill_tp, p, total).start))
    views = []
    for i in range(len(pools[0].layout.buffers)):
        pages = {p: pools[p].host_view(i)[src] for p in {p for p, _ in source}}
        if head_major:
            gathered = {p: a.reshape(n, -1, tokens, head_bytes) for p, a in pages.items()}
            views.append(np.stack([gathered[p][:, h] for p, h in source], axis=1).reshape(n, -1))
        else:
            gathered = {p: a.reshape(n, tokens, -1, head_bytes) for p, a in pages.items()}
            views.append(np.stack([gathered[p][:, :, h] for p, h in source], axis=2).reshape(n, -1))
    return digest(views)


@dataclass
class _Decode:
    """A decode child: its channel, description and buffer pointers."""

    channel: ChildProcess
    peer: PeerDescription
    rank: int
    landing: PeerDescription | None = None  # its landing pool (--landing)

    @property
    def ptrs(self) -> list[int]:
        return _bases(self.peer)

    @property
    def target(self) -> PeerDescription:
        """Where senders write: the landing pool with ``--landing``, else the KV pages."""
        return self.landing or self.peer


def _bases(peer: PeerDescription) -> list[int]:
    return [b.base for b in peer.layout.buffers]


@dataclass
class _Prefill:
    conn: Connection
    pool: KVMemory
    rank: int


def _decode_children(
    stack: ExitStack,
    args: dict[str, Any],
    ranks: Sequence[tuple[int, int]],
    landing: list[int] | None = None,
    tp_ranks: int = 0,
) -> list[_Decode]:
    """Start one decode child per (TP size, rank), all at once, then read their descriptions.

    ``landing`` (``[prefill TP, pages]``) goes to the first ``tp_ranks`` children (the TP group's).
    """
    channels = []
    for i, (tp, rank) in enumerate(ranks):
        extra = {"landing": landing} if landing is not None and i < tp_ranks else {}
        child = ChildProcess(
            "kvwire.benchmark.decode",
            [json.dumps({**args, **extra, "tp": [tp, rank], "seed": args["seed"] + tp * 100 + rank})],
            what=f"decode process (TP {tp} rank {rank})",
        )
        stack.callback(child.close)
        channels.append(child)
    decodes = []
    for c, (_, rank) in zip(channels, ranks):
        described = c.read()
        pool = described.pop("landing", None)
        decodes.append(_Decode(c, PeerDescription.from_dict(described), rank, pool and PeerDescription.from_dict(pool)))
    return decodes


def _prefill_rank(
    stack: ExitStack, args: argparse.Namespace, config: BackendConfig, pages: int, tp: int, rank: int
) -> _Prefill:
    preset = get_preset(args.preset)
    pool = allocate(preset.entries(decode_side=False), pages, preset.heads(tp).page_bytes, backing="auto")
    pool.layout = preset.rank_layout(pool.layout, tp, rank, bool(args.head_major))
    pool.fill_random(args.seed + 1000 + tp * 100 + rank)
    conn = stack.enter_context(connect(args.backend, config))
    conn.register_kv_buffers(pool.layout)
    return _Prefill(conn, pool, rank)


def run_tp(
    args: argparse.Namespace,
    config: BackendConfig,
    decode_args: dict[str, Any],
    pages_per_request: int,
    steps: Steps,
) -> tuple[dict[str, Any], str]:
    """Run the TP bench: the result (the single-rank bench's fields and the TP ones) and the pools' backing."""
    p_tp, d_tp = args.prefill_tp, args.decode_tp
    pool_pages = int(decode_args["pages"])
    with ExitStack() as stack:
        ranks = [(d_tp, d) for d in range(d_tp)] + ([(1, 0)] if args.compare_same_tp else [])
        extra = ", and a 1-rank one for --compare-same-tp" if args.compare_same_tp else ""
        steps(
            f"starting {len(ranks)} decode processes (TP {d_tp}{extra}); "
            f"waiting for each to allocate and register {pool_pages} pages"
        )
        landing = [p_tp, pages_per_request * (p_tp // d_tp)] if args.landing else None
        children = _decode_children(
            stack, {**decode_args, "head_major": bool(args.head_major)}, ranks, landing=landing, tp_ranks=d_tp
        )
        decodes, same_decode = children[:d_tp], children[d_tp:]
        steps(f"allocating and registering {p_tp} prefill rank pools ({args.backend}, {pool_pages} pages each)")
        prefills = [_prefill_rank(stack, args, config, pool_pages, p_tp, p) for p in range(p_tp)]
        pairs = [(prefills[p], decodes[d]) for p in range(p_tp) for d in range(d_tp) if p in routed(p_tp, d_tp, d)]
        same: tuple[_Prefill, _Decode] | None = None
        if same_decode:  # a 1-rank prefill pool: prefill rank 0 when it is one
            source = prefills[0] if p_tp == 1 else _prefill_rank(stack, args, config, pool_pages, 1, 0)
            same = (source, same_decode[0])
        one = np.array([0], np.int32)
        steps(f"adding peers and a warm-up transfer on each of {len(pairs) + (same is not None)} rank pairs")
        for prefill, dec in pairs + ([same] if same else []):
            target = dec.target
            prefill.conn.add_peer(target.endpoint, target.layout)
            prefill.conn.send_kvcache(target.endpoint, one, _bases(target), one)  # warm-up: handshake
        steps(f"sending {args.requests} requests of {args.tokens} tokens (TP {p_tp} -> {d_tp})")
        step = Progress(args.requests, steps).step
        result = _measure(args, pairs, same, decodes, [p.pool for p in prefills], pages_per_request, pool_pages, step)
        steps("closing the decode processes")
    return result, prefills[0].pool.backing


def _send(pairs: Sequence[tuple[_Prefill, _Decode]], src: NDArray[np.int32], dst: NDArray[np.int32]) -> int:
    return sum(p.conn.send_kvcache(d.peer.endpoint, src, d.ptrs, dst) for p, d in pairs)


def _reserve(decodes: Sequence[_Decode], count: int) -> dict[int, dict[str, list[int]]]:
    """Landing pages of each decode rank for each of its senders (``--landing``)."""
    return {dec.rank: dec.channel.request({"cmd": "reserve", "count": count})["pages"] for dec in decodes}


def _landing_sends(
    pairs: Sequence[tuple[_Prefill, _Decode]], reserved: dict[int, dict[str, list[int]]]
) -> list[tuple[_Prefill, _Decode, list[int]]]:
    """The pairs that send, each with its landing pages (a GQA replica another sender covers has none)."""
    found = [(prefill, dec, reserved[dec.rank].get(str(prefill.rank))) for prefill, dec in pairs]
    return [(prefill, dec, land) for prefill, dec, land in found if land is not None]


def _send_landing(
    pairs: Sequence[tuple[_Prefill, _Decode]],
    src: NDArray[np.int32],
    dst: NDArray[np.int32],
    reserved: dict[int, dict[str, list[int]]],
) -> int:
    """Each sender writes whole pages into its landing pages; its decode rank scatters them while the next writes.

    Returns once every scatter has answered.
    """
    moved = 0
    scattering: list[_Decode] = []
    for prefill, dec, land in _landing_sends(pairs, reserved):
        target = dec.target
        moved += prefill.conn.send_kvcache(target.endpoint, src, _bases(target), np.asarray(land, np.int32))
        dec.channel.send({"cmd": "scatter", "sender": prefill.rank, "landing_pages": land, "host_pages": dst.tolist()})
        scattering.append(dec)
    for dec in scattering:
        answer = dec.channel.read()
        if answer.get("ok") is not True:
            raise RuntimeError(f"decode rank {dec.rank}: scatter failed: {answer}")
    return moved


def _measure(
    args: argparse.Namespace,
    pairs: list[tuple[_Prefill, _Decode]],
    same: tuple[_Prefill, _Decode] | None,
    decodes: list[_Decode],
    pools: list[KVMemory],
    pages_per_request: int,
    pool_pages: int,
    step: Callable[[str], None],
) -> dict[str, Any]:
    preset = get_preset(args.preset)
    rng = np.random.default_rng(args.seed + 7)
    latencies: list[float] = []
    same_seconds = 0.0
    ratios: list[float] = []  # per request: TP throughput / same-TP throughput
    tp_label = f"TP {args.prefill_tp} -> {args.decode_tp}" + (", head-major pages" if args.head_major else "")
    tp_label += ", landing + scatter" if args.landing else ""
    series: Series = {tp_label: []}
    if same is not None:
        series["same TP (1 -> 1)"] = []
    total = same_total = before = after = same_after = 0
    verified = guards = True
    for i in range(args.requests):
        lengths = run_lengths(rng, pages_per_request, args.mean_run, args.run_shape)
        src = place(rng, lengths, pool_pages).astype(np.int32)
        dst = place(rng, lengths, pool_pages).astype(np.int32)
        src64 = src.astype(np.int64)
        pages = {"host_pages": dst.tolist(), "device_pages": None}
        for prefill, dec in pairs:
            if dec.landing is None:  # with landing pages: counted once they are reserved
                plan = plan_transfer(prefill.pool.layout, dec.peer.layout, src, dec.ptrs, dst)
                before += plan.descriptors_before
                after += len(plan)
        # (decode ranks, expected digests) checked after each mode
        modes: list[tuple[str, list[tuple[_Decode, str]], list[tuple[_Prefill, _Decode]]]] = [
            (
                "tp",
                [
                    (dec, expected_digest(preset, pools, len(decodes), d, src64, args.head_major))
                    for d, dec in enumerate(decodes)
                ],
                pairs,
            ),
        ]
        if same is not None:
            same_after += len(plan_transfer(same[0].pool.layout, same[1].peer.layout, src, same[1].ptrs, dst))
            modes.append(("same", [(same[1], same[0].pool.digest(src64))], [same]))
        timings: dict[str, tuple[int, float]] = {}
        for name, checks, sends in modes[i % len(modes) :] + modes[: i % len(modes)]:
            for dec, _ in checks:
                dec.channel.request({"cmd": "scramble", **pages})
            if name == "tp" and args.landing:  # reserved before the request, as its KV pages are
                reserved = _reserve(decodes, len(src))
                for prefill, dec, land in _landing_sends(sends, reserved):  # the plans the sends will make
                    target = dec.target
                    plan = plan_transfer(
                        prefill.pool.layout, target.layout, src, _bases(target), np.asarray(land, np.int32)
                    )
                    before += plan.descriptors_before
                    after += len(plan)
                start = time.perf_counter()
                moved = _send_landing(sends, src, dst, reserved)
            else:
                start = time.perf_counter()
                moved = _send(sends, src, dst)
            timings[name] = (moved, time.perf_counter() - start)
            for dec, expected in checks:
                answer = dec.channel.request({"cmd": "verify", "digest": expected, **pages})
                verified = verified and answer.get("ok") is True
                guards = guards and answer.get("guards_ok") is True
        moved, elapsed = timings["tp"]
        total += moved
        latencies.append(elapsed)
        series[tp_label].append((moved, elapsed))
        if "same" in timings:
            same_moved, same_elapsed = timings["same"]
            series["same TP (1 -> 1)"].append((same_moved, same_elapsed))
            same_total += same_moved
            same_seconds += same_elapsed
            ratios.append((moved / elapsed) / (same_moved / same_elapsed))
        step("verified" if verified and guards else "MISMATCH")
    result = summary(
        args.requests, args.tokens, total, latencies, verified=verified, guards=guards, descriptors=(before, after)
    )
    result["rank_pairs"] = len(pairs)
    result["head_major"] = bool(args.head_major)
    result["landing"] = bool(args.landing)
    if same is not None:
        result["same_tp_bytes"] = same_total
        result["same_tp_gbps"] = round(same_total / same_seconds / 1e9, 3) if same_seconds else 0.0
        result["same_tp_descriptors"] = same_after // args.requests
        result["tp_ratio"] = round(statistics.median(ratios), 3)
    result["_series"] = series
    return result


def tp_rows(r: dict[str, Any]) -> tuple[list[Row], list[Row]]:
    """Table rows of a TP run: (after the backend row, at the end); none for a single-rank run."""
    if "rank_pairs" not in r:
        return [], []
    head = [
        (
            "attention TP",
            f"prefill {r['prefill_tp']} -> decode {r['decode_tp']}, "
            f"{r['rank_pairs']} rank pairs per request (sent one after another, timed together)"
            + (", head-major pages" if r.get("head_major") else ", token-major pages")
            + (", landing pages scattered by the decode rank (timed)" if r.get("landing") else ""),
        )
    ]
    tail = []
    if "same_tp_gbps" in r:
        tail.append(
            (
                "same TP (1 -> 1)",
                f"{r['same_tp_gbps']:.3f} GB/s, {r['same_tp_descriptors']} descriptors/request   "
                f"(TP/same-TP = {r['tp_ratio']:.3f}, median per request)",
            )
        )
    return head, tail
