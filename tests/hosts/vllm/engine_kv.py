"""A vLLM worker's KV cache built the way vLLM 0.33.0's engine core builds it, on CPU (imports vLLM).

``EngineCore._initialize_kv_caches`` does, in order: ``register_all_kvcache_specs``; every layer's
``KVCacheSpec``; ``resolve_kv_cache_layout`` from the workers' supported layouts
(``get_supported_kv_cache_layouts`` over the attention backends) and the KV connector's
``get_required_kvcache_layout``; ``get_global_kv_cache_groups`` and ``get_kv_cache_configs``; then each
worker's model runner picks its kernel block sizes (``select_common_block_size``) and calls
``allocate_kv_cache`` with the resolved layout. :func:`engine_kv_caches` runs exactly these functions for
one attention backend class (``AttentionBackendEnum[name].get_class()``), with the layer specs a model's
``Attention`` / ``MLAAttention`` layers would report (:func:`layer_spec`). Nothing here sets a layout: a
test that forces one does it the operator's way, with ``VLLM_KV_CACHE_LAYOUT`` in the environment.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from releases import kv_cache_configs
from vllm.config import VllmConfig
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec, MLAAttentionSpec
from vllm.v1.worker.utils import allocate_kv_cache, select_common_block_size

__all__ = ["TINY_DEEPSEEK", "EngineKV", "engine_kv_caches", "layer_spec"]

# MLA (DeepSeek-V2, no MoE): a latent of kv_lora_rank 32 + rope 8 per token
TINY_DEEPSEEK = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float16",
    "rope_scaling": {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 65536},
}


@dataclass
class EngineKV:
    """What a worker hands ``register_kv_caches``, and how vLLM got there."""

    backend: str  # the attention backend class, module-qualified
    supported: list[str]  # the layouts that backend supports, most preferred first
    layout: str  # what resolve_kv_cache_layout chose
    kernel_block_size: int
    kv_cache_config: KVCacheConfig
    kv_caches: dict[str, torch.Tensor]


def layer_spec(config: VllmConfig) -> KVCacheSpec:
    """The spec every attention layer of ``config``'s model reports (``Attention.get_kv_cache_spec``).

    MLA models (``model_config.use_mla``): one latent head of ``kv_lora_rank + qk_rope_head_dim``; others
    ``model_config.get_num_kv_heads(parallel_config)`` heads of ``head_dim``, K and V each.
    """
    model, cache = config.model_config, config.cache_config
    dtype = model.dtype
    if model.use_mla:
        hf = model.hf_text_config
        return MLAAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=1,
            head_size=int(hf.kv_lora_rank) + int(hf.qk_rope_head_dim),
            dtype=dtype,
            cache_dtype_str=cache.cache_dtype,
        )
    return FullAttentionSpec(
        block_size=cache.block_size,
        num_kv_heads=model.get_num_kv_heads(config.parallel_config),
        head_size=model.get_head_size(),
        dtype=dtype,
    )


def engine_kv_caches(config: VllmConfig, backend: str, layers: list[str], num_blocks: int) -> EngineKV:
    """Resolve the layout, plan and allocate the KV cache of ``layers`` for attention backend ``backend``.

    ``num_blocks`` sizes the memory handed to ``get_kv_cache_configs`` (vLLM may keep fewer, never more).
    """
    register_all_kvcache_specs(config)
    cls: Any = AttentionBackendEnum[backend].get_class()
    spec = layer_spec(config)
    specs: dict[str, KVCacheSpec] = {name: spec for name in layers}
    supported = [layout.name for layout in get_supported_kv_cache_layouts([cls])]
    layout = resolve_kv_cache_layout(config, [supported], specs.values())
    memory = num_blocks * spec.page_size_bytes * len(layers)
    (kv_cache_config,) = kv_cache_configs(config, [specs], [memory])
    kv_cache_config.kv_cache_layout = config.cache_config.kv_cache_layout
    config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
    kernel = select_common_block_size(spec.block_size, [cls], [spec])
    kv_caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), layout, [kernel])
    name = f"{cls.__module__}.{cls.__qualname__}"
    return EngineKV(name, supported, layout.name, kernel, kv_cache_config, kv_caches)
