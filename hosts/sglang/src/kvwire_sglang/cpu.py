"""The sglang plugin ``kvwire_cpu``: sglang 0.5.23's prefill/decode path on a CPU-only server, without editing sglang.

sglang's CPU server serves one process fine, but its PD path makes CUDA-only calls that stop it. This plugin
closes the two that a plugin can close; it is independent of kvwire's transfer plugin (``kvwire``), so a
stock sglang pair (``SGLANG_PLUGINS=kvwire_cpu``) and a kvwire pair (``SGLANG_PLUGINS=kvwire,kvwire_cpu``)
run the same CPU path and can be compared. On a server that is not on CPU (sglang's ``is_cpu()`` False, i.e.
``SGLANG_USE_CPU_ENGINE`` unset) it changes nothing.

1. ``MooncakeKVSender.supports_host_tensor_indices`` is set False (sglang hard-codes True in
   ``disaggregation/mooncake/conn.py``): with True, the prefill's first send (``disaggregation/prefill.py``,
   ``_send_kv_chunk``) allocates ``pin_memory=True`` page indices and a ``torch.cuda.Event``; with False it
   takes sglang's generic ``kv_to_page_indices()`` branch, the same pages.
2. An MLA (DeepSeek) attention handler for ``torch_native``: sglang has none
   (``models/deepseek_common/attention_backend_handler.py`` falls back to the triton one), which picks the
   MHA path for a prefill without cached prefix while ``torch_native`` reads the MLA latent from the KV pool,
   and the first prefill fails (``Expected size ... [4, 24] but got: [4, 40]``). The handler takes the
   absorbed-MLA path for every batch; the latent stored (and moved) is the same.

Two more gaps are launch options, not code (see the README "Serving through kvwire"): the decode's pinned
retraction pool (``--disaggregation-decode-retraction-backup none``) and the prefill's early send of a
cached prefix (``SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX=false``), both ``torch.cuda`` calls.
"""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["register"]

log = logging.getLogger("kvwire.sglang.cpu")


def _mla_on_torch_native(attn: Any, forward_batch: Any) -> Any:
    """Every batch of a DeepSeek layer on ``torch_native`` takes the absorbed-MLA path (see the module docstring)."""
    from sglang.srt.models.deepseek_common.attention_backend_handler import _dispatch_mla_subtype

    return _dispatch_mla_subtype(attn, forward_batch)


def register() -> None:
    """Close sglang's CPU PD gaps 1 and 2 when this process runs sglang on CPU (sglang calls this)."""
    from sglang.srt.utils import is_cpu

    if not is_cpu():
        log.info("kvwire_cpu: sglang is not running on CPU (SGLANG_USE_CPU_ENGINE unset): nothing to do")
        return
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    MooncakeKVSender.supports_host_tensor_indices = False
    if "torch_native" not in AttentionBackendRegistry._handlers:
        AttentionBackendRegistry.register("torch_native", _mla_on_torch_native)
    log.info("kvwire_cpu: sglang's CPU PD path: host page indices off, MLA on torch_native through absorbed MLA")
