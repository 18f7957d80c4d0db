"""Benchmark: one request's KV pages through sglang 0.5.23's own ``transfer_worker``, stock against kvwire.

The processes are tests/hosts/sglang's (``pair.run_pair``): sglang's prefill and
decode managers, sender, receiver and bootstrap server on 127.0.0.1, Mooncake over
TCP, CPU pools of random bytes, every request verified byte-exact on the decode.
Shape ``throughput``: MHA, 2 layers x K/V, 64 pages of 64 KiB (32 tokens x 8 heads
x 128 dims fp16) per buffer in a random order on both sides, 16 MiB a request;
``throughput-256``: the same with 256 pages, 64 MiB.

Each run of a pair makes ``repeats`` requests one after the other (the first is a
warm-up: Mooncake's handshake with the decode); each is timed on the prefill from
``sender.send()`` to ``KVPoll.Success`` (polled every millisecond), so process
start-up, bootstrap and the decode's verification are outside. The modes alternate
(stock, kvwire, then kvwire, stock, ...) for ``--rounds`` rounds, so drift in the
machine's load falls on both. Reported: the median over all timed requests of a
mode, GB/s = bytes / median seconds (1e9 bytes), and kvwire/stock both as the ratio
of the pooled medians and as the median of the per-round ratios.

Then, for comparison, ``kvwire bench --backend mooncake`` with the closest options it
has (its pages are 16 tokens: no preset has 64 KiB pages) is run once: the same
bytes per request, scattered single pages (``--mean-run 1 --run-shape fixed``).

    python bench/sglang_throughput.py [--rounds 3] [--scenario throughput] [--json]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KVWIRE = ROOT / ".venv" / "bin" / "kvwire"


def load_pair() -> ModuleType:
    """tests/hosts/sglang/pair.py as a module (it needs only the standard library here)."""
    spec = importlib.util.spec_from_file_location("sglang_pair", ROOT / "tests" / "hosts" / "sglang" / "pair.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_pair"] = module
    spec.loader.exec_module(module)
    return module


def request_bytes(scenario: Any) -> int:
    """Bytes one request moves: pages x page bytes x KV buffers (one TP rank on each side)."""
    return int(len(scenario.src_pages) * scenario.page_bytes("prefill") * scenario.num_buffers)


def timed(result: dict[str, Any]) -> tuple[float, list[float]]:
    """(warm-up seconds, timed seconds) of one pair run's requests, from the prefill's result."""
    seconds = [float(r["seconds"]) for r in result["prefill"]["requests"]]
    return seconds[0], seconds[1:]


def kvwire_bench_command(scenario: Any, requests: int) -> list[str]:
    """``kvwire bench`` with the closest shape: llama3-8b (8 KV heads x 128 dims fp16, 16-token pages of 32 KiB).

    Tokens chosen for the same bytes per request (its 32 layers x K/V = 64 buffers);
    runs of exactly one page, as scattered as our pages.
    """
    page = 16 * 8 * 128 * 2
    tokens = request_bytes(scenario) // (64 * page) * 16
    return [
        *("kvwire", "bench", "--backend", "mooncake", "--preset", "llama3-8b", "--tokens", str(tokens)),
        *("--mean-run", "1", "--run-shape", "fixed", "--requests", str(requests)),
    ]


def run_kvwire_bench(scenario: Any, requests: int) -> dict[str, Any]:
    """Run :func:`kvwire_bench_command` once (with ``--json``): its result, and the command as shown."""
    cmd = kvwire_bench_command(scenario, requests)
    argv = [str(KVWIRE), *cmd[1:], "--json"]
    proc = subprocess.run(argv, check=False, capture_output=True, text=True, timeout=600, cwd=ROOT)
    shown = " ".join(cmd)
    if proc.returncode != 0:
        return {"command": shown, "error": proc.stderr.strip()[-2000:] or f"exit status {proc.returncode}"}
    return {"command": shown, **json.loads(proc.stdout)}


def measure(pair: ModuleType, name: str, rounds: int, timeout_s: float) -> dict[str, Any]:
    """Alternating rounds of stock and kvwire pairs; every request of every run verified, or the run is dropped."""
    runs: dict[str, list[dict[str, Any]]] = {"stock": [], "kvwire": []}
    for rnd in range(rounds):
        order = ("stock", "kvwire") if rnd % 2 == 0 else ("kvwire", "stock")
        for mode in order:
            r = pair.run_pair(name, mode, timeout_s=timeout_s)
            entry: dict[str, Any] = {"round": rnd, "outcome": r["outcome"], "wall_s": r["wall_s"]}
            if r["outcome"] == "verified":
                entry["warmup_s"], entry["seconds"] = timed(r)
            runs[mode].append(entry)
            print(f"  round {rnd} {mode:6} {r['wall_s']:5.1f}s  {r['outcome'][:160]}", file=sys.stderr, flush=True)
    scenario = pair._SIDE.SCENARIOS[name]
    nbytes = request_bytes(scenario)
    summary: dict[str, Any] = {"scenario": name, "bytes_per_request": nbytes, "modes": {}}
    for mode, entries in runs.items():
        ok = [e for e in entries if "seconds" in e]
        seconds = [s for e in ok for s in e["seconds"]]
        if not seconds:
            summary["modes"][mode] = {"runs": entries, "error": "no verified run"}
            continue
        med = statistics.median(seconds)
        q = statistics.quantiles(seconds, n=10) if len(seconds) >= 2 else [med] * 9
        summary["modes"][mode] = {
            "requests_timed": len(seconds),
            "median_s": round(med, 5),
            "p10_s": round(q[0], 5),
            "p90_s": round(q[-1], 5),
            "gbps": round(nbytes / med / 1e9, 3),
            "warmup_median_s": round(statistics.median(e["warmup_s"] for e in ok), 5),
            "runs": entries,
        }
    modes = summary["modes"]
    if "median_s" in modes["stock"] and "median_s" in modes["kvwire"]:
        summary["kvwire_over_stock_time"] = round(modes["kvwire"]["median_s"] / modes["stock"]["median_s"], 3)
        per_round = []
        for rnd in range(rounds):
            k = [e for e in runs["kvwire"] if e["round"] == rnd and "seconds" in e]
            s = [e for e in runs["stock"] if e["round"] == rnd and "seconds" in e]
            if k and s:
                per_round.append(statistics.median(k[0]["seconds"]) / statistics.median(s[0]["seconds"]))
        summary["kvwire_over_stock_time_per_round"] = [round(x, 3) for x in per_round]
        if per_round:
            summary["kvwire_over_stock_time_median_of_rounds"] = round(statistics.median(per_round), 3)
    return summary


def print_table(summary: dict[str, Any]) -> None:
    mib = summary["bytes_per_request"] / 2**20
    print(f"\n{summary['scenario']}: {mib:.1f} MiB per request through sglang's transfer_worker (TCP, 127.0.0.1)")
    print(f"{'mode':8} {'requests':>8} {'median s':>9} {'p10..p90 s':>17} {'GB/s':>7} {'warm-up s':>10}")
    for mode, m in summary["modes"].items():
        if "error" in m:
            print(f"{mode:8} {m['error']}")
            continue
        spread = f"{m['p10_s']:.4f}..{m['p90_s']:.4f}"
        print(
            f"{mode:8} {m['requests_timed']:>8} {m['median_s']:>9.4f} {spread:>17} {m['gbps']:>7.3f} "
            f"{m['warmup_median_s']:>10.4f}"
        )
    if "kvwire_over_stock_time" in summary:
        t, rounds = summary["kvwire_over_stock_time"], summary["kvwire_over_stock_time_per_round"]
        print(
            f"kvwire/stock: time x{t:.3f} (GB/s x{1 / t:.3f}); per round {rounds}, "
            f"median x{summary['kvwire_over_stock_time_median_of_rounds']:.3f}"
        )
    kb = summary.get("kvwire_bench")
    if kb:
        print(f"closest kvwire bench: {kb['command']}")
        if "error" in kb:
            print(f"  failed: {kb['error']}")
        else:
            print(
                f"  {kb['bytes'] / kb['requests'] / 2**20:.1f} MiB per request as {kb['descriptors_after']} "
                f"descriptors of 32 KiB: {kb['gbps']:.3f} GB/s, p50 {kb['p50_ms']:.1f} ms "
                f"(verified {kb['verified']}, guards {kb['guards_unchanged']})"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="rounds of one stock and one kvwire run (default 3)")
    p.add_argument("--scenario", action="append", help="throughput (default) and/or throughput-256")
    p.add_argument("--timeout-s", type=float, default=180)
    p.add_argument("--kvwire-bench-requests", type=int, default=16, help="0: do not run kvwire bench")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    pair = load_pair()
    summaries = []
    for name in a.scenario or ["throughput"]:
        if name not in pair.SCENARIOS or not pair._SIDE.SCENARIOS[name].bench:
            p.error(f"--scenario {name}: not a throughput shape")
        print(f"{name}:", file=sys.stderr, flush=True)
        summary = measure(pair, name, a.rounds, a.timeout_s)
        if a.kvwire_bench_requests:
            summary["kvwire_bench"] = run_kvwire_bench(pair._SIDE.SCENARIOS[name], a.kvwire_bench_requests)
        summaries.append(summary)
        if not a.json:
            print_table(summary)
    if a.json:
        print(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
