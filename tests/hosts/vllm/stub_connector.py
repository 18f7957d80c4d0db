"""A do-nothing out-of-tree vLLM v1 KV connector: proves vLLM 0.33.0 loads a class from a module on sys.path.

Loaded by vLLM itself through ``KVTransferConfig(kv_connector="KvwireConnector",
kv_connector_module_path="stub_connector")`` (this directory on ``sys.path``). Every abstract method of
``KVConnectorBase_V1`` is implemented as a no-op; every scheduler/worker hook that vLLM calls is recorded
in ``KvwireConnector.calls`` (class-level, per process) so the probes can report what vLLM called, in order.

Runs only inside ``.venv-vllm`` (tests/hosts/vllm/make_venv.sh); never imported by the kvwire test suite.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvwireStubMetadata(KVConnectorMetadata):
    """Scheduler -> worker metadata of one step: the request ids the scheduler saw."""

    def __init__(self, req_ids: list[str]) -> None:
        self.req_ids = req_ids


class KvwireConnector(KVConnectorBase_V1):
    calls: ClassVar[list[tuple[str, Any]]] = []
    #: what get_num_new_matched_tokens answers for a request whose kv_transfer_params has "do_remote_prefill"
    remote_tokens: ClassVar[int] = 0

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.extra = dict(self._kv_transfer_config.kv_connector_extra_config)
        self.registered: dict[str, torch.Tensor] = {}
        self._record("__init__", role.name)

    def _record(self, name: str, detail: Any = None) -> None:
        type(self).calls.append((name, detail))

    # -- worker side (abstract) ------------------------------------------------------------------------------
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._record("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._record("wait_for_layer_load", layer_name)

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata, **kwargs: Any
    ) -> None:
        self._record("save_kv_layer", layer_name)

    def wait_for_save(self) -> None:
        self._record("wait_for_save")

    # -- worker side (optional, recorded) ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.registered = dict(kv_caches)
        self._record("register_kv_caches", sorted(kv_caches))

    # -- scheduler side (abstract) -----------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        self._record("get_num_new_matched_tokens", [request.request_id, num_computed_tokens, dict(params)])
        if params.get("do_remote_prefill") and type(self).remote_tokens > 0:
            return type(self).remote_tokens, True
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._record(
            "update_state_after_alloc",
            [request.request_id, [list(g) for g in blocks.get_block_ids()], num_external_tokens],
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        req_ids = [r.req_id for r in scheduler_output.scheduled_new_reqs]
        self._record("build_connector_meta", req_ids)
        return KvwireStubMetadata(req_ids)

    # -- scheduler side (optional, recorded) -------------------------------------------------------------------
    def on_new_request(self, request: Request) -> None:
        self._record("on_new_request", [request.request_id, dict(request.kv_transfer_params or {})])

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._record("update_connector_output")

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._record("request_finished", [request.request_id, list(block_ids)])
        return False, None
