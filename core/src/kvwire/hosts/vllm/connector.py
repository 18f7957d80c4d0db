"""``KvwireConnector``: vLLM's ``KVConnectorBase_V1`` over any kvwire backend (this module imports vLLM).

Load it with ``kv_connector="KvwireConnector"``, ``kv_connector_module_path="kvwire.hosts.vllm"``
and ``kv_connector_extra_config={"backend": "nixl", ...}`` (keys:
:mod:`kvwire.hosts.vllm.settings`). Every hook delegates to
:class:`~kvwire.hosts.vllm.scheduler.SchedulerSide` or
:class:`~kvwire.hosts.vllm.worker.WorkerSide`; per-layer pipelining is not done
(``wait_for_layer_load`` and ``save_kv_layer`` do nothing, as in vLLM's NIXL
connectors): a prefill writes a request's blocks once it finished.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # type: ignore[import-not-found, unused-ignore]
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvwire.hosts.host_range import host_decision
from kvwire.hosts.vllm.metadata import StepMetadata
from kvwire.hosts.vllm.scheduler import SchedulerSide
from kvwire.hosts.vllm.settings import ConnectorSettings, EngineSide
from kvwire.hosts.vllm.stats import KvwireConnectorStats, KvwirePromMetrics
from kvwire.hosts.vllm.worker import WorkerSide

__all__ = ["KvwireConnector", "KvwireConnectorMetadata"]


class KvwireConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc, unused-ignore]
    """One step's :class:`~kvwire.hosts.vllm.metadata.StepMetadata`, as vLLM's metadata type."""

    def __init__(self, step: StepMetadata) -> None:
        self.step = step


def _tp() -> tuple[int, int]:
    """(rank, size) of this worker's tensor-parallel group; (0, 1) where vLLM's groups are not set up."""
    try:
        from vllm.distributed.parallel_state import (  # type: ignore[import-not-found, unused-ignore]
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())
    except (AssertionError, AttributeError, RuntimeError):
        return 0, 1


def _total_kv_heads(vllm_config: Any) -> int | None:
    """The model's KV heads over all TP ranks; None without a model config (then equal TP sizes only)."""
    model_config = getattr(vllm_config, "model_config", None)
    return None if model_config is None else int(model_config.get_total_num_kv_heads())


def _uses_mla(vllm_config: Any) -> bool:
    """The model keeps MLA's latent cache (vLLM's ``model_config.use_mla``); False without a model config."""
    model_config = getattr(vllm_config, "model_config", None)
    return model_config is not None and bool(model_config.use_mla)


class KvwireConnector(KVConnectorBase_V1):  # type: ignore[misc, unused-ignore]
    """vLLM's KV connector over a kvwire backend: the prefill pushes, the decode registers and receives."""

    def __init__(self, vllm_config: Any, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        host_decision("vllm")  # UnsupportedHostError on a vLLM release kvwire is not tested on (unless "try")
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        producer, consumer = bool(transfer.is_kv_producer), bool(transfer.is_kv_consumer)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        heads, mla = _total_kv_heads(vllm_config), _uses_mla(vllm_config)
        if role == KVConnectorRole.SCHEDULER:
            tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
            engine = EngineSide(self.settings, tp_size, producer, consumer, heads, mla)
            self.scheduler_side = SchedulerSide(engine, str(transfer.engine_id))
        else:
            rank, size = _tp()
            blocks = getattr(kv_cache_config, "num_blocks", None)
            engine = EngineSide(self.settings, size, producer, consumer, heads, mla)
            self.worker_side = WorkerSide(engine, rank, None if blocks is None else int(blocks))
        self._started: KVConnectorMetadata | None = None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: Any) -> str | None:
        """``"LBHNC"`` (head-major blocks: a TP rank's heads are one run per block), None for MLA.

        vLLM's engine core resolves the KV-cache layout once, from the attention backends' supported
        layouts and this wish (``resolve_kv_cache_layout``); without it FlashAttention and Triton get the
        token-major ``LBNHC``, which moves between equal TP sizes only. MLA's latent cache has one head,
        so every block-compact layout is the same bytes (None, as vLLM's NixlConnector). A layout forced
        over this (``VLLM_KV_CACHE_LAYOUT``, a backend without LBHNC) is checked at ``register_kv_caches``.
        """
        return None if _uses_mla(vllm_config) else "LBHNC"

    # -- scheduler side ------------------------------------------------------

    def _scheduler(self) -> SchedulerSide:
        assert self.scheduler_side is not None, "a scheduler hook was called on a WORKER-role connector"
        return self.scheduler_side

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        self._scheduler().update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        return KvwireConnectorMetadata(self._scheduler().build_connector_meta(scheduler_output))

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler().request_finished(request, block_ids)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler().update_connector_output(connector_output)

    def has_pending_push_work(self) -> bool:
        return self.scheduler_side is not None and self.scheduler_side.has_pending_push_work()

    # -- worker side ---------------------------------------------------------

    def _worker(self) -> WorkerSide:
        assert self.worker_side is not None, "a worker hook was called on a SCHEDULER-role connector"
        return self.worker_side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start the bound step's work once (vLLM may call this before or after the forward)."""
        meta = self._get_connector_metadata()
        if meta is self._started or not isinstance(meta, KvwireConnectorMetadata):
            return
        self._started = meta
        self._worker().start(meta.step)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return None

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self._worker().get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().load_errors()

    # -- metrics (vLLM's KVConnectorStats, see kvwire.hosts.vllm.stats) ------

    def get_kv_connector_stats(self) -> KvwireConnectorStats | None:
        """This worker's transfers since the last step; None on the scheduler side or when there were none."""
        data = None if self.worker_side is None else self.worker_side.drain_stats()
        return None if data is None else KvwireConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KvwireConnectorStats:
        return KvwireConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KvwirePromMetrics:
        return KvwirePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self.worker_side is not None:
            self.worker_side.shutdown()
