"""The worker side of the connector: the kvwire connection, and the sender or receiver behind vLLM's hooks.

``register_kv_caches`` maps vLLM's tensors to a layout
(:func:`~kvwire.hosts.vllm.layout.layout_from_kv_caches`), connects the backend
named in the settings (validated by kvwire as it loads) and registers the
buffers. A producer then serves registrations on its side channel
(``side_channel_port + tp_rank``); a consumer watches arrival notifications.
Each step's metadata starts the work; ``get_finished`` and
``get_block_ids_with_load_errors`` report it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from kvwire.connection.connection import Connection
from kvwire.control.auth import load_key
from kvwire.errors import ConfigError
from kvwire.hosts.activation import activation_line
from kvwire.hosts.vllm.channel import RegistrationClient, RegistrationServer
from kvwire.hosts.vllm.layout import KVTensor, VllmLayout, layout_from_kv_caches
from kvwire.hosts.vllm.metadata import StepMetadata
from kvwire.hosts.vllm.rank import WorkerRank
from kvwire.hosts.vllm.receiving import Receiver
from kvwire.hosts.vllm.sending import Sender
from kvwire.hosts.vllm.settings import EngineSide
from kvwire.hosts.vllm.telemetry import StatsData, TransferStats
from kvwire.registry.manager import connect

__all__ = ["WorkerSide"]

log = logging.getLogger("kvwire.hosts.vllm")


class WorkerSide:
    """One vLLM worker's transfers (TP rank ``tp_rank`` of ``tp_size``).

    ``total_kv_heads`` (the model's; None where unknown) lets it exchange blocks with a prefill or decode
    of another TP size, head by head. ``num_blocks`` is vLLM's block count (``kv_cache_config.num_blocks``;
    None: one kernel block per block), which tells blocks split into kernel blocks from whole ones.
    """

    def __init__(self, engine: EngineSide, tp_rank: int, num_blocks: int | None = None) -> None:
        self.settings, self.tp_size, self.total_kv_heads = engine.settings, engine.tp_size, engine.total_kv_heads
        self.producer, self.consumer, self.mla = engine.producer, engine.consumer, engine.mla
        self.tp_rank, self.num_blocks = tp_rank, num_blocks
        self.local: VllmLayout | None = None
        self.connection: Connection | None = None
        self.sender: Sender | None = None
        self.receiver: Receiver | None = None
        self._server: RegistrationServer | None = None
        self._client: RegistrationClient | None = None
        self.stats = TransferStats()  # both roles' transfers, for vLLM's KVConnectorStats

    def register_kv_caches(self, kv_caches: Mapping[str, KVTensor]) -> None:
        """Map and register the KV cache, connect the backend, and open the side channel or the watcher."""
        if self.connection is not None:
            raise ConfigError("register_kv_caches was called twice; kvwire's connector registers its KV cache once")
        # LayoutError naming the layer before anything is opened
        local = layout_from_kv_caches(
            kv_caches, self.tp_size, self.tp_rank, self.total_kv_heads, mla=self.mla, num_blocks=self.num_blocks
        )
        if local.order == "token-major":  # what vLLM gives when a layout is forced over the connector's wish
            log.warning(
                "kvwire: the KV cache is token-major (LBNHC): whole blocks move between equal TP sizes; a prefill "
                "or decode of another TP size will be refused: %s",
                local.tp_refusal,
            )
        settings = self.settings
        connection = connect(settings.backend, settings.backend_config)
        try:
            connection.register_kv_buffers(local.layout)
            key = load_key(None, "KVWIRE_CONTROL_KEY")
            timeout_s = max(settings.backend_config.timeout_s, 5.0)
            if self.producer:
                rank = WorkerRank(connection, local, self.tp_rank, self.tp_size, stats=self.stats)
                self.sender = Sender(rank, settings.lease_s)
                port = settings.side_channel_port + self.tp_rank
                self._server = RegistrationServer(settings.side_channel_host, port, self.sender.handle, key, timeout_s)
            if self.consumer:
                self._client = RegistrationClient(key, timeout_s)
                rank = WorkerRank(connection, local, self.tp_rank, self.tp_size, stats=self.stats)
                self.receiver = Receiver(rank, self._client, settings.load_timeout_s)
        except BaseException:
            self.shutdown_parts(connection)
            raise
        self.local, self.connection = local, connection
        role = "/".join(r for r, on in (("kv_producer", self.producer), ("kv_consumer", self.consumer)) if on)
        detail = (
            f"{len(local.layer_names)} layers x {local.num_blocks} {local.order} blocks of {local.block_bytes} "
            f"bytes, TP {self.tp_rank}/{self.tp_size}, endpoint {connection.endpoint():.60}"
        )
        log.info("%s", activation_line(connection, "vllm", role, detail, settings.resolved))

    def start(self, meta: StepMetadata) -> None:
        """Start one step's work: mark finished prefills ready, register the decode's new requests.

        It runs in vLLM's step, so nothing raises out of it: a request whose work fails is logged and fails
        alone (a decode request then reports its blocks as load errors), and the step's other requests go on.
        """
        for ready in meta.to_send:
            if self.sender is None:
                log.error("kvwire: request %s finished on a worker that is not a kv_producer", ready.request_id)
                continue
            try:
                self.sender.mark_ready(ready)
            except Exception:  # the step's other requests go on; this one is released at its lease's end
                log.exception("kvwire: request %s: marking its blocks ready failed", ready.request_id)
        for item in meta.to_receive:
            if self.receiver is None:
                log.error("kvwire: request %s waits for KV on a worker that is not a kv_consumer", item.request_id)
                continue
            try:
                self.receiver.start(item)
            except Exception as exc:  # that request fails (its blocks become load errors); the others go on
                self.receiver.fail_request(item, f"registering its blocks failed: {type(exc).__name__}: {exc}")

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(requests whose blocks vLLM may free here, requests whose blocks arrived or failed)."""
        sent = self.sender.finished() if self.sender is not None else set()
        received = self.receiver.finished() if self.receiver is not None else set()
        return (sent or None), (received or None)

    def drain_stats(self) -> StatsData | None:
        """What this worker's transfers did since the last call (None: nothing), for vLLM's metrics."""
        return self.stats.drain()

    def load_errors(self) -> set[int]:
        return self.receiver.load_errors() if self.receiver is not None else set()

    def shutdown_parts(self, connection: Connection | None) -> None:
        """Close what is open: the watcher, the side channel, the connection (each once)."""
        if self.receiver is not None:
            self.receiver.close()
            self.receiver = None
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._server is not None:
            self._server.close()
            self._server = None
        if connection is not None:
            connection.close()

    def shutdown(self) -> None:
        connection, self.connection = self.connection, None
        self.shutdown_parts(connection)
