"""vLLM 0.33.0's own KVConnectorFactory loads an out-of-tree connector class, for both roles, on CPU, without a model.

    VLLM_TARGET_DEVICE=cpu .venv-vllm/bin/python tests/hosts/vllm/probe_factory.py

Prints one JSON object (last line of stdout). For each kv_role it builds
``VllmConfig(device_config=DeviceConfig("cpu"), kv_transfer_config=KVTransferConfig(...))`` (no model_config),
a ``KVCacheConfig`` with vLLM's own planner (``get_kv_cache_config_from_groups``) for 2 full-attention layers,
creates the connector through ``KVConnectorFactory.create_connector`` for SCHEDULER and WORKER, and hands the
worker the tensors vLLM's own ``allocate_kv_cache`` makes (what the CPU model runner passes to
``register_kv_caches``), reporting their shapes, strides and addresses.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
sys.path.insert(0, str(Path(__file__).parent))  # stub_connector

import torch
from releases import get_kv_cache_config_from_groups
from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.worker.utils import allocate_kv_cache

MODULE = "stub_connector"
CLASS = "KvwireConnector"
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE, DTYPE, NUM_BLOCKS = 32, 2, 64, torch.float16, 8


def make_config(role: str) -> VllmConfig:
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector=CLASS,
            kv_connector_module_path=MODULE,
            kv_role=role,  # type: ignore[arg-type]
            kv_connector_extra_config={"backend": "mooncake", "probe": True},
        ),
    )


def make_kv_cache_config(config: VllmConfig):
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE)
    # the engine core resolves the layout once (resolve_kv_cache_layout); CPU_ATTN supports only LBHNC
    config.cache_config.kv_cache_layout = "LBHNC"
    groups = [KVCacheGroupSpec(layer_names=list(LAYERS), kv_cache_spec=spec)]
    return get_kv_cache_config_from_groups(config, groups, available_memory=NUM_BLOCKS * spec.page_size_bytes * 2)


def main() -> None:
    out: dict = {"torch": torch.__version__, "platform": None, "roles": {}}
    from vllm.platforms import current_platform

    out["platform"] = type(current_platform).__name__
    for kv_role in ("kv_producer", "kv_consumer", "kv_both"):
        config = make_config(kv_role)
        kvc = make_kv_cache_config(config)
        entry: dict = {
            "model_config": repr(config.model_config),
            "disable_hybrid_kv_cache_manager": config.scheduler_config.disable_hybrid_kv_cache_manager,
            "is_kv_producer": config.kv_transfer_config.is_kv_producer,
            "is_kv_consumer": config.kv_transfer_config.is_kv_consumer,
            "engine_id_set": bool(config.kv_transfer_config.engine_id),
            "kv_cache_config": {
                "num_blocks": kvc.num_blocks,
                "kv_cache_tensors": [
                    {k: getattr(t, k) for k in ("size", "layers", "layer_stride", "block_stride", "offset")}
                    for t in kvc.kv_cache_tensors
                ],
                "groups": [[g.layer_names, type(g.kv_cache_spec).__name__] for g in kvc.kv_cache_groups],
                "page_size_bytes": kvc.kv_cache_groups[0].kv_cache_spec.page_size_bytes,
            },
        }
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER):
            conn = KVConnectorFactory.create_connector(config, role, kvc)
            cls = type(conn)
            info = {
                "class": f"{cls.__module__}.{cls.__qualname__}",
                "is_KVConnectorBase_V1": isinstance(conn, KVConnectorBase_V1),
                "role": conn.role.name,
                "extra": conn.extra,
            }
            if role is KVConnectorRole.WORKER:
                caches = allocate_kv_cache(kvc, torch.device("cpu"), config.cache_config.get_resolved_kv_cache_layout())
                conn.register_kv_caches(caches)
                first = next(iter(caches.values()))
                info["register_kv_caches"] = {
                    name: {
                        "shape": list(t.shape),
                        "stride": list(t.stride()),
                        "dtype": str(t.dtype),
                        "data_ptr_minus_first": t.data_ptr() - first.data_ptr(),
                        "same_storage_as_first": t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr(),
                        "storage_nbytes": t.untyped_storage().nbytes(),
                        "is_contiguous": t.is_contiguous(),
                    }
                    for name, t in conn.registered.items()
                }
            entry[role.name] = info
        out["roles"][kv_role] = entry
    out["calls"] = [list(c) for c in type(conn).calls]
    print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
