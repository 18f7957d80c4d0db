"""``kvwire bench --inflight-requests N``: N requests in flight per peer against one at a time, in one run.

Both phases send the same kind of requests (fragmented pages, fresh random
placement) in waves of N, wave by wave side by side (their order alternating
per wave): the sequential phase with blocking ``send_kvcache`` calls one after
another, then ``send_notification``; the in-flight phase submits all N at
once (``submit_kvcache`` with the notification attached) and waits for every
future. Each request writes into
its own slot of the decode pool (slots are disjoint, with a free page at each
end, so one request's guard pages are never another's targets). After a
wave, the decode side confirms each request by its notification and only then
verifies its bytes and guard pages. Throughput is bytes over the time from the
wave's first call to its last completion; verification is outside it.

Latency per request: from its call (``send_kvcache``, or ``submit_kvcache``) to
its completion (the call's return, or its future's); with N in flight a request
waits behind the others of its wave, so its latency grows while the wave's
throughput does. Also reported: how long ``submit_kvcache`` takes to return, and when each
notification was seen on the decode side relative to its transfer's
completion on the prefill side (both ``time.monotonic``, one host's clock:
the local decode child only). Mooncake sends the notification inside the
write's own job, before the future completes, so its figure can be negative.

Whether requests in flight really overlap: when the backend's transport keeps
a :class:`~kvwire.transport.BusyClock` (kvwire-nixl: each posting stream;
kvwire-mooncake: each peer's writes), its snapshot is taken around every wave,
and each worker's busy time over the phase's wave time is reported per phase.
More in flight should leave the workers less idle between requests.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.benchmark.results import summary
from kvwire.benchmark.session import BenchSession
from kvwire.errors import ConfigError
from kvwire.planning.planner import plan_transfer
from kvwire.transport.busy import BusyClock, busy_between
from kvwire.workload.fragment import place, run_lengths

__all__ = ["check_inflight", "inflight_rows", "latency_note", "measure_inflight", "slot_pages"]


def slot_pages(pages_per_request: int) -> int:
    """Pages of one decode-pool slot: room for a request's runs and gaps, plus a free page at each end."""
    return 2 * pages_per_request + 64 + 2


def check_inflight(args: argparse.Namespace, capabilities: frozenset[str]) -> None:
    n = args.inflight_requests
    if n is None:
        return
    if n < 1:
        raise ConfigError(f"--inflight-requests must be >= 1, got {n}")
    if args.compare_raw or args.compare_uncoalesced:
        raise ConfigError("--inflight-requests compares its own two phases; drop --compare-raw/--compare-uncoalesced")
    if "notifications" not in capabilities:
        raise ConfigError(
            f"--inflight-requests: the decode side confirms each request by notification, and backend "
            f"{args.backend!r} does not declare 'notifications'"
        )


@dataclass
class _Tally:
    """One phase's sums over its waves."""

    seconds: float = 0.0
    bytes: int = 0
    verified: bool = True
    guards: bool = True
    submit_s: list[float] = field(default_factory=list)
    after_done: list[float] = field(default_factory=list)
    descriptors: list[int] = field(default_factory=lambda: [0, 0])
    rates: list[float] = field(default_factory=list)  # bytes per second of each wave
    requests: list[tuple[int, float]] = field(default_factory=list)  # per request: bytes, call to completion (s)
    busy: dict[str, float] = field(default_factory=dict)  # per transport worker: busy seconds within the waves

    def add_busy(self, before: dict[str, float], after: dict[str, float]) -> None:
        for name, seconds in busy_between(before, after).items():
            self.busy[name] = self.busy.get(name, 0.0) + seconds

    def add(self, moved: int, seconds: float) -> None:
        self.bytes += moved
        self.seconds += seconds
        self.rates.append(moved / seconds)

    @property
    def gbps(self) -> float:
        return round(self.bytes / self.seconds / 1e9, 3) if self.seconds else 0.0


@dataclass
class _Request:
    index: int
    slot: int
    src: NDArray[np.int32]
    dst: NDArray[np.int32]
    digest: str
    note: bytes
    descriptors: tuple[int, int]

    def pages(self) -> dict[str, Any]:
        return {"host_pages": self.dst.tolist(), "device_pages": None, "key": str(self.slot)}


