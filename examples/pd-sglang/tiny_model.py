"""A tiny model with random weights, made locally, that sglang's CPU server can serve (no hub, no tokenizer).

Two architectures, the two kinds of KV cache sglang moves:

* ``llama``: ``LlamaForCausalLM``, 2 layers, hidden 64, 4 heads, 2 KV heads (GQA; MHA pools of K and V);
* ``mla``: ``DeepseekV2ForCausalLM``, 2 layers, hidden 64, 4 heads, a 32 + 8 latent (one MLA pool per layer),
  no MoE, yarn rope of factor 1.0 (the only rope sglang's CPU path accepts for DeepSeek).

Weights are drawn from ``torch.manual_seed(seed)`` with a scale of ``1/sqrt(fan_in)`` (Hugging Face's own
init of std 0.02 makes nearly flat logits, so greedy tokens would say little). ``kv_seed`` redraws only the
weights that make the KV cache (``v_proj`` for llama; the latent projection ``kv_a_proj_with_mqa`` for
mla): a prefill of such a model writes other KV than a decode of the plain one would compute, which is how a
test tells a transferred KV from a recomputed one. Run as a script: ``python tiny_model.py DIR [--arch mla]``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

VOCAB = 512
HIDDEN = 64
LAYERS = 2
HEADS = 4

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 128,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
}

CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        **_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "num_key_value_heads": 2,
        "head_dim": HIDDEN // HEADS,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
    },
    "mla": {
        **_COMMON,
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "num_key_value_heads": HEADS,
        "q_lora_rank": None,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "moe_intermediate_size": 128,
        "n_routed_experts": 4,  # declared, never built: every layer is below first_k_dense_replace
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "first_k_dense_replace": LAYERS,  # every layer dense: no MoE
        "moe_layer_freq": 1,
        "rope_theta": 10000.0,
        "rope_scaling": {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": 1.0,
            "original_max_position_embeddings": 2048,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "attention_bias": False,
    },
}

#: The weights that make a layer's KV cache, per architecture (redrawn by ``kv_seed``).
KV_WEIGHTS: dict[str, str] = {"llama": "self_attn.v_proj.weight", "mla": "self_attn.kv_a_proj_with_mqa.weight"}


def make_model(path: str | Path, arch: str = "llama", *, seed: int = 0, kv_seed: int | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` of a tiny ``arch`` model into ``path``; returns it."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch not in CONFIGS:
        raise ValueError(f"arch must be one of {sorted(CONFIGS)}, got {arch!r}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = dict(CONFIGS[arch])
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    hf_config = AutoConfig.from_pretrained(out)
    model = AutoModelForCausalLM.from_config(hf_config)
    state = model.state_dict()

    def draw(names: list[str], generator: torch.Generator) -> None:
        for name in names:
            tensor = state[name]
            if tensor.ndim >= 2:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / math.sqrt(tensor.shape[-1]))
            else:  # norms: around one, not exactly (a weight of ones hides a swapped norm)
                tensor.copy_(1.0 + 0.1 * torch.randn(tensor.shape, generator=generator))

    draw(sorted(state), torch.Generator().manual_seed(seed))
    if kv_seed is not None:
        draw(sorted(n for n in state if n.endswith(KV_WEIGHTS[arch])), torch.Generator().manual_seed(kv_seed))
    save_file({name: t.contiguous() for name, t in sorted(state.items())}, str(out / "model.safetensors"))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="directory to write the model into")
    parser.add_argument("--arch", choices=sorted(CONFIGS), default="llama")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-seed", type=int, default=None, help="redraw the KV-making weights with this seed")
    args = parser.parse_args()
    print(make_model(args.path, args.arch, seed=args.seed, kv_seed=args.kv_seed))


if __name__ == "__main__":
    main()
