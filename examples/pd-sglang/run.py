"""kvwire serving one request through sglang: a prefill and a decode server behind sglang's router, one machine.

Makes a tiny model, starts ``python -m sglang.launch_server`` twice (``--disaggregation-mode prefill`` and
``decode``, both with ``SGLANG_PLUGINS=kvwire,kvwire_cpu``) and ``sglang_router.launch_router
--pd-disaggregation``, sends one greedy request through the router, and prints the tokens and kvwire's
counters read from the prefill's own ``/metrics`` (requests, bytes, descriptors). With ``--compare`` it also
starts one plain server and checks that the decode's tokens equal it. Run it in a Python environment that has
sglang, sglang-router, kvwire, kvwire-mooncake and kvwire-sglang (see README.md next to this file)::

    python examples/pd-sglang/run.py --compare
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

import deploy
from tiny_model import make_model


def run(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(args.work or tempfile.mkdtemp(prefix="kvwire-pd-sglang-"))
    work.mkdir(parents=True, exist_ok=True)
    model = make_model(work / "model", args.arch)
    started = time.monotonic()
    prefill = deploy.start_server(model, "prefill", work, chunked_prefill_size=args.chunked_prefill_size)
    decode = deploy.start_server(model, "decode", work)
    single = deploy.start_server(model, "single", work, plugins=deploy.STOCK_PLUGINS) if args.compare else None
    processes = [p for p in (prefill, decode, single) if p is not None]
    try:
        for process in processes:
            process.wait_ready()
        router = deploy.start_router(prefill, decode, work)
        processes.append(router)
        router.wait_ready(120)
        print(f"prefill {prefill.url}, decode {decode.url}, router {router.url}: ready in "
              f"{time.monotonic() - started:.0f}s (logs in {work})", file=sys.stderr)  # fmt: skip
        before = deploy.metrics(prefill.url)
        ids = deploy.prompt(args.tokens)
        tokens = deploy.output_ids(deploy.generate(router.url, ids, max_new_tokens=args.max_new_tokens))
        after = deploy.metrics(prefill.url)
        counters = {
            name: after.get(name, 0.0) - before.get(name, 0.0)
            for name in (
                "kvwire_send_requests_total",
                "kvwire_send_bytes_total",
                "kvwire_send_descriptors_total",
                "kvwire_send_descriptors_before_coalescing_total",
            )
        }
        result: dict[str, Any] = {"prompt_tokens": len(ids), "output_ids": tokens, "kvwire": counters}
        if single is not None:
            expected = deploy.output_ids(deploy.generate(single.url, ids, max_new_tokens=args.max_new_tokens))
            result["single_server_output_ids"] = expected
            result["tokens_equal"] = tokens == expected
        return result
    finally:
        for process in reversed(processes):
            process.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=["llama", "mla"], default="llama", help="the tiny model's kind of KV")
    parser.add_argument("--tokens", type=int, default=100, help="prompt length in tokens")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--chunked-prefill-size", type=int, default=64)
    parser.add_argument("--compare", action="store_true", help="also run one plain server and compare tokens")
    parser.add_argument("--work", help="directory for the model and the logs (default: a new temporary one)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"prompt of {result['prompt_tokens']} tokens -> decode generated {result['output_ids']}")
        if "tokens_equal" in result:
            print(f"one plain server generated       {result['single_server_output_ids']}: "
                  f"{'equal' if result['tokens_equal'] else 'DIFFERENT'}")  # fmt: skip
        k = result["kvwire"]
        print(f"kvwire in the prefill: {k['kvwire_send_requests_total']:.0f} sends, "
              f"{k['kvwire_send_bytes_total']:.0f} bytes, {k['kvwire_send_descriptors_total']:.0f} descriptors "
              f"({k['kvwire_send_descriptors_before_coalescing_total']:.0f} page x buffer pairs before "
              "coalescing)")  # fmt: skip
    return 0 if result.get("tokens_equal", True) and result["kvwire"]["kvwire_send_requests_total"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
