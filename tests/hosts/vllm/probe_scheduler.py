"""vLLM 0.33.0's real v1 Scheduler on CPU, without model weights: which connector hooks it calls, in what order.

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python tests/hosts/vllm/probe_scheduler.py

The Scheduler reads ``vllm_config.model_config`` (``uses_mrope``, max_model_len, ...), so a ``ModelConfig`` is
needed: it is built from a tiny Llama ``config.json`` written to a temporary directory (no weights, no
tokenizer: ``skip_tokenizer_init=True``; nothing is downloaded). ``num_blocks`` comes from a hand-made
``KVCacheConfig``. The connector is ``stub_connector.KvwireConnector``, created by the Scheduler itself through
``KVConnectorFactory``. No worker runs: the probe plays the model runner by handing ``update_from_output`` a
``ModelRunnerOutput`` (one sampled token, and ``KVConnectorOutput.finished_recving`` for the consumer case).

Two scenarios, each printed as the connector's call log plus the request states:
  producer: kv_transfer_params={"do_remote_decode": True}, max_tokens=1: schedule, one token, finish.
  consumer: kv_transfer_params={"do_remote_prefill": True, ...}, the stub claims 32 external tokens (async):
            schedule (-> WAITING_FOR_REMOTE_KVS), report finished_recving, schedule again.
Prints one JSON object (last line of stdout).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # stub_connector

import torch
from releases import engine_request, get_kv_cache_config_from_groups
from stub_connector import KvwireConnector
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
NUM_BLOCKS = 64


def build(model_dir: str, kv_role: str) -> Scheduler:
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=1024)
    config = VllmConfig(
        model_config=model_config,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvwireConnector",
            kv_connector_module_path="stub_connector",
            kv_role=kv_role,  # type: ignore[arg-type]
        ),
    )
    config.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves for CPU_ATTN
    block_size = config.cache_config.block_size
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float16)
    kvc = get_kv_cache_config_from_groups(
        config, [KVCacheGroupSpec(list(LAYERS), spec)], available_memory=NUM_BLOCKS * spec.page_size_bytes * 2
    )
    config.cache_config.num_gpu_blocks = kvc.num_blocks
    return Scheduler(
        vllm_config=config,
        kv_cache_config=kvc,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        log_stats=False,
    )


def request(req_id: str, n_prompt: int, params: dict[str, Any]) -> Request:
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return engine_request(req_id, n_prompt, sp, 16)


def one_token(sched_out: Any, kv_out: KVConnectorOutput | None = None) -> ModelRunnerOutput:
    ids = [r.req_id for r in sched_out.scheduled_new_reqs] + list(sched_out.scheduled_cached_reqs.req_ids)
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[7] for _ in ids],
        kv_connector_output=kv_out,
    )


def summary(sched_out: Any) -> dict[str, Any]:
    return {
        "new": [
            [r.req_id, [list(b) for b in r.block_ids], r.num_computed_tokens] for r in sched_out.scheduled_new_reqs
        ],
        "cached": list(sched_out.scheduled_cached_reqs.req_ids),
        "num_scheduled_tokens": dict(sched_out.num_scheduled_tokens),
        "kv_connector_metadata": type(sched_out.kv_connector_metadata).__name__,
        "finished_req_ids": sorted(sched_out.finished_req_ids),
    }


def outputs_params(eco: dict) -> list:
    return [
        [o.request_id, o.finish_reason and str(o.finish_reason), o.kv_transfer_params]
        for e in eco.values()
        for o in e.outputs
    ]


def producer(model_dir: str) -> dict[str, Any]:
    KvwireConnector.calls.clear()
    s = build(model_dir, "kv_producer")
    steps: list[Any] = [{"connector_class": type(s.connector).__module__ + "." + type(s.connector).__name__}]
    s.add_request(request("p0", 40, {"do_remote_decode": True}))
    out = s.schedule()
    steps.append({"schedule_1": summary(out)})
    eco = s.update_from_output(out, one_token(out))
    steps.append(
        {"update_from_output_1": outputs_params(eco), "status": str(s.requests.get("p0") and s.requests["p0"].status)}
    )
    out = s.schedule()
    steps.append({"schedule_2": summary(out)})
    return {"steps": steps, "calls": [list(c) for c in KvwireConnector.calls]}


def consumer(model_dir: str) -> dict[str, Any]:
    KvwireConnector.calls.clear()
    KvwireConnector.remote_tokens = 32
    s = build(model_dir, "kv_consumer")
    params = {"do_remote_prefill": True, "remote_engine_id": "prefill-0", "remote_block_ids": [1, 2]}
    s.add_request(request("d0", 40, params))
    steps: list[Any] = []
    out = s.schedule()
    steps.append({"schedule_1": summary(out), "status": str(s.requests["d0"].status)})
    eco = s.update_from_output(out, one_token(out, KVConnectorOutput(finished_recving={"d0"})))
    steps.append(
        {"update_from_output_1(finished_recving=d0)": outputs_params(eco), "status": str(s.requests["d0"].status)}
    )
    out = s.schedule()
    steps.append({"schedule_2": summary(out), "status": str(s.requests["d0"].status)})
    eco = s.update_from_output(out, one_token(out))
    steps.append({"update_from_output_2": outputs_params(eco)})
    return {"steps": steps, "calls": [list(c) for c in KvwireConnector.calls]}


def main() -> None:
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(TINY_LLAMA))
        result: dict[str, Any] = {}
        for name, fn in (("producer", producer), ("consumer", consumer)):
            try:
                result[name] = fn(d)
            except Exception as e:
                import traceback

                result[name] = {
                    "error": f"{type(e).__name__}: {e}",
                    "trace": traceback.format_exc()[-3000:],
                    "calls": [list(c) for c in KvwireConnector.calls],
                }
    print(json.dumps(result, default=str))


if __name__ == "__main__":
    main()
