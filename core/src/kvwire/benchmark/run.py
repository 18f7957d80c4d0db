"""``kvwire bench``: orchestrate a decode process, send requests from this (prefill) process.

Each request takes random fragmented pages (mean run ``--mean-run``) on both
sides, is sent through the chosen backend, timed, and verified on the decode
side (the target pages by digest, and their guard pages unchanged).
``--compare-raw`` sends the identical descriptors through the backend's raw
engine call (the ``raw_write`` bench seam) in the same run;
``--compare-uncoalesced`` sends one descriptor per page through it. Before
every mode the decode side scrambles the target pages, so every mode is timed
on the same memory state and only kvwire's own write can pass verification.
``--prefill-tp``/``--decode-tp`` other than 1 run :mod:`kvwire.benchmark.tp`;
``--inflight-requests N`` runs :mod:`kvwire.benchmark.inflight`.
Set-up steps and progress go to stderr as they happen (:mod:`kvwire.benchmark.progress`);
``--plot FILE.png`` draws every compared mode per request (:mod:`kvwire.benchmark.plot`).
The TCP control channel of ``--listen``/``--peer`` is authenticated by a shared
key (``KVWIRE_CONTROL_KEY`` or ``--control-key-file``; :mod:`kvwire.control.auth`).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np

from kvwire.benchmark.decode import listen
from kvwire.benchmark.inflight import check_inflight, inflight_rows, latency_note, measure_inflight, slot_pages
from kvwire.benchmark.plot import Series, check_plot, write_plot
from kvwire.benchmark.presets import PRESETS, get_preset
from kvwire.benchmark.progress import Progress, Steps
from kvwire.benchmark.results import summary
from kvwire.benchmark.session import BenchSession
from kvwire.benchmark.tp import add_tp_arguments, check_tp_arguments, run_tp, tp_rows, uses_tp
from kvwire.config import resolve_config
from kvwire.control import KEY_ENV, Channel, ChildProcess, PeerConnection, check_listen_key, load_key, parse_address
from kvwire.errors import ConfigError
from kvwire.layout.peer import PeerDescription
from kvwire.planning.planner import plan_transfer
from kvwire.registry.manager import connect, default_registry
from kvwire.settings.sources import option_value
from kvwire.transport.backend import offers_raw_write
from kvwire.workload.fragment import place, run_lengths
from kvwire.workload.memory import allocate

__all__ = ["add_arguments", "run"]

#: The modes of a single-rank run, as the plot's legend names them.
_MODE_LABELS = {"kvwire": "kvwire", "raw": "raw engine call", "uncoalesced": "one descriptor/page"}


def _option(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with VALUE read as JSON (``port=0`` is the int 0), else kept as the string
    (the rule of ``KVWIRE_OPTION_<KEY>``: :func:`kvwire.settings.sources.option_value`)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, option_value(value, f"--option {text}")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _device(text: str) -> str:
    if re.fullmatch(r"cpu|cuda(:\d+)?", text) is None:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default=None, help="backend name (one that reaches other processes)")
    parser.add_argument(
        "--role",
        choices=("prefill", "decode"),
        default="prefill",
        help="prefill (default): run the job, with a local decode child or the decode side at --peer; "
        "decode: serve one prefill side that connects to --listen (two machines)",
    )
    parser.add_argument("--listen", metavar="HOST:PORT", help="--role decode: where to wait for the prefill side")
    parser.add_argument("--peer", metavar="HOST:PORT", help="the decode side started with --role decode --listen")
    parser.add_argument(
        "--host",
        default=None,
        help="this side's engine address (BackendConfig.host; default: $KVWIRE_HOST, the config file, 127.0.0.1)",
    )
    parser.add_argument("--preset", default="llama3-8b", choices=list(PRESETS), help="layout preset")
    parser.add_argument("--requests", type=int, default=16, help="number of requests (default 16)")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per request (default 4096)")
    parser.add_argument("--mean-run", type=int, default=8, help="mean run of consecutive pages (default 8)")
    parser.add_argument(
        "--run-shape",
        choices=("geometric", "fixed"),
        default="geometric",
        help="run lengths: geometric with mean --mean-run (default), or all exactly --mean-run",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        type=_device,
        help="where decode-side device buffers live: cpu (default), cuda or cuda:N (needs torch with CUDA)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the random pages and bytes (default 0)")
    parser.add_argument(
        "--timeout",
        type=float,
        default=None,
        help="transfer timeout in seconds (BackendConfig.timeout_s; default: $KVWIRE_TIMEOUT_S, the config file, 10)",
    )
    parser.add_argument(
        "--option",
        type=_option,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a backend option (BackendConfig.options), e.g. max_inflight_per_peer=1024 for mooncake; repeatable. "
        "VALUE is read as JSON (port=0 is the integer 0, flag=true a bool, ids=[1,2] a list, name='\"7\"' the "
        "string 7); a VALUE that is not JSON (name=abc) is kept as the string, one that starts like JSON but is "
        "not (ids=[1,2) is refused, as in KVWIRE_OPTION_<KEY>",
    )
    parser.add_argument("--compare-raw", action="store_true", help="also time the raw engine call, same descriptors")
    parser.add_argument("--compare-uncoalesced", action="store_true", help="also time one descriptor per page")
    parser.add_argument(
        "--inflight-requests",
        type=int,
        default=None,
        metavar="N",
        help="submit N requests at once per wave (submit_kvcache, notifications) and compare with one at a time",
    )
    add_tp_arguments(parser)
    parser.add_argument(
        "--control-key-file",
        metavar="FILE",
        help=f"the secret of the TCP control channel (--listen/--peer), the same on both sides; default: ${KEY_ENV}. "
        "Without a key, --listen accepts only a loopback address",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        help="also draw per-request throughput and latency of every compared mode into FILE (.png, .svg or .pdf; "
        "needs matplotlib: pip install 'kvwire[plot]')",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object instead of a table (set-up and progress: stderr)"
    )


def _check_arguments(args: argparse.Namespace) -> None:
    check_tp_arguments(args)
    if args.role == "decode" and not args.listen:
        raise ConfigError("--role decode needs --listen HOST:PORT")
    if args.role == "prefill" and args.listen:
        raise ConfigError("--listen is for --role decode; the prefill side connects with --peer HOST:PORT")
    if args.role == "decode":
        if args.plot:
            raise ConfigError("--plot is for the prefill side (it measures); the decode side only answers")
        host, _ = parse_address(args.listen, "--listen")
        check_listen_key(host, load_key(args.control_key_file))
        return  # the prefill side sends the backend, preset and sizes
    if args.peer:
        parse_address(args.peer, "--peer")
        load_key(args.control_key_file)
    elif args.control_key_file:
        raise ConfigError(
            "--control-key-file is for the TCP control channel (--listen or --peer); local decode processes "
            "talk over pipes no other process can reach"
        )
    if args.plot:
        check_plot(args.plot)
    for name in ("requests", "tokens", "mean_run"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.timeout is not None and not args.timeout > 0:
        raise ConfigError(f"--timeout must be > 0, got {args.timeout}")
    get_preset(args.preset)
    registry = default_registry()
    reaching = sorted(i.name for i in registry.supporting({"interprocess"}))
    if args.backend is None:
        raise ConfigError(f"--backend: choose a backend; installed ones that reach other processes: {reaching}")
    info = registry.get(args.backend)
    if "interprocess" not in info.capabilities:
        raise ConfigError(
            f"--backend {args.backend}: the bench sends to a decode process, and backend {args.backend!r} only "
            f"reaches endpoints of its own process (it does not declare 'interprocess'); use one of {reaching}"
        )
    wanted = [
        flag
        for flag, on in (("--compare-raw", args.compare_raw), ("--compare-uncoalesced", args.compare_uncoalesced))
        if on
    ]
    if wanted and not (info.cls is not None and offers_raw_write(info.cls)):
        raise ConfigError(
            f"{' and '.join(wanted)}: backend {args.backend!r} offers no raw engine call (a kvwire.TransportBackend "
            "whose transport implements kvwire.RawWriter)"
        )
    check_inflight(args, info.capabilities)
    if args.inflight_requests is not None and uses_tp(args):
        raise ConfigError("--inflight-requests runs with --prefill-tp 1 --decode-tp 1 only")


def _decode_side(args: argparse.Namespace, decode_args: dict[str, Any], steps: Steps) -> Channel:
    """A local decode child, or (``--peer``) a connection to a decode side started on another machine."""
    if args.peer is None:
        steps("starting the decode process (a local child)")
        return ChildProcess("kvwire.benchmark.decode", [json.dumps(decode_args)], what="decode process")
    host, port = parse_address(args.peer, "--peer")
    key = load_key(args.control_key_file)
    steps(f"connecting to the decode side at {args.peer} ({'control key' if key else 'no control key'})")
    channel = PeerConnection(host, port, what="decode side", timeout_s=120.0, key=key)
    try:
        channel.send({"cmd": "start", **decode_args})
    except BaseException:
        channel.close()
        raise
    return channel


def run(args: argparse.Namespace) -> int:
    _check_arguments(args)
    # The flags over $KVWIRE_* over the config file ($KVWIRE_CONFIG) over the defaults; a flag left out is None.
    options = dict(args.option) or None
    args.resolved = resolve_config(host=args.host, timeout_s=args.timeout, process_settings=True, options=options)
    config = args.resolved.config
    steps = Steps()
    if args.role == "decode":
        return listen(args.listen, config.host, load_key(args.control_key_file), steps)
    preset = get_preset(args.preset)
    pages_per_request = -(-args.tokens // preset.page_tokens)
    pool_pages = 2 * pages_per_request + 64  # the runs and the 1-3 free pages after each (~1.25x at mean run 8)
    slots = args.inflight_requests
    peer_pages = pool_pages if slots is None else slots * slot_pages(pages_per_request)
    decode_args = {
        "backend": args.backend,
        "preset": preset.name,
        "pages": peer_pages,
        "seed": args.seed + 1,
        "device": args.device,
        "config": config.to_dict(),
    }
    if uses_tp(args):
        result, backing = run_tp(args, config, decode_args, pages_per_request, steps)
        return _report(args, result, backing, "local children", steps)
    decode = _decode_side(args, decode_args, steps)
    try:
        steps(f"waiting for the decode side to allocate and register {peer_pages} pages ({args.backend})")
        peer = PeerDescription.from_dict(decode.read())
        steps(f"allocating the prefill pool: {pool_pages} pages x {preset.page_bytes} bytes ({preset.name})")
        pool = allocate(preset.entries(decode_side=False), pool_pages, preset.page_bytes, backing="auto")
        pool.fill_random(args.seed)
        steps(f"connecting {args.backend} and registering the prefill pool ({pool.backing})")
        with connect(args.backend, config) as conn:
            conn.register_kv_buffers(pool.layout)
            conn.add_peer(peer.endpoint, peer.layout)
            session = BenchSession(args, conn, pool, peer, pages_per_request, decode)
            if args.inflight_requests is not None:
                steps(f"sending {args.requests} requests, {args.inflight_requests} in flight and one at a time")
                step = Progress(2 * args.requests, steps, what="requests of both phases").step
                result = measure_inflight(session, step)
            else:
                result = _measure(session, steps)
        steps("closing the decode side")
    finally:
        decode.close()
    return _report(args, result, pool.backing, args.peer or "local child", steps)


def _report(args: argparse.Namespace, result: dict[str, Any], backing: str, decode: str, steps: Steps) -> int:
    series: Series = result.pop("_series", {})
    result.update(backend=args.backend, preset=args.preset, backing=backing, decode=decode)
    result.update(prefill_tp=args.prefill_tp, decode_tp=args.decode_tp)
    result.update(backend_config=args.resolved.to_dict())
    plot_error: ConfigError | None = None
    if args.plot:
        title = f"kvwire bench: {args.backend}, {args.preset}, {args.requests} x {args.tokens} tokens"
        try:
            write_plot(args.plot, series, title)
            steps(f"wrote the plot of {', '.join(series)} per request to {args.plot}")
        except ConfigError as exc:  # the run's result is printed all the same, then the error (exit 2)
            plot_error = exc
            result["plot_error"] = str(exc)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(result)
    if plot_error is not None:
        raise plot_error
    return 0 if result["verified"] and result["guards_unchanged"] else 1


def _measure(session: BenchSession, steps: Steps) -> dict[str, Any]:
    args, conn, pool = session.args, session.conn, session.pool
    rng = np.random.default_rng(args.seed + 7)
    ptrs = [b.base for b in session.peer_layout.buffers]
    split = session.peer_layout.is_split
    latencies: list[float] = []
    seconds_by_mode = {"raw": 0.0, "uncoalesced": 0.0}
    modes_verified: dict[str, bool] = {}  # the compared modes' writes are verified too
    paired: dict[str, list[float]] = {"raw": [], "uncoalesced": []}  # per request: other mode's time / kvwire's
    total = 0
    verified = guards = True
    before = after = 0
    series: Series = {"kvwire": []}
    steps("warm-up transfer (the backend's handshake with the decode side)")
    one = np.array([0], np.int32)
    conn.send_kvcache(session.endpoint, one, ptrs, one, None, None, one if split else None)  # warm-up: handshake
    compared = [m for m, on in (("raw", args.compare_raw), ("uncoalesced", args.compare_uncoalesced)) if on]
    series.update({_MODE_LABELS[m]: [] for m in compared})
    steps(f"sending {args.requests} requests of {args.tokens} tokens ({', '.join(['kvwire', *compared])})")
    progress = Progress(args.requests, steps)
    for i in range(args.requests):
        # The same run lengths on both sides, so a request's mean run really is --mean-run after coalescing.
        lengths = run_lengths(rng, session.pages_per_request, args.mean_run, args.run_shape)
        peer_pages = session.peer_layout.buffers[0].num_pages
        src = place(rng, lengths, pool.num_pages).astype(np.int32)
        dst = place(rng, lengths, peer_pages).astype(np.int32)
        dev = place(rng, lengths, peer_pages).astype(np.int32) if split else None
        plan = plan_transfer(pool.layout, session.peer_layout, src, ptrs, dst, None, dev)
        before += plan.descriptors_before
        after += len(plan)
        pages = {"host_pages": dst.tolist(), "device_pages": None if dev is None else dev.tolist()}
        modes: list[tuple[str, Callable[[], object]]] = [
            ("kvwire", partial(conn.send_kvcache, session.endpoint, src, ptrs, dst, None, None, dev)),
        ]
        if args.compare_raw:
            modes.append(("raw", partial(conn.raw_write, session.endpoint, plan)))
        if args.compare_uncoalesced:
            flat = plan_transfer(pool.layout, session.peer_layout, src, ptrs, dst, None, dev, coalesce=False)
            modes.append(("uncoalesced", partial(conn.raw_write, session.endpoint, flat)))
        # Identical bytes to identical places in every mode, each between the same scramble and the same
        # verification; the order rotates per request so that drift in the machine's load falls on every
        # mode alike.
        timings: dict[str, float] = {}
        moved = 0
        expected = pool.digest(src.astype(np.int64))  # before any mode: no mode follows the sender's digest pass
        for name, call in modes[i % len(modes) :] + modes[: i % len(modes)]:
            session.decode.request({"cmd": "scramble", **pages})
            start = time.perf_counter()
            outcome = call()
            elapsed = time.perf_counter() - start
            timings[name] = elapsed
            answer = session.decode.request({"cmd": "verify", "digest": expected, **pages})
            ok = answer.get("ok") is True and answer.get("guards_ok") is True  # anything else: not verified
            if name != "kvwire":
                seconds_by_mode[name] += elapsed
                modes_verified[name] = modes_verified.get(name, True) and ok
                continue
            assert isinstance(outcome, int)
            latencies.append(elapsed)
            total += outcome
            moved = outcome
            verified = verified and answer.get("ok") is True
            guards = guards and answer.get("guards_ok") is True
        for name in paired.keys() & timings.keys():
            paired[name].append(timings[name] / timings["kvwire"])
        for name, elapsed in timings.items():  # every mode moves the same bytes as kvwire's write
            series[_MODE_LABELS[name]].append((moved, elapsed))
        progress.step("verified" if verified and guards else "MISMATCH")
    result = summary(
        args.requests,
        args.tokens,
        total,
        latencies,
        verified=verified,
        guards=guards,
        descriptors=(before, after),
    )
    result.update({f"{name}_verified": ok for name, ok in modes_verified.items()})
    if args.compare_raw:
        result["raw_gbps"] = round(total / seconds_by_mode["raw"] / 1e9, 3)
        # Paired per request (the same bytes, back to back), then the median: robust to a noisy machine.
        result["ratio"] = round(statistics.median(paired["raw"]), 3)
        # The same comparison over the whole run: kvwire's throughput over the raw call's (a slow outlier counts)
        result["ratio_of_totals"] = round(result["gbps"] / result["raw_gbps"], 3) if result["raw_gbps"] else None
    if args.compare_uncoalesced:
        result["uncoalesced_gbps"] = round(total / seconds_by_mode["uncoalesced"] / 1e9, 3)
        result["coalescing_speedup"] = round(statistics.median(paired["uncoalesced"]), 2)
    result["_series"] = series
    return result


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _print_table(r: dict[str, Any]) -> None:
    unit = "pages" if "rank_pairs" not in r else "page or head-slice descriptors (all rank pairs)"
    rows = [
        ("backend", f"{r['backend']} ({r['preset']}, pools: {r['backing']}, decode side: {r['decode']})"),
        ("requests", f"{r['requests']} x {r['tokens']} tokens"),
        ("bytes", f"{r['bytes'] / 2**30:.2f} GiB"),
        (
            "verified",
            ("target pages by digest" if r["verified"] else "MISMATCH in target pages")
            + (", guard pages unchanged" if r["guards_unchanged"] else ", GUARD PAGES CHANGED"),
        ),
        ("throughput", f"{r['gbps']:.3f} GB/s"),
        ("latency p50 / p99", f"{_ms(r['p50_ms'])} / {_ms(r['p99_ms'])} ms" + latency_note(r)),
        ("descriptors/request", f"{r['descriptors_before']} {unit} -> {r['descriptors_after']} after coalescing"),
        *inflight_rows(r),
    ]
    head, tail = tp_rows(r)
    rows[1:1] = head
    rows += tail
    if "raw_gbps" in r:
        rows.append(
            (
                "raw engine call",
                f"{r['raw_gbps']:.3f} GB/s   (kvwire/raw: {r['ratio']:.3f} median of per-request ratios, "
                f"{_ratio(r.get('ratio_of_totals'))} ratio of total throughputs)",
            )
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
