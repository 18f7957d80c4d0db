"""Benchmark: served requests through sglang's router, kvwire against stock sglang's Mooncake path, side by side.

Two prefill/decode pairs of sglang 0.5.23's own servers (``examples/pd-sglang/deploy.py``, CPU flags, the tiny
llama): one with ``SGLANG_PLUGINS=kvwire,kvwire_cpu``, one with ``kvwire_cpu`` only (sglang's own
``MooncakeKVManager``), each behind its own router. The same prompts go to both routers, alternating request by
request (kvwire, stock, then stock, kvwire, ...), one at a time, each asking for one new token, so a request's
latency is the prefill's forward, the KV transfer, and the decode's first token; prefill and decode forwards
are the same code and weights on both sides, so the difference between the two is the transfer path. The
prefill's forward-end to decode's first-token interval is not exposed by sglang's API (the router returns
the decode's response), hence this end-to-end latency. kvwire's own send time, from its counters on the
prefill's ``/metrics``, is printed beside it.

    .venv/bin/python bench/sglang_serving.py [--requests 30] [--tokens 1024] [--json]

Needs the sglang venv (``bash tests/hosts/sglang/make_venv.sh .venv-sglang``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = str(ROOT / ".venv-sglang" / "bin" / "python")


def _deploy() -> Any:
    spec = importlib.util.spec_from_file_location("pd_sglang_deploy", ROOT / "examples/pd-sglang/deploy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pd_sglang_deploy"] = module
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=30, help="timed requests per path (after 2 warm-ups)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024], help="prompt lengths")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    deploy = _deploy()
    work = Path(tempfile.mkdtemp(prefix="kvwire-bench-sglang-"))
    import subprocess

    subprocess.run([PYTHON, str(ROOT / "examples/pd-sglang/tiny_model.py"), str(work / "llama")], check=True)
    model = work / "llama"
    processes: list[Any] = []
    try:
        paths = {}
        for label, plugins in (("kvwire", deploy.KVWIRE_PLUGINS), ("stock", deploy.STOCK_PLUGINS)):
            prefill = deploy.start_server(
                model,
                "prefill",
                work,
                plugins=plugins,
                python=PYTHON,
                name=f"prefill_{label}",
                chunked_prefill_size=4096,
            )
            decode = deploy.start_server(model, "decode", work, plugins=plugins, python=PYTHON, name=f"decode_{label}")
            processes += [prefill, decode]
            paths[label] = (prefill, decode)
        for process in processes:
            process.wait_ready(900)
        routers = {}
        for label, (prefill, decode) in paths.items():
            routers[label] = deploy.start_router(prefill, decode, work, python=PYTHON, name=f"router_{label}")
            processes.append(routers[label])
            routers[label].wait_ready(300)
        rows = []
        for n in args.tokens:
            latency: dict[str, list[float]] = {"kvwire": [], "stock": []}
            before = deploy.metrics(paths["kvwire"][0].url)
            for i in range(args.requests + 2):
                ids = deploy.prompt(n, seed=100_000 + n * 1000 + i)  # a new prompt each time: no prefix-cache hit
                order = ("kvwire", "stock") if i % 2 == 0 else ("stock", "kvwire")
                for label in order:
                    started = time.perf_counter()
                    deploy.generate(routers[label].url, ids, max_new_tokens=1)
                    if i >= 2:
                        latency[label].append(time.perf_counter() - started)
            moved = deploy.metrics(paths["kvwire"][0].url)
            sends = moved["kvwire_send_seconds_count"] - before.get("kvwire_send_seconds_count", 0.0)
            send_s = (moved["kvwire_send_seconds_sum"] - before.get("kvwire_send_seconds_sum", 0.0)) / max(sends, 1)
            k, s = statistics.median(latency["kvwire"]), statistics.median(latency["stock"])
            rows.append({
                "tokens": n, "requests": args.requests, "kvwire_median_s": k, "stock_median_s": s,
                "kvwire_p90_s": statistics.quantiles(latency["kvwire"], n=10)[-1],
                "stock_p90_s": statistics.quantiles(latency["stock"], n=10)[-1],
                "ratio_kvwire_over_stock": k / s, "kvwire_mean_send_s": send_s,
            })  # fmt: skip
    finally:
        for process in reversed(processes):
            process.stop()
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"{'tokens':>6}  {'kvwire median':>13}  {'stock median':>12}  {'kvwire p90':>10}  {'stock p90':>9}  "
          f"{'kvwire/stock':>12}  {'kvwire send (mean)':>18}")  # fmt: skip
    for r in rows:
        print(f"{r['tokens']:>6}  {r['kvwire_median_s'] * 1e3:>10.1f} ms  {r['stock_median_s'] * 1e3:>9.1f} ms  "
              f"{r['kvwire_p90_s'] * 1e3:>7.1f} ms  {r['stock_p90_s'] * 1e3:>6.1f} ms  "
              f"{r['ratio_kvwire_over_stock']:>12.3f}  {r['kvwire_mean_send_s'] * 1e3:>15.2f} ms")  # fmt: skip
    print(f"\n{args.requests} requests per path and length, one new token each, alternating request by request; "
          "kvwire/stock is the ratio of the medians (end-to-end latency through each router).")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
