"""vLLM prefill ``request_finished`` -> decode ``finished_recving``: kvwire's connector vs vLLM's own NixlConnector.

    .venv/bin/python bench/vllm_connector.py [--tokens 1024,8192] [--requests 30] [--layers 8] [--heads 8]

Needs the cached ``.venv-vllm`` (``tests/hosts/vllm/make_venv.sh``). For each prompt size it starts a prefill and
a decode vLLM node per connector (``tests/hosts/vllm/pd_node.py``: vLLM 0.33.0's real Scheduler, the connector
created through vLLM's factory, the KV cache from vLLM's ``allocate_kv_cache``, the worker hooks through vLLM's
model-runner mixin; no model: the prefill's "forward" writes seeded random bytes into its blocks), all pairs
alive at once, then runs the requests **alternately**: round ``i`` sends request ``i`` (same prompt, same seed,
so the same bytes) through every connector, one after the other, the order rotated each round so no
connector always goes first. Each pair's Scheduler sees the same request sequence, so request ``i`` lands in
the same block ids on every pair (checked: the ``same blocks`` column). Only one pair runs at a time: the others
are stopped (SIGSTOP, then SIGCONT and 50 ms before their turn), since an idle vLLM ``NixlConnector`` node spins
a core (NIXL's progress thread) and would take it from the pair measured. ``--warmup`` rounds first, then
``--requests`` timed rounds.
Every block is verified on the decode (sha256 per block and layer).

The time of a request is from the prefill's ``request_finished`` (its engine output with the decode's
``kv_transfer_params``) to the decode's ``finished_recving``, both read from ``time.monotonic()`` (one clock for
all processes on Linux); it includes what a proxy does in between (here: this script relaying the params) and
the decode scheduling the request, the same for every connector. Both engine loops poll every 0.2 ms.

The table gives, per connector, the median and the spread (p10, p90, min, max) over the timed requests, and two
ratios against vLLM's ``NixlConnector``: median over median, and the median of the per-round ratios (each round
pairs a request with vLLM's on the same blocks, moments apart).

Connectors: ``kvwire-nixl`` (``kvwire.hosts.vllm.KvwireConnector`` over kvwire-nixl; the prefill writes),
``kvwire-nixl-1stream`` (kvwire-nixl's option ``streams = 1``), ``kvwire-mooncake``, and ``vllm-nixl``
(vLLM's ``NixlConnector``; the decode reads), on the same config and blocks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: kvwire's sources beside this script, first on every process's path: the nodes run this tree's kvwire even where
#: the venvs' editable installs point at another checkout (a clean export of a commit, say)
SOURCES = [ROOT / "core" / "src", ROOT / "plugins" / "nixl" / "src", ROOT / "plugins" / "mooncake" / "src"]
sys.path[:0] = [str(ROOT / "tests" / "hosts" / "vllm"), str(SOURCES[0])]

from pd_pair import NodeProcess, node_env  # noqa: E402

CONNECTORS: dict[str, dict[str, Any]] = {
    "kvwire-nixl": {"connector": "KvwireConnector", "module": "kvwire.hosts.vllm", "backend": "nixl"},
    "kvwire-nixl-1stream": {
        "connector": "KvwireConnector",
        "module": "kvwire.hosts.vllm",
        "backend": "nixl",
        "options": {"streams": 1},
    },
    "kvwire-mooncake": {"connector": "KvwireConnector", "module": "kvwire.hosts.vllm", "backend": "mooncake"},
    "vllm-nixl": {"connector": "NixlConnector", "module": None, "backend": None},
}
BASELINE = "vllm-nixl"
DEFAULT_CONNECTORS = "kvwire-nixl,vllm-nixl"
BLOCK_TOKENS = 32  # pd_node's block size
SETTLE_S = 0.05  # after a paused pair resumes, before its request


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def blocks_for(tokens: int) -> int:
    """KV-cache blocks per node for prompts of ``tokens``: two and a half prompts and 16 spare.

    The decode holds request ``i`` while request ``i + 1`` is allocated (it finishes in that step), so two prompts
    must fit at once, or the next one waits for blocks after its first step.
    """
    per_prompt = -(-tokens // BLOCK_TOKENS)
    return 2 * per_prompt + per_prompt // 2 + 16


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between the closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(times: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(times) if times else math.nan,
        "p10": percentile(times, 0.10),
        "p90": percentile(times, 0.90),
        "min": min(times, default=math.nan),
        "max": max(times, default=math.nan),
    }


class Pair:
    """One connector's prefill and decode node."""

    def __init__(self, name: str, args: argparse.Namespace, tokens: int) -> None:
        self.name = name
        spec = CONNECTORS[name]
        self.blocks = args.blocks or blocks_for(tokens)
        shape = {"layers": args.layers, "heads": args.heads, "head_size": args.head_size, "num_blocks": self.blocks}
        extra: dict[str, Any] = (
            {} if spec["backend"] is None else {"backend": spec["backend"], "side_channel_port": _port()}
        )
        options = {**spec.get("options", {}), **(args.options.get(spec["backend"]) or {})}
        if spec["backend"] is not None and options:
            extra["backend_options"] = options
        path = os.pathsep.join(str(p) for p in SOURCES)
        envs = [{**node_env(), "PYTHONPATH": path, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_port())} for _ in range(2)]
        self.prefill = NodeProcess(args.python, f"{name} prefill", env=envs[0])
        self.decode = NodeProcess(args.python, f"{name} decode", env=envs[1])
        common = {"connector": spec["connector"], "module": spec["module"], "extra": extra, **shape}
        self.prefill.call("start", role="prefill", **common)
        # no filler request on the decode: a running filler grows a block every 32 engine steps, so the decode's
        # block ids would depend on how many steps each connector's transfer took
        self.decode.call("start", role="decode", **common)

    def request(self, i: int, tokens: int) -> dict[str, Any]:
        """Request ``i`` through this pair: its time in ms, whether every block arrived intact, its block ids."""
        sent = self.prefill.call("prefill", req_id=f"p{i}", n_tokens=tokens, seed=100 + i)
        got = self.decode.call(
            "decode", req_id=f"d{i}", n_tokens=tokens, params=sent["params"], timeout_s=120, check_untouched=False
        )
        ok = got["finished_recving"] and not got["invalid_block_ids"] and got["digests"] == sent["digests"]
        done = self.prefill.call("step_until_sent", req_id=f"p{i}", timeout_s=120)
        if not ok:
            why = [*got.get("failures", {}).values(), *done.get("failures", [])[-1:]]
            print(f"{self.name}: request {i} not verified: {why or got['invalid_block_ids'][:4]}", file=sys.stderr)
        t = got["t_finished_recving"]
        return {
            "ms": None if t is None else (t - sent["t_finished"]) * 1e3,
            "verified": bool(ok),
            "blocks": (list(sent["block_ids"]), list(got["block_ids"])),
        }

    def pause(self) -> None:
        """SIGSTOP both nodes: an idle vLLM NixlConnector node spins a core (NIXL's progress thread)."""
        for node in (self.prefill, self.decode):
            os.kill(node.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        for node in (self.prefill, self.decode):
            os.kill(node.proc.pid, signal.SIGCONT)
        time.sleep(SETTLE_S)

    def close(self) -> None:
        self.resume()
        self.prefill.close()
        self.decode.close()


def run_size(names: list[str], args: argparse.Namespace, tokens: int) -> dict[str, Any]:
    """All pairs up at once, then ``warmup + requests`` rounds of one request through each, alternating."""
    pairs: list[Pair] = []
    times: dict[str, list[float]] = {n: [] for n in names}
    verified = dict.fromkeys(names, True)
    same_blocks = True
    paired: dict[str, list[float]] = {n: [] for n in names}
    n_blocks = 0
    try:
        for name in names:
            print(f"{tokens} tokens: starting {name} ...", file=sys.stderr, flush=True)
            pairs.append(Pair(name, args, tokens))
            pairs[-1].pause()
        for i in range(args.warmup + args.requests):
            order = pairs[i % len(pairs) :] + pairs[: i % len(pairs)]
            round_: dict[str, dict[str, Any]] = {}
            for pair in order:
                pair.resume()
                try:
                    round_[pair.name] = pair.request(i, tokens)
                finally:
                    pair.pause()
            same_blocks = same_blocks and len({json.dumps(r["blocks"]) for r in round_.values()}) == 1
            n_blocks = len(next(iter(round_.values()))["blocks"][0])
            for name, r in round_.items():
                verified[name] = verified[name] and r["verified"]
                if i >= args.warmup and r["ms"] is not None:
                    times[name].append(r["ms"])
            base = round_.get(BASELINE)
            if i >= args.warmup and base is not None and base["ms"]:
                for name, r in round_.items():
                    if r["ms"] is not None:
                        paired[name].append(r["ms"] / base["ms"])
    finally:
        for pair in pairs:
            pair.close()
    block_bytes = args.heads * BLOCK_TOKENS * 2 * args.head_size * 2
    base_median = statistics.median(times[BASELINE]) if times.get(BASELINE) else None
    rows = []
    for name in names:
        row: dict[str, Any] = {
            "name": name,
            "n": len(times[name]),
            "verified": verified[name],
            **summarize(times[name]),
        }
        row["ratio_of_medians"] = row["median"] / base_median if base_median else None
        row["median_paired_ratio"] = statistics.median(paired[name]) if paired[name] else None
        row["times_ms"] = times[name]
        rows.append(row)
    return {
        "tokens": tokens,
        "blocks_per_request": n_blocks,
        "mib": n_blocks * block_bytes * args.layers / 2**20,
        "same_blocks": same_blocks,
        "rows": rows,
    }


def table(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    def num(x: float | None, fmt: str = ".2f") -> str:
        return "-" if x is None or math.isnan(x) else format(x, fmt)

    lines = [
        f"vLLM 0.33.0 on CPU: {args.layers} layers, {args.heads} KV heads x {args.head_size}, fp16, blocks of "
        f"{BLOCK_TOKENS} tokens; {args.requests} requests per connector after {args.warmup} warm-up, alternating "
        "request by request on the same blocks",
        f"prefill request_finished -> decode finished_recving, ms; ratios against {BASELINE}",
        "",
        f"{'tokens':>7} {'MiB':>6}  {'connector':<20}{'median':>8}{'p10':>8}{'p90':>8}{'min':>8}{'max':>8}"
        f"{'n':>4}{'verified':>9}{'same blocks':>12}{'median ratio':>13}{'paired ratio':>13}",
    ]
    for res in results:
        for row in res["rows"]:
            lines.append(
                f"{res['tokens']:>7} {res['mib']:>6.1f}  {row['name']:<20}{num(row['median']):>8}{num(row['p10']):>8}"
                f"{num(row['p90']):>8}{num(row['min']):>8}{num(row['max']):>8}{row['n']:>4}"
                f"{'yes' if row['verified'] else 'NO':>9}{'yes' if res['same_blocks'] else 'NO':>12}"
                f"{num(row['ratio_of_medians']) + 'x':>13}{num(row['median_paired_ratio']) + 'x':>13}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=30, help="timed requests per connector and size")
    parser.add_argument("--warmup", type=int, default=3, help="untimed rounds first")
    parser.add_argument(
        "--tokens", default="1024,8192", help="prompt tokens per request, comma-separated sizes (blocks of 32)"
    )
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=0, help="KV-cache blocks per node (default: from --tokens)")
    parser.add_argument("--connectors", default=DEFAULT_CONNECTORS, help=f"comma-separated, of {list(CONNECTORS)}")
    parser.add_argument(
        "--options", type=json.loads, default={}, help='backend options per backend, JSON: {"nixl": {"streams": 1}}'
    )
    parser.add_argument("--json", action="store_true", help="print the results (every time too) as JSON")
    parser.add_argument("--python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.connectors.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONNECTORS]
    if unknown or not names:
        parser.error(f"unknown connectors {unknown}; choose from {list(CONNECTORS)}")
    try:
        sizes = [int(t) for t in args.tokens.split(",") if t.strip()]
    except ValueError:
        parser.error(f"--tokens: comma-separated integers, not {args.tokens!r}")
    if not sizes or min(sizes) < BLOCK_TOKENS:
        parser.error(f"--tokens: each size at least {BLOCK_TOKENS}")
    if args.requests < 1 or args.warmup < 0:
        parser.error("--requests at least 1, --warmup at least 0")
    if not args.python.exists():
        parser.error(f"{args.python} is missing: build it with tests/hosts/vllm/make_venv.sh")
    results = [run_size(names, args, tokens) for tokens in sizes]
    if args.json:
        print(json.dumps({"results": results}, indent=1))
    else:
        print("\n" + table(results, args))
    ok = all(r["verified"] for res in results for r in res["rows"]) and all(res["same_blocks"] for res in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
