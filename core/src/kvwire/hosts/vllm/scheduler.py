"""The scheduler side of the connector: which requests send, which receive, and when blocks may be freed.

It runs in vLLM's engine core, next to the v1 ``Scheduler``, and never moves a
byte: it turns the scheduler's hooks into :class:`~kvwire.hosts.vllm.metadata.StepMetadata`
for the workers and returns the prefill's ``kv_transfer_params``.

* Prefill (a request with ``do_remote_decode``): ``request_finished`` keeps the
  blocks (``delay_free``), tells the workers they are ready, and returns
  :func:`~kvwire.hosts.vllm.params.prefill_params`. vLLM frees them when the
  workers report the request in ``finished_sending`` (after the write, or at the
  lease's end).
* Decode (a request with ``do_remote_prefill``): ``get_num_new_matched_tokens``
  claims the prompt as loaded asynchronously; ``update_state_after_alloc``
  records the decode's fresh blocks against the prefill's, which the worker
  registers with the prefill.

vLLM's types are read by attribute (``request.kv_transfer_params``,
``request.prompt_token_ids``, ``blocks.get_unhashed_block_ids()``), so this
module imports nothing of vLLM.
"""

from __future__ import annotations

import logging
from typing import Any

from kvwire.errors import InvalidTransferError
from kvwire.hosts.vllm.metadata import ReadyToSend, StepMetadata, ToReceive
from kvwire.hosts.vllm.params import parse_remote_prefill, prefill_params
from kvwire.hosts.vllm.settings import EngineSide

__all__ = ["SchedulerSide"]

log = logging.getLogger("kvwire.hosts.vllm")

#: Request statuses after which a prefill's KV is complete (an aborted request's is not).
_SENDABLE = frozenset({"FINISHED_LENGTH_CAPPED", "FINISHED_STOPPED"})


class SchedulerSide:
    """The scheduler-side hooks (see the module docstring); one per engine."""

    def __init__(self, engine: EngineSide, engine_id: str) -> None:
        self.settings, self.tp_size, self.total_kv_heads = engine.settings, engine.tp_size, engine.total_kv_heads
        self.producer, self.consumer, self.mla = engine.producer, engine.consumer, engine.mla
        self.engine_id = engine_id
        self._to_send: list[ReadyToSend] = []
        self._to_receive: list[ToReceive] = []
        self._held: set[str] = set()  # prefill requests whose blocks wait for finished_sending

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        """A decode request's prompt beyond what is already computed, loaded asynchronously; else (0, False).

        Parameters this connector's prefill did not write, or a prefill of another TP size, are refused
        here, logged with the reason, and the decode computes the prompt itself.
        """
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or not self.consumer:
            return 0, False
        try:
            remote = parse_remote_prefill(params)
        except InvalidTransferError as exc:
            log.error("kvwire: request %s: %s; computing its prompt here", request.request_id, exc)
            params["do_remote_prefill"] = False
            return 0, False
        if remote.tp_size != self.tp_size:
            why = self._across_tp_refusal(remote.tp_size)
            if why is not None:
                log.error(
                    "kvwire: request %s: the prefill runs tensor_parallel_size=%d, this decode %d; %s; computing "
                    "its prompt here",
                    request.request_id,
                    remote.tp_size,
                    self.tp_size,
                    why,
                )
                params["do_remote_prefill"] = False
                return 0, False
        count = len(request.prompt_token_ids or ()) - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _across_tp_refusal(self, prefill_tp: int) -> str | None:
        """Why blocks cannot come from a prefill of TP size ``prefill_tp`` (not this one's), or None: they can."""
        total, big, small = self.total_kv_heads, max(prefill_tp, self.tp_size), min(prefill_tp, self.tp_size)
        if total is None:
            return (
                "kvwire's vLLM connector moves blocks across TP sizes only when it knows the model's total KV heads "
                "(vllm_config.model_config)"
            )
        if big % small:
            return "across TP sizes the larger must be a multiple of the smaller"
        if self.mla:  # every rank holds the whole latent
            return None
        if (total >= prefill_tp and total % prefill_tp) or (total < prefill_tp and prefill_tp % total):
            return f"the model's {total} KV heads do not split over the prefill's {prefill_tp} ranks"
        return None

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """Record a decode request's freshly allocated blocks against the prefill's (once per request)."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill") or num_external_tokens <= 0:
            return
        params["do_remote_prefill"] = False  # registered once: the second call after the load finds it off
        remote = parse_remote_prefill(params)  # checked by get_num_new_matched_tokens already
        local = tuple(int(b) for b in blocks.get_unhashed_block_ids())
        self._to_receive.append(ToReceive(request.request_id, local, remote))

    def build_connector_meta(self, scheduler_output: Any) -> StepMetadata:
        """The work found since the last step, handed to the workers (called on every ``schedule()``)."""
        meta = StepMetadata(tuple(self._to_send), tuple(self._to_receive))
        self._to_send.clear()
        self._to_receive.clear()
        return meta

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """A prefill request that completed keeps its blocks for the decode and returns the decode's params."""
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_decode") or not self.producer:
            return False, None
        status = getattr(request.status, "name", str(request.status))
        if status not in _SENDABLE or not block_ids:
            return False, None
        blocks = tuple(int(b) for b in block_ids)
        self._to_send.append(ReadyToSend(request.request_id, blocks))
        self._held.add(request.request_id)
        return True, prefill_params(
            request.request_id,
            self.engine_id,
            self.settings.side_channel_host,
            self.settings.side_channel_port,
            blocks,
            self.tp_size,
            int(request.num_computed_tokens),
        )

    def update_connector_output(self, connector_output: Any) -> None:
        """Forget the prefill requests whose blocks the workers released."""
        for request_id in connector_output.finished_sending or ():
            self._held.discard(request_id)

    def has_pending_push_work(self) -> bool:
        """True while a prefill holds blocks for a decode, or work waits for the workers: keeps vLLM stepping."""
        return bool(self._held or self._to_send or self._to_receive)
