"""``KvwireManagerMixin``: sglang's ``MooncakeKVManager`` with its KV sends through kvwire, peers wired by sglang.

Mixed in first over sglang's own class (``class M(KvwireManagerMixin,
MooncakeKVManager)``; the ``kvwire-sglang`` distribution does this inside sglang
through its plugin framework). It reads only attributes sglang's manager sets
and imports nothing of sglang. In both roles:

- ``init_engine`` (called by sglang's constructor after the parallel layout is
  known, before any sglang thread starts, so there is no race): after sglang's
  engine comes up, a kvwire connection over that very engine (kvwire creates
  none, and registers no memory: sglang registers its pools) with the local
  layout from ``kv_args`` (draft-model KV as layers after the target's; a
  HiSparse decode's target buffers ``host``, its draft's ``device``), on the
  ``hisparse`` backend when kvwire-hisparse is installed, else ``mooncake``
  (:func:`default_backend`). With :data:`BACKEND_ENV` naming another backend
  (``nixl``, a third party's), kvwire opens that backend's own engine instead,
  registers sglang's KV memory with it, and each decode publishes that engine's
  endpoint: the same sends, on another transport (sglang's bootstrap,
  registration and auxiliary transfers stay on sglang's engine);
- ``teardown`` also closes the connection.

Decode role: ``build_receiver_registration_message`` appends the layout frame
(:mod:`kvwire_sglang.registration`). Prefill role: the registration
receiver notes that frame, and ``_publish_peer_registration`` (sglang's step
that records a decode's registration) adds the decode as a kvwire peer under
its session id, after checking that the frame's buffers are the pointers sglang
registered. A decode without the frame (no kvwire on that side) is logged and
left unknown to kvwire: its sends are refused (status -22), never sent blind.
``send_kvcache`` is :class:`~kvwire_sglang.send.KvwireSendMixin`'s, and
``send_kvcache_slice`` (MHA across attention-TP sizes) goes through it too:
kvwire plans the head slices from the two published layouts.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, List, Optional  # noqa: UP035 - sglang's annotations, verbatim

import numpy as np
import numpy.typing as npt

from kvwire.config import ResolvedConfig, resolve_config
from kvwire.errors import KvwireError
from kvwire.hosts.activation import activation_line
from kvwire.layout.buffers import HeadLayout, LayoutError, MemoryKind
from kvwire.layout.kv_layout import KVLayout
from kvwire.registry.manager import connect
from kvwire_sglang.backends import (
    BACKEND_ENV,
    PLAIN_BACKEND,
    SPLIT_BACKEND,
    chosen_backend,
    default_backend,
)
from kvwire_sglang.layout import layout_from_kv_args
from kvwire_sglang.registration import Published, layout_frame, published_from_frames
from kvwire_sglang.send import REFUSED, FailedSessions, KvwireSendMixin, note_status

__all__ = [
    "BACKEND_ENV",
    "PLAIN_BACKEND",
    "SPLIT_BACKEND",
    "KvwireManagerMixin",
    "chosen_backend",
    "default_backend",
    "heads_of_kv_args",
    "peer_heads",
]

log = logging.getLogger("kvwire.sglang")


def heads_of_kv_args(kv_args: Any) -> HeadLayout | None:
    """How an MHA rank's pages hold heads, from ``KVArgs``: token-major pages of ``kv_head_num`` heads.

    sglang's item length is ``page_size * kv_head_num * head_dim * element size`` bytes; kvwire needs
    only the bytes of one head of one token, so the element is counted as one byte. None when
    ``kv_args`` has no ``kv_head_num``: sglang 0.5.23's decode sets it only for its staging buffer,
    and the prefill then derives the decode's heads (:func:`peer_heads`).
    """
    if getattr(kv_args, "kv_head_num", None) is None:
        return None
    page_size, heads = int(kv_args.page_size), int(kv_args.kv_head_num)
    item = int(kv_args.kv_item_lens[0])
    if page_size <= 0 or heads <= 0 or item % (page_size * heads):
        raise LayoutError(
            f"kv_item_lens[0] = {item} is not page_size ({page_size}) x kv_head_num ({heads}) x bytes per head"
        )
    total = int(getattr(kv_args, "total_kv_head_num", 0) or 0) or heads
    return HeadLayout(heads, total, item // (page_size * heads), 1, page_size)


def peer_heads(local: HeadLayout, peer: KVLayout) -> HeadLayout:
    """The heads of a decode rank that published none, derived as sglang's ``send_kvcache_slice`` does.

    The model's KV heads are this side's ``total_kv_heads``; a rank of TP size ``t`` holds
    ``max(1, total // t)`` of them; the bytes of one head of one token follow from its item length.
    """
    tp = peer.attn_tp_size or 1
    kv_heads = max(1, local.total_kv_heads // tp)
    item = peer.buffers[0].page_bytes
    per_token = local.tokens_per_page * kv_heads
    if item % per_token:
        raise LayoutError(
            f"the decode's page of {item} bytes is not {local.tokens_per_page} tokens x {kv_heads} heads "
            f"(of {local.total_kv_heads} at attention-TP size {tp}) x bytes per head"
        )
    return HeadLayout(kv_heads, local.total_kv_heads, item // per_token, 1, local.tokens_per_page)


def sglang_metrics(server_args: Any, backend: str) -> list[object]:
    """kvwire's metrics middleware when sglang runs with ``--enable-metrics``, else none.

    sglang's schedulers are subprocesses whose metrics reach the HTTP server's ``/metrics`` through
    prometheus_client's multiprocess mode (sglang sets ``PROMETHEUS_MULTIPROC_DIR`` before starting
    them); kvwire's families on prometheus_client's default registry go the same way, so the
    ``kvwire_send_*`` series appear on sglang's own ``/metrics`` next to sglang's.
    """
    if not getattr(server_args, "enable_metrics", False):
        return []
    try:
        from kvwire.metrics import default_metrics

        return [default_metrics().middleware(backend)]
    except ImportError as exc:
        log.warning("kvwire: --enable-metrics, but kvwire's metrics are off: %s", exc)
        return []


def sglang_activation_line(connection: Any, server_args: Any, layout: KVLayout, resolved: ResolvedConfig) -> str:
    """The one line a scheduler logs when kvwire carries its KV (:func:`kvwire.hosts.activation.activation_line`)."""
    role = str(getattr(server_args, "disaggregation_mode", "?"))
    detail = (
        f"{layout.attention} layout of {len(layout.buffers)} buffers, "
        f"attention TP {layout.attn_tp_rank}/{layout.attn_tp_size}"
    )
    return activation_line(connection, "sglang", role, detail, resolved)


def _engine_of(backend: str | None) -> str:
    return "sglang's Mooncake engine" if backend is None else f"backend {backend!r}'s own engine"


def _said(exc: Exception) -> str:
    """A kvwire error's message; anything else with its type (it came from a peer's input kvwire did not expect)."""
    return str(exc) if isinstance(exc, KvwireError) else f"{type(exc).__name__}: {exc}"


class KvwireManagerMixin(KvwireSendMixin):
    """sglang's Mooncake KV manager, sending KV pages through kvwire (see the module docstring)."""

    #: A kvwire backend that drives sglang's engine (it must accept ``options={"engine": ...,
    #: "host_registered": True}``); None: :func:`chosen_backend` (:data:`BACKEND_ENV`, whose backends other than
    #: ``mooncake`` and ``hisparse`` open an engine of their own; else ``hisparse`` when installed, else ``mooncake``).
    kvwire_backend: ClassVar[str | None] = None
    #: The endpoint of kvwire's own engine, published to the prefill (None: kvwire drives sglang's engine).
    kvwire_endpoint: str | None = None

    kvwire_layout: KVLayout
    # sglang's attributes this mixin reads (set by sglang's CommonKVManager / MooncakeKVManager)
    kv_args: Any
    engine: Any
    is_mla_backend: bool | None
    attn_tp_size: int
    attn_tp_rank: int
    server_args: Any

    @property
    def failed_sessions(self) -> FailedSessions:
        """sglang's blacklist of decode sessions, as a :class:`~kvwire_sglang.send.FailedSessions`.

        sglang's constructor assigns a plain set (prefill role); this property keeps it as one that
        does not blacklist a session for a send kvwire refused for its input (status -22).
        """
        return self._kvwire_failed_sessions

    @failed_sessions.setter
    def failed_sessions(self, sessions: set[str]) -> None:
        self._kvwire_failed_sessions = FailedSessions(sessions)

    def init_engine(self) -> None:
        super().init_engine()  # type: ignore[misc]  # sglang's: self.engine, the shared Mooncake engine
        self._kvwire_lock = threading.Lock()
        self._kvwire_registered: dict[str, Published] = {}
        self._kvwire_endpoints: dict[str, str] = {}  # sglang's decode session id -> where kvwire reaches it
        self.kvwire_layout = self.kvwire_local_layout()
        if self.kvwire_backend is not None:
            backend, shared = self.kvwire_backend, True
        else:
            backend, shared = chosen_backend()
        # kvwire's configuration ($KVWIRE_CONFIG, KVWIRE_*), under what sglang decides: its engine, its memory
        resolved = resolve_config(options={"engine": self.engine.engine, "host_registered": True} if shared else None)
        config = resolved.config
        self.kvwire_connection = connect(backend, config, middleware=sglang_metrics(self.server_args, backend))
        try:
            self.kvwire_connection.register_kv_buffers(self.kvwire_layout)  # own engine: registers sglang's pools
            self.kvwire_endpoint = None if shared else self.kvwire_connection.endpoint()
        except BaseException:
            self.kvwire_connection.close()
            raise
        log.info("%s", sglang_activation_line(self.kvwire_connection, self.server_args, self.kvwire_layout, resolved))

    def kvwire_local_layout(self) -> KVLayout:
        """This rank's layout, from sglang's ``kv_args`` (host memory when sglang runs on CPU).

        An MHA layout records its heads (:func:`heads_of_kv_args`), so that kvwire can move head
        slices between different attention-TP sizes. Draft-model KV (``kv_args.num_draft_entries``)
        becomes layers of its own after the target's, numbered as sglang numbers them (see
        :func:`~kvwire_sglang.layout.layout_from_kv_args`); the buffers of a HiSparse decode
        are labelled as sglang labels them (:meth:`kvwire_memory_kinds`).
        """
        a = self.kv_args
        drafts = int(getattr(a, "num_draft_entries", 0) or 0)
        layer_ids = list(getattr(a, "kv_layer_ids", None) or [])
        pp_size = int(getattr(self, "pp_size", 1) or 1)
        if drafts and not layer_ids and pp_size > 1:
            # positional pools number the draft after the target's layers, which a stage does not know
            raise LayoutError(
                f"kv_args has {drafts} draft-model KV entries, positional layers (kv_layer_ids []) and a "
                f"pipeline of {pp_size} stages: a stage cannot number the draft's layers after the model's "
                "(sglang pairs these by position and mixes them up too); run the prefill with pp_size 1, or "
                "without SGLANG_PLUGINS=kvwire for this deployment"
            )
        mla = bool(self.is_mla_backend or getattr(a, "is_hybrid_mla_backend", False))  # hybrid MLA: one per layer
        heads = None if mla else heads_of_kv_args(a)
        if heads is not None and any(int(item) != heads.page_bytes for item in a.kv_item_lens):
            # a draft of another head shape: whole pages move between equal TP sizes; no head slices across them
            log.info(
                "kvwire: the draft model's KV pages (%s bytes) are not the target's (%d bytes): this rank's layout "
                "records no heads, so transfers across attention-TP sizes are refused",
                sorted({int(i) for i in a.kv_item_lens} - {heads.page_bytes}),
                heads.page_bytes,
            )
            heads = None
        return layout_from_kv_args(
            a.kv_data_ptrs,
            a.kv_data_lens,
            a.kv_item_lens,
            layer_ids,
            attention="mla" if mla else "mha",
            memory=self.kvwire_memory_kinds(),
            attn_tp_size=int(self.attn_tp_size),
            attn_tp_rank=int(self.attn_tp_rank),
            heads=heads,
            first_layer=int(getattr(a, "prefill_start_layer", 0) or 0),  # a pipeline stage's first layer
            num_draft_entries=drafts,
        )

    def kvwire_memory_kinds(self) -> list[MemoryKind]:
        """The memory kind of each of ``kv_args``'s KV buffers, as sglang 0.5.23 labels them.

        A HiSparse decode (``--enable-hisparse``; sglang's ``DecodePreallocQueue._init_kv_manager``)
        registers its target KV from the host pool (DRAM) and its draft KV from the device
        pool: the layout is then a split destination, whose draft buffers take the
        ``device_kv_indices`` the decode sends. Every other rank's buffers are of one kind:
        ``"host"`` when sglang runs on CPU (``--device cpu``), else ``"device"``. A HiSparse decode
        of DeepSeek-V4 (``kv_args.mla_compression_ratios``) is refused: kvwire-sglang does not
        describe its compressed pools.
        """
        a = self.kv_args
        n = len(a.kv_data_ptrs)
        own: MemoryKind = "host" if getattr(self.server_args, "device", None) == "cpu" else "device"
        decode = str(getattr(self.server_args, "disaggregation_mode", "")) == "decode"
        if not (decode and getattr(self.server_args, "enable_hisparse", False)):
            return [own] * n
        if getattr(a, "mla_compression_ratios", None) is not None:
            raise LayoutError(
                "kvwire-sglang does not describe a HiSparse decode of DeepSeek-V4 (kv_args.mla_compression_ratios "
                "is set: compressed pools, partly in host memory); run without SGLANG_PLUGINS=kvwire for this "
                "deployment"
            )
        drafts = int(getattr(a, "num_draft_entries", 0) or 0)
        host: MemoryKind = "host"
        device: MemoryKind = "device"
        return [host] * (n - drafts) + [device] * drafts

    def send_kvcache_slice(
        self,
        mooncake_session_id: str,
        prefill_kv_indices: npt.NDArray[np.int32],
        dst_kv_ptrs: list[int],
        dst_kv_indices: npt.NDArray[np.int32],
        dst_tp_rank: int,
        dst_attn_tp_size: int,
        dst_kv_item_len: int,
        executor: concurrent.futures.ThreadPoolExecutor,
        dst_layer_ids: Optional[List[int]] = None,  # noqa: UP006, UP045 - sglang's annotation
    ) -> int:
        """sglang's MHA path across attention-TP sizes, as one kvwire send: kvwire plans the head slices.

        The decode's published layout records its TP size, rank and heads; a ``dst_tp_rank`` that is
        not the rank it published is refused (status -22) before any byte moves.
        """
        peer = self.kvwire_connection.peer_layout(self.kvwire_endpoint_of(mooncake_session_id))
        if peer is not None and peer.attn_tp_rank is not None and peer.attn_tp_rank != dst_tp_rank:
            log.error(
                "kvwire send_kvcache_slice to session %s refused (status -22): dst_tp_rank = %d, but the "
                "decode published attention-TP rank %d",
                mooncake_session_id,
                dst_tp_rank,
                peer.attn_tp_rank,
            )
            return note_status(mooncake_session_id, REFUSED)
        return self.send_kvcache(
            mooncake_session_id,
            prefill_kv_indices,
            dst_kv_ptrs,
            dst_kv_indices,
            executor,
            dst_layer_ids,
            None,
            dst_kv_item_len,
            dst_attn_tp_size,
        )

    # -- decode role: publish the layout ---------------------------------------------------

    def build_receiver_registration_message(self) -> list[bytes]:
        frames: list[bytes] = super().build_receiver_registration_message()  # type: ignore[misc]
        session_id = frames[3].decode("ascii")
        own = self.kvwire_endpoint
        backend = self.kvwire_connection.name if own is not None else None
        return [*frames, layout_frame(session_id, self.kvwire_layout, own, backend)]

    # -- prefill role: wire each registering decode as a kvwire peer ------------------------

    def _make_worker_recv(self, socket: Any, timeout_ms: int = 500) -> Callable[[], Any]:
        recv: Callable[[], Any] = super()._make_worker_recv(socket, timeout_ms)  # type: ignore[misc]

        def recv_noting_layouts() -> Any:
            frames = recv()
            if frames is not None and len(frames) > 3 and frames[0] == b"None":  # a decode's registration
                self._kvwire_note_registration(frames)
            return frames

        return recv_noting_layouts

    def _kvwire_note_registration(self, frames: Sequence[bytes]) -> None:
        session_id = bytes(frames[3]).decode("ascii", "replace")
        try:
            published = published_from_frames(frames, session_id)
        except Exception as exc:  # whatever a peer sends, sglang's bootstrap thread goes on
            log.error("kvwire: decode session %.200s sent a layout kvwire refuses: %s", session_id, _said(exc))
            return
        if published is not None:
            with self._kvwire_lock:
                self._kvwire_registered[session_id] = published

    def _publish_peer_registration(self, mooncake_session_id: str, decode_kv_args: Any) -> Any:
        verdict = super()._publish_peer_registration(mooncake_session_id, decode_kv_args)  # type: ignore[misc]
        with self._kvwire_lock:
            published = self._kvwire_registered.pop(mooncake_session_id, None)
        try:
            endpoint, peer = self._kvwire_peer(published, decode_kv_args)
            with self._kvwire_lock:
                self._kvwire_endpoints.pop(mooncake_session_id, None)
            self.kvwire_connection.add_peer(endpoint, peer)
            with self._kvwire_lock:
                self._kvwire_endpoints[mooncake_session_id] = endpoint
            if peer.is_split and "device_kv_indices" not in self.kvwire_connection.capabilities:
                log.error(
                    "kvwire: decode session %s is a HiSparse split destination (host and device buffers), but "
                    "backend %r cannot address device buffers: its sends are refused (status -22); install "
                    "kvwire-hisparse on the prefill (pip install kvwire-hisparse)",
                    mooncake_session_id,
                    self.kvwire_connection.name,
                )
        except Exception as exc:  # the decode stays unknown to kvwire (or is forgotten): its sends are refused
            # whatever the decode registered, sglang's bootstrap thread goes on (a peer's input never raises here)
            log.error("kvwire: decode session %.200s: %s; sends to it are refused", mooncake_session_id, _said(exc))
            try:
                self.kvwire_connection.remove_peer(self.kvwire_endpoint_of(mooncake_session_id))
            except Exception as gone:  # a session id kvwire refuses was never added: nothing to forget
                log.debug("kvwire: decode session %.200s not forgotten: %s", mooncake_session_id, gone)
        return verdict

    def kvwire_endpoint_of(self, session_id: str) -> str:
        """Where kvwire reaches sglang's decode session ``session_id`` (the one it published, once added)."""
        endpoints: dict[str, str] = getattr(self, "_kvwire_endpoints", {})
        return endpoints.get(session_id, session_id)  # one dict read: atomic, no lock on the send path

    def _kvwire_peer(self, published: Published | None, decode_kv_args: Any) -> tuple[str, KVLayout]:
        """(where kvwire reaches the decode, its layout), checked against what it registered with sglang and
        against this side's engine; LayoutError if unusable.

        A decode rank that published no heads gets them derived as sglang does (:func:`peer_heads`).
        """
        if published is None:
            raise LayoutError(
                "registered without a kvwire layout (install kvwire-sglang on the decode side and enable it: "
                "SGLANG_PLUGINS=kvwire)"
            )
        ours = self.kvwire_connection.name if self.kvwire_endpoint is not None else None
        if published.backend != ours:
            raise LayoutError(
                f"the decode's kvwire runs on {_engine_of(published.backend)}, this prefill's on {_engine_of(ours)}: "
                f"set {BACKEND_ENV} to the same backend on both sides"
            )
        registered = [int(p) for p in decode_kv_args.dst_kv_ptrs]
        bases = [b.base for b in published.layout.buffers]
        if registered != bases:
            raise LayoutError(
                f"published buffers at {[hex(p) for p in bases[:8]]} but registered dst_kv_ptrs "
                f"{[hex(p) for p in registered[:8]]} with sglang"
            )
        layout, local = published.layout, self.kvwire_layout
        if layout.heads is None and local.heads is not None and layout.attention == "mha":
            heads = peer_heads(local.heads, layout)
            return published.endpoint, KVLayout(layout.buffers, layout.attn_tp_size, layout.attn_tp_rank, heads)
        return published.endpoint, layout

    def teardown(self) -> None:
        try:
            super().teardown()  # type: ignore[misc]
        finally:
            self.kvwire_connection.close()
