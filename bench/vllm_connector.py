"""vLLM prefill ``request_finished`` -> decode ``finished_recving``: kvwire's connector vs vLLM's own NixlConnector.

    .venv/bin/python bench/vllm_connector.py [--requests 8] [--tokens 1024] [--layers 8] [--heads 8]

Needs the cached ``.venv-vllm`` (``tests/hosts/vllm/make_venv.sh``). For each connector in turn it starts a
prefill and a decode vLLM node (``tests/hosts/vllm/pd_node.py``: vLLM 0.33.0's real Scheduler, the connector
created through vLLM's factory, the KV cache from vLLM's ``allocate_kv_cache``, the worker hooks through
vLLM's model-runner mixin; no model: the prefill's "forward" writes random bytes into its blocks), runs
``--warmup`` requests, then ``--requests`` timed ones of ``--tokens`` prompt tokens, and verifies every block
on the decode (sha256 per block and layer). The time of a request is from the prefill's ``request_finished``
(its engine output with the decode's ``kv_transfer_params``) to the decode's ``finished_recving``, both
read from ``time.monotonic()`` (one clock for all processes on Linux); it includes what a proxy does in
between (here: this script relaying the params) and the decode scheduling the request, the same for every
connector. Both engine loops poll every 0.2 ms.

Connectors: ``kvwire-nixl``, ``kvwire-nixl-1stream`` (kvwire-nixl's option ``streams = 1``: one posting
thread instead of two, which suits a 2-core host running two engines) and ``kvwire-mooncake``
(``kvwire.compat.vllm.KvwireConnector``; the prefill writes), and ``vllm-nixl`` (vLLM's ``NixlConnector``; the
decode reads), on the same config and blocks.
The nodes run one pair at a time (this machine may have only 2 cores).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "hosts" / "vllm"))

from pd_pair import NodeProcess, node_env  # noqa: E402

CONNECTORS: dict[str, dict[str, Any]] = {
    "kvwire-nixl": {"connector": "KvwireConnector", "module": "kvwire.compat.vllm", "backend": "nixl"},
    "kvwire-nixl-1stream": {
        "connector": "KvwireConnector",
        "module": "kvwire.compat.vllm",
        "backend": "nixl",
        "options": {"streams": 1},
    },
    "kvwire-mooncake": {"connector": "KvwireConnector", "module": "kvwire.compat.vllm", "backend": "mooncake"},
    "vllm-nixl": {"connector": "NixlConnector", "module": None, "backend": None},
}
BASELINE = "vllm-nixl"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_one(name: str, args: argparse.Namespace, python: Path) -> dict[str, Any]:
    """Start one prefill/decode pair for ``name``, time its requests, verify every block, stop the pair."""
    spec = CONNECTORS[name]
    shape = {"layers": args.layers, "heads": args.heads, "head_size": args.head_size, "num_blocks": args.blocks}
    extra = {} if spec["backend"] is None else {"backend": spec["backend"], "side_channel_port": _port()}
    options = {**spec.get("options", {}), **(args.options.get(spec["backend"]) or {})}
    if spec["backend"] is not None and options:
        extra["backend_options"] = options
    envs = [{**node_env(), "VLLM_NIXL_SIDE_CHANNEL_PORT": str(_port())} for _ in range(2)]
    prefill = NodeProcess(python, f"{name} prefill", env=envs[0])
    decode = NodeProcess(python, f"{name} decode", env=envs[1])
    times: list[float] = []
    verified = True
    try:
        common = {"connector": spec["connector"], "module": spec["module"], "extra": extra, **shape}
        prefill.call("start", role="prefill", **common)
        decode.call("start", role="decode", filler_tokens=args.tokens // 2, **common)
        for i in range(args.warmup + args.requests):
            sent = prefill.call("prefill", req_id=f"p{i}", n_tokens=args.tokens, seed=100 + i)
            got = decode.call(
                "decode",
                req_id=f"d{i}",
                n_tokens=args.tokens,
                params=sent["params"],
                timeout_s=120,
                check_untouched=False,
            )
            ok = got["finished_recving"] and not got["invalid_block_ids"] and got["digests"] == sent["digests"]
            verified = verified and bool(ok)
            if i >= args.warmup and got["t_finished_recving"] is not None:
                times.append((got["t_finished_recving"] - sent["t_finished"]) * 1e3)
            prefill.call("step_until_sent", req_id=f"p{i}", timeout_s=120)
        blocks = len(sent["block_ids"])
    finally:
        prefill.close()
        decode.close()
    block_bytes = args.heads * 32 * 2 * args.head_size * 2
    return {
        "name": name,
        "times_ms": times,
        "verified": verified,
        "mib": blocks * block_bytes * args.layers / 2**20,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=1024, help="prompt tokens per request (blocks of 32)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8, help="KV heads")
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=160, help="KV-cache blocks per node")
    parser.add_argument("--connectors", default=",".join(CONNECTORS), help="comma-separated subset of the three")
    parser.add_argument(
        "--options", type=json.loads, default={}, help='backend options per backend, JSON: {"nixl": {"streams": 1}}'
    )
    parser.add_argument("--python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.connectors.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONNECTORS]
    if unknown:
        parser.error(f"unknown connectors {unknown}; choose from {list(CONNECTORS)}")
    if not args.python.exists():
        parser.error(f"{args.python} is missing: build it with tests/hosts/vllm/make_venv.sh")
    results = []
    for name in names:
        print(f"running {name} ...", file=sys.stderr, flush=True)
        results.append(run_one(name, args, args.python))
    base = next((r for r in results if r["name"] == BASELINE and r["times_ms"]), None)
    base_median = statistics.median(base["times_ms"]) if base else None
    print(
        f"\nvLLM 0.33.0 on CPU, {args.tokens} tokens/request ({results[0]['mib']:.1f} MiB of KV: {args.layers} layers, "
        f"{args.heads} KV heads x {args.head_size}, fp16, blocks of 32), {args.requests} requests after "
        f"{args.warmup} warm-up\nprefill request_finished -> decode finished_recving, ms\n"
    )
    print(f"{'connector':<22}{'median':>9}{'min':>9}{'max':>9}{'verified':>10}{'vs vllm-nixl':>14}")
    for r in results:
        t = r["times_ms"]
        med = statistics.median(t) if t else float("nan")
        ratio = f"{med / base_median:.2f}x" if base_median else "-"
        print(
            f"{r['name']:<22}{med:>9.2f}{min(t, default=float('nan')):>9.2f}{max(t, default=float('nan')):>9.2f}"
            f"{'yes' if r['verified'] else 'NO':>10}{ratio:>14}"
        )
    return 0 if all(r["verified"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
