"""``send_kvcache`` as sglang's transfer worker calls it, through a kvwire :class:`~kvwire.Connection`.

:class:`KvwireSendMixin` has exactly the parameter list of sglang's
``MooncakeKVManager.send_kvcache`` (0.5.18 to 0.5.23, names and annotations as
sglang writes them; a test reads sglang's released wheel to keep it so). It
answers the way sglang's transfer worker expects: ``0`` on success, a non-zero
status on failure (``if ret != 0`` marks the session failed), with the typed
kvwire error logged; it never raises into the worker loop for a transfer failure.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import List, Optional  # noqa: UP035 - sglang's annotations, verbatim

import numpy as np
import numpy.typing as npt

from kvwire.connection import Connection
from kvwire.errors import (
    InvalidTransferError,
    KvwireError,
    PeerUnreachableError,
    TransferTimeoutError,
    UnsupportedFeatureError,
)
from kvwire.planning.pairing import layer_id_list
from kvwire_sglang.layout import sglang_layer_ids

__all__ = ["REFUSED", "STATUS_CODES", "FailedSessions", "KvwireSendMixin", "SglangSender", "note_status", "status_of"]

log = logging.getLogger("kvwire.sglang")

#: The status of a send kvwire refused for the caller's own input: the peer was never contacted.
REFUSED = -22

#: The non-zero status returned for each kvwire error class (most specific first); anything else is -1.
STATUS_CODES: Mapping[type[KvwireError], int] = {
    InvalidTransferError: REFUSED,  # bad input, refused before any byte moved
    UnsupportedFeatureError: REFUSED,  # input this backend cannot serve (dst_device_kv_indices without kvwire-hisparse)
    TransferTimeoutError: -110,  # the peer did not complete in time
    PeerUnreachableError: -102,  # Mooncake's ERR_SOCKET: dead or unknown peer
}


#: Per transfer thread: the session whose last send kvwire refused (REFUSED), until sglang reacts to it.
_refused = threading.local()


class FailedSessions(set[str]):
    """sglang's ``failed_sessions`` (its blacklist of dead decode sessions), told refusals from failures.

    sglang's ``transfer_worker`` blacklists a session after any non-zero status from a send (the
    failed-session probe un-blacklists it later). A refusal of the caller's own input (a bad
    page index, a feature the backend lacks: status -22) says nothing about the peer, so the
    request fails as sglang fails it, but the session is not added: the next request to that
    decode is sent. Any other status (a dead or frozen peer) blacklists it as sglang does.
    """

    def __init__(self, sessions: Iterable[str] = ()) -> None:
        super().__init__(sessions)

    def add(self, session_id: str) -> None:
        if getattr(_refused, "session", None) == session_id:
            _refused.session = None
            log.warning(
                "kvwire: decode session %s stays in service: kvwire refused the send for its input (status %d); "
                "only that request fails",
                session_id,
                REFUSED,
            )
            return
        super().add(session_id)


def note_status(session_id: str, status: int) -> int:
    """``status``, noted for this thread: a refusal (:data:`REFUSED`) keeps :class:`FailedSessions` from
    blacklisting ``session_id`` when sglang reacts to it next; any other status clears the note."""
    _refused.session = session_id if status == REFUSED else None
    return status


def status_of(error: KvwireError) -> int:
    """The status :meth:`KvwireSendMixin.send_kvcache` returns for ``error`` (never 0)."""
    for cls, code in STATUS_CODES.items():
        if isinstance(error, cls):
            return code
    return -1


class KvwireSendMixin:
    """sglang's ``send_kvcache``, sending through ``self.kvwire_connection``.

    Put it before ``MooncakeKVManager`` in the bases and set
    ``self.kvwire_connection`` (a :class:`kvwire.Connection` with the local
    layout registered, and each decode peer added under its session id).
    ``dst_layer_ids`` is taken as sglang builds it (:func:`layer_ids_from_sglang`).
    """

    kvwire_connection: Connection

    def send_kvcache(
        self,
        mooncake_session_id: str,
        prefill_kv_indices: npt.NDArray[np.int32],
        dst_kv_ptrs: list[int],
        dst_kv_indices: npt.NDArray[np.int32],
        executor: concurrent.futures.ThreadPoolExecutor,
        dst_layer_ids: Optional[List[int]] = None,  # noqa: UP006, UP045 - sglang's annotation
        dst_device_kv_indices: Optional[npt.NDArray[np.int32]] = None,  # noqa: UP045 - sglang's annotation
        dst_kv_item_len: Optional[int] = None,  # noqa: UP045 - sglang's annotation
        dst_attn_tp_size: Optional[int] = None,  # noqa: UP045 - sglang's annotation
    ) -> int:
        """0 when every page arrived; a non-zero status from :data:`STATUS_CODES` when kvwire refused or failed."""
        try:
            self.kvwire_connection.send_kvcache(
                self.kvwire_endpoint_of(mooncake_session_id),
                prefill_kv_indices,
                dst_kv_ptrs,
                dst_kv_indices,
                executor,
                self.kvwire_dst_layer_ids(mooncake_session_id, dst_layer_ids),
                dst_device_kv_indices,
                dst_kv_item_len,
                dst_attn_tp_size,
            )
        except KvwireError as exc:
            status = status_of(exc)
            log.error(
                "kvwire send_kvcache to session %s failed (status %d, peer %s): %s: %s",
                mooncake_session_id,
                status,
                getattr(exc, "peer", None) or mooncake_session_id,
                type(exc).__name__,
                exc,
            )
            return note_status(mooncake_session_id, status)
        return note_status(mooncake_session_id, 0)

    def kvwire_endpoint_of(self, session_id: str) -> str:
        """Where kvwire reaches sglang's decode session ``session_id``: the session id itself, when kvwire
        rides sglang's Mooncake engine; the endpoint of kvwire's own engine otherwise (the manager overrides)."""
        return session_id

    def kvwire_dst_layer_ids(self, session_id: str, dst_layer_ids: Sequence[int] | None) -> list[int] | None:
        """kvwire's ``dst_layer_ids`` (one per local layer, or None: same layer numbers) for sglang's.

        sglang pairs a prefill entry with the decode entry of the same layer id (the next unused
        one, so K before V: ``build_transfer_entry_pairs``), and kvwire's layouts carry those very
        ids (the decode's, published, and this side's from ``kv_args``). So when ``dst_layer_ids`` is
        the decode's registered list, one id per buffer of its published layout (hybrid pools,
        draft KV in sglang's band included), kvwire's answer is None: each layer lands on the
        peer's layer of the same number, the decode's extra layers (a draft this side lacks, the
        other pipeline stages') untouched. Any other list is read by :func:`layer_ids_from_sglang`.
        """
        if dst_layer_ids is None:
            return None
        ids = layer_id_list("dst_layer_ids", dst_layer_ids)
        peer = self.kvwire_connection.peer_layout(self.kvwire_endpoint_of(session_id)) if ids else None
        if peer is not None and ids == [b.layer for b in peer.buffers]:
            return None
        return sglang_layer_ids(ids)


class SglangSender(KvwireSendMixin):
    """The mixin on its own, around a connection (for hosts that call sglang's signature without sglang)."""

    def __init__(self, connection: Connection) -> None:
        self.kvwire_connection = connection