def measure_inflight(session: BenchSession, progress: Callable[[str], None]) -> dict[str, Any]:
    """Run both phases; the in-flight phase's figures are the result's main ones."""
    args, conn, pool = session.args, session.conn, session.pool
    if session.peer_layout.is_split:
        raise ConfigError("--inflight-requests does not support split (HiSparse) presets")
    n = int(args.inflight_requests)
    rng = np.random.default_rng(args.seed + 11)
    ptrs = [b.base for b in session.peer_layout.buffers]
    span = slot_pages(session.pages_per_request)
    one = np.array([0], np.int32)
    conn.send_kvcache(session.endpoint, one, ptrs, one)  # warm-up: handshake
    session.decode.request({"cmd": "watch"})
    local_clock = args.peer is None
    busy_clock: BusyClock | None = getattr(getattr(conn.backend, "transport", None), "busy", None)
    count = 0

    def new_request(slot: int) -> _Request:
        nonlocal count
        lengths = run_lengths(rng, session.pages_per_request, args.mean_run, args.run_shape)
        src = place(rng, lengths, pool.num_pages).astype(np.int32)
        dst = (slot * span + 1 + place(rng, lengths, span - 2)).astype(np.int32)
        plan = plan_transfer(pool.layout, session.peer_layout, src, ptrs, dst)
        count += 1
        note = f"bench-{count}".encode()
        shape = (plan.descriptors_before, len(plan))
        return _Request(count, slot, src, dst, pool.digest(src.astype(np.int64)), note, shape)

    tally = {phase: _Tally() for phase in ("sequential", "inflight")}
    for w, first in enumerate(range(0, args.requests, n)):
        # Both phases per wave, their order alternating: drift in the machine's load falls on both alike.
        for phase in ("sequential", "inflight") if w % 2 == 0 else ("inflight", "sequential"):
            t = tally[phase]
            wave = [new_request(k) for k in range(min(n, args.requests - first))]
            for r in wave:
                session.decode.request({"cmd": "scramble", **r.pages()})
                t.descriptors[0] += r.descriptors[0]
                t.descriptors[1] += r.descriptors[1]
            done_at: dict[int, float] = {}
            called_at: dict[int, float] = {}
            moved_by: dict[int, int] = {}
            busy_before = busy_clock.snapshot() if busy_clock is not None else {}
            start = time.perf_counter()
            if phase == "sequential":
                for r in wave:
                    called_at[r.index] = time.monotonic()
                    moved_by[r.index] = conn.send_kvcache(session.endpoint, r.src, ptrs, r.dst)
                    done_at[r.index] = time.monotonic()
                    conn.send_notification(session.endpoint, r.note)
                t.add(sum(moved_by.values()), time.perf_counter() - start)
            else:
                futures: list[Future[int]] = []
                for r in wave:
                    t0 = time.perf_counter()
                    called_at[r.index] = time.monotonic()
                    future = conn.submit_kvcache(session.endpoint, r.src, ptrs, r.dst, notification=r.note)
                    t.submit_s.append(time.perf_counter() - t0)
                    future.add_done_callback(_stamp(done_at, r.index))
                    futures.append(future)
                wait(futures)
                t.add(sum(f.result() for f in futures), time.perf_counter() - start)
                moved_by.update((r.index, f.result()) for r, f in zip(wave, futures))
            if busy_clock is not None:
                t.add_busy(busy_before, busy_clock.snapshot())
            for r in wave:
                answer = session.decode.request(
                    {"cmd": "confirm", "note": r.note.hex(), "digest": r.digest, **r.pages()}
                )
                t.verified = t.verified and answer.get("ok") is True
                t.guards = t.guards and answer.get("guards_ok") is True
                seen = answer.get("seen")
                if local_clock and isinstance(seen, float) and r.index in done_at:
                    t.after_done.append(seen - done_at[r.index])
                progress("verified" if t.verified and t.guards else "MISMATCH")
            # after the confirms: a future's done-callback may run just after wait() returned
            t.requests += [(moved_by[i], done_at[i] - called_at[i]) for i in (r.index for r in wave) if i in done_at]
    result = _result(args, tally)
    result["busy_clock"] = busy_clock is not None
    return result


def _stamp(done_at: dict[int, float], index: int) -> Callable[[Future[int]], None]:
    """A done-callback noting when request ``index`` completed."""

    def stamp(_: Future[int]) -> None:
        done_at[index] = time.monotonic()

    return stamp


def _pct(values: list[float], q: float, scale: float) -> float | None:
    return round(float(np.percentile(np.array(values), q)) * scale, 1) if values else None


