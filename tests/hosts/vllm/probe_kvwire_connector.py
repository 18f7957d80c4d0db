"""kvwire's own ``KvwireConnector`` in vLLM 0.33.0's classes, in one process, on CPU (prints one JSON object).

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python tests/hosts/vllm/probe_kvwire_connector.py

* factory: ``KVConnectorFactory.create_connector`` builds ``kvwire.hosts.vllm.KvwireConnector`` for the
  SCHEDULER and the WORKER role from a real ``VllmConfig`` (no model); the worker registers the tensors of
  vLLM's own ``allocate_kv_cache`` with kvwire-mooncake, and its layout is reported.
* refusals: an extra config without ``backend`` (ConfigError), a KV tensor of a shape kvwire does not move
  (LayoutError naming the layer and the shape).
* scheduler: vLLM's real v1 ``Scheduler`` (which creates the connector itself) drives a producer request to
  ``request_finished`` and a consumer request carrying the producer's params into WAITING_FOR_REMOTE_KVS;
  the metadata each ``schedule()`` builds is reported.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from kvwire.control import claim_stdout

REPLY = claim_stdout()  # vLLM logs to stdout: the reply keeps the real one
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from probe_scheduler import TINY_LLAMA, one_token  # noqa: E402
from releases import engine_request, get_kv_cache_config_from_groups  # noqa: E402
from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend  # noqa: E402
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402
from vllm.v1.worker.utils import allocate_kv_cache  # noqa: E402

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
EXTRA = {"backend": "mooncake", "side_channel_port": int(os.environ.get("PROBE_SIDE_PORT", "5790"))}


def config(kv_role: str, extra: dict[str, Any], model_dir: str | None = None) -> VllmConfig:
    models: dict[str, Any] = {}
    if model_dir is not None:
        models["model_config"] = ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="float16", max_model_len=1024
        )
    cfg = VllmConfig(
        **models,
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvwireConnector",
            kv_connector_module_path="kvwire.hosts.vllm",
            kv_role=kv_role,  # type: ignore[arg-type]
            kv_connector_extra_config=extra,
        ),
    )
    # the engine core resolves the layout once, from the backends' layouts and the connector's wish
    supported = [layout.name for layout in get_supported_kv_cache_layouts([FlashAttentionBackend])]
    resolve_kv_cache_layout(cfg, [supported])
    return cfg


def kv_cache_config(cfg: VllmConfig, block_size: int, num_blocks: int) -> Any:
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=2, head_size=64, dtype=torch.float16)
    groups = [KVCacheGroupSpec(list(LAYERS), spec)]
    kvc = get_kv_cache_config_from_groups(cfg, groups, available_memory=num_blocks * spec.page_size_bytes * 2)
    cfg.cache_config.num_gpu_blocks = kvc.num_blocks
    return kvc


def error_of(fn: Any) -> list[str]:
    try:
        fn()
    except Exception as exc:
        return [f"{type(exc).__module__}.{type(exc).__name__}", str(exc)]
    return ["no error", ""]


def factory() -> dict[str, Any]:
    cfg = config("kv_both", EXTRA)
    kvc = kv_cache_config(cfg, 32, 8)
    out: dict[str, Any] = {}
    for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
        conn = KVConnectorFactory.create_connector(cfg, role, kvc)
        cls = type(conn)
        out[role.name] = {
            "class": f"{cls.__module__}.{cls.__qualname__}",
            "is_KVConnectorBase_V1": isinstance(conn, KVConnectorBase_V1),
            "role": conn.role.name,
            "backend": conn.settings.backend,
        }
        if role is KVConnectorRole.WORKER:
            caches = allocate_kv_cache(kvc, torch.device("cpu"), cfg.cache_config.get_resolved_kv_cache_layout())
            conn.register_kv_caches(caches)
            side = conn.worker_side
            first = caches[LAYERS[0]].data_ptr()
            out["layout"] = {
                "buffers": [
                    [b.base - first, b.page_bytes, b.num_pages, b.layer, b.role, b.memory]
                    for b in side.local.layout.buffers
                ],
                "layer_names": list(side.local.layer_names),
                "backend": side.connection.name,
                "producer": side.sender is not None,
                "consumer": side.receiver is not None,
            }
            conn.shutdown()
    out["missing_backend"] = error_of(
        lambda: KVConnectorFactory.create_connector(config("kv_producer", {}), KVConnectorRole.WORKER, kvc)
    )
    worker = KVConnectorFactory.create_connector(config("kv_producer", EXTRA), KVConnectorRole.WORKER, kvc)
    odd = {LAYERS[0]: torch.zeros(2, 8, 2, 32, 128, dtype=torch.float16)}  # a leading K/V dimension
    out["bad_shape"] = error_of(lambda: worker.register_kv_caches(odd))
    return out


def request(req_id: str, n: int, params: dict[str, Any]) -> Request:
    sp = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": params})
    return engine_request(req_id, n, sp, 16)


def new_scheduler(role: str, model_dir: str) -> Scheduler:
    """vLLM's own Scheduler with the kvwire connector in ``role`` (16-token blocks, 64 of them)."""
    cfg = config(role, EXTRA, model_dir)
    return Scheduler(
        vllm_config=cfg,
        kv_cache_config=kv_cache_config(cfg, 16, 64),
        structured_output_manager=StructuredOutputManager(cfg),
        block_size=16,
        log_stats=False,
    )


def scheduler(model_dir: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    s = new_scheduler("kv_producer", model_dir)
    s.add_request(request("p0", 40, {"do_remote_decode": True}))
    sched = s.schedule()
    out["producer_first_meta"] = repr(sched.kv_connector_metadata.step)
    eco = s.update_from_output(sched, one_token(sched))
    params = next(o.kv_transfer_params for e in eco.values() for o in e.outputs)
    out["producer_params"] = params
    out["producer_status"] = str(s.requests["p0"].status)  # kept: delay_free
    out["producer_pending_push_work"] = s.connector.has_pending_push_work()
    sched = s.schedule()
    out["producer_second_meta"] = repr(sched.kv_connector_metadata.step)

    d = new_scheduler("kv_consumer", model_dir)
    d.add_request(request("filler", 20, {}))  # holds blocks: the decode's ids differ from the prefill's
    d.update_from_output(sched := d.schedule(), one_token(sched))
    d.add_request(request("d0", 40, dict(params)))
    sched = d.schedule()
    out["consumer_status"] = str(d.requests["d0"].status)
    out["consumer_meta"] = repr(sched.kv_connector_metadata.step)
    out["consumer_blocks"] = [list(b) for b in d.kv_cache_manager.get_block_ids("d0")]
    out["filler_blocks"] = [list(b) for b in d.kv_cache_manager.get_block_ids("filler")]
    wrong = dict(params, kvwire=None)
    d.add_request(request("d1", 40, wrong))  # params from another connector: computed here
    sched = d.schedule()
    out["foreign_params_status"] = str(d.requests["d1"].status)
    out["foreign_params_scheduled"] = dict(sched.num_scheduled_tokens).get("d1")
    return out


def main() -> None:
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(TINY_LLAMA))
        for name, fn in (("factory", factory), ("scheduler", lambda: scheduler(d))):
            try:
                result[name] = fn()
            except Exception as e:
                result[name] = {"error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
    REPLY.write(json.dumps(result, default=str) + "\n")
    REPLY.flush()


if __name__ == "__main__":
    main()