def _result(args: argparse.Namespace, phases: dict[str, _Tally]) -> dict[str, Any]:
    seq, inf = phases["sequential"], phases["inflight"]
    waves = [a / b for a, b in zip(inf.rates, seq.rates)]
    result = summary(
        args.requests,
        args.tokens,
        inf.bytes,
        [inf.seconds],
        verified=seq.verified and inf.verified,
        guards=seq.guards and inf.guards,
        descriptors=(inf.descriptors[0], inf.descriptors[1]),
    )
    result.update(
        p50_ms=_pct([s for _, s in inf.requests], 50, 1e3),
        p99_ms=_pct([s for _, s in inf.requests], 99, 1e3),
        sequential_p50_ms=_pct([s for _, s in seq.requests], 50, 1e3),
        sequential_p99_ms=_pct([s for _, s in seq.requests], 99, 1e3),
    )
    result.update(
        inflight_requests=args.inflight_requests,
        sequential_gbps=seq.gbps,
        inflight_gbps=inf.gbps,
        inflight_ratio=round(inf.gbps / seq.gbps, 3) if seq.gbps else None,
        # each wave against the other phase's wave run next to it, then the median: robust to a noisy machine
        inflight_ratio_paired=round(statistics.median(waves), 3),
        inflight_wave_ratios=[round(w, 3) for w in waves],
        submit_p50_us=_pct(inf.submit_s, 50, 1e6),
        submit_p99_us=_pct(inf.submit_s, 99, 1e6),
        notify_p50_us=_pct(inf.after_done, 50, 1e6),
        notify_p99_us=_pct(inf.after_done, 99, 1e6),
        sequential_notify_p50_us=_pct(seq.after_done, 50, 1e6),
        sequential_notify_p99_us=_pct(seq.after_done, 99, 1e6),
    )
    result["busy_fractions"] = {
        phase: {name: round(t.busy[name] / t.seconds, 4) for name in sorted(t.busy)} if t.seconds else {}
        for phase, t in (("sequential", seq), ("inflight", inf))
    }
    result["_series"] = {"1 in flight": seq.requests, f"{args.inflight_requests} in flight": inf.requests}
    return result


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def latency_note(r: dict[str, Any]) -> str:
    """What the latency row's figures are, for an in-flight run: N in flight, and the sequential phase's."""
    if "inflight_gbps" not in r:
        return ""
    return (
        f" per request, {r['inflight_requests']} in flight (call to completion); "
        f"1 in flight: {_ms(r['sequential_p50_ms'])} / {_ms(r['sequential_p99_ms'])} ms"
    )


def inflight_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """The table rows of an in-flight run."""
    if "inflight_gbps" not in r:
        return []

    def us(key: str) -> str:
        return "n/a (decode side on another host)" if r[key] is None else f"{r[key]:.0f} us"

    return [
        ("1 in flight", f"{r['sequential_gbps']:.3f} GB/s   (send_kvcache, then send_notification)"),
        (
            f"{r['inflight_requests']} in flight",
            f"{r['inflight_gbps']:.3f} GB/s   (submit_kvcache with notification; {r['inflight_ratio']:.3f}x "
            f"the sequential, {r['inflight_ratio_paired']:.3f}x median per wave)",
        ),
        (
            "  per wave",
            f"{sum(w >= 1 for w in r['inflight_wave_ratios'])} of {len(r['inflight_wave_ratios'])} waves at least as "
            f"fast in flight ({', '.join(f'{w:.2f}' for w in r['inflight_wave_ratios'])})",
        ),
        ("submit returns p50/p99", f"{r['submit_p50_us']:.0f} / {r['submit_p99_us']:.0f} us"),
        ("notification p50/p99", f"{us('notify_p50_us')} / {us('notify_p99_us')} after completion (in flight)"),
        (
            "  sequential",
            f"{us('sequential_notify_p50_us')} / {us('sequential_notify_p99_us')} after send_kvcache returned",
        ),
        *_busy_rows(r),
    ]


def _busy_rows(r: dict[str, Any]) -> list[tuple[str, str]]:
    """Each transport worker's busy fraction per phase (none when the transport keeps no BusyClock)."""
    fractions = r.get("busy_fractions") or {}
    if not r.get("busy_clock"):
        return [("workers busy", "n/a (the transport keeps no kvwire.transport.BusyClock)")]

    def line(phase: str) -> str:
        return ", ".join(f"{name[:40]} {f:.1%}" for name, f in fractions.get(phase, {}).items()) or "none"

    return [
        ("workers busy", f"{line('inflight')}   ({r['inflight_requests']} in flight; of the waves' time)"),
        ("  sequential", line("sequential")),
    ]
