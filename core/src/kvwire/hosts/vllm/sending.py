"""The prefill worker's side: write a finished request's blocks into the decode's once both are known.

Two things must meet, in either order: the scheduler's word that a request
finished and which blocks hold it (:meth:`Sender.mark_ready`, from the step's
metadata) and the decode's :class:`~kvwire.hosts.vllm.registration.Registration`
(:meth:`Sender.handle`, on the side channel's thread). Then one
``submit_kvcache`` writes every layer's blocks, with the decode's request id as
the arrival notification, and the request is reported in ``finished_sending``
when the write ends (vLLM then frees the blocks). A write that fails sends the
decode a failure notice (:mod:`~kvwire.hosts.vllm.notices`), so the decode frees
its blocks at once. A request nobody registers for within the lease is reported
all the same, so its blocks are freed.

Checked before anything moves, each refusal answered to the decode as
``{"error": ...}``: the layer names, the order of the blocks' bytes (head-major,
token-major, MLA latent: the same on both sides), the TP size and rank, every
block id against the two layouts, and that the prefill block ids are the ones the request holds
(a decode cannot read another request's blocks).

Equal TP sizes: rank ``r`` writes decode rank ``r``'s whole blocks. Different
TP sizes (both layouts record their heads, see
:func:`~kvwire.hosts.vllm.layout.layout_from_kv_caches`): this rank accepts a
decode rank routed to it (:func:`kvwire.planning.head_slicing.senders`) and
writes the heads the two share, one run per block (nothing, for a replica of a
head another sender covers); its notification names this rank
(:func:`~kvwire.hosts.vllm.registration.notification_for`), since the decode
waits for every one of its senders.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict, deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from kvwire.errors import InvalidTransferError, KvwireError
from kvwire.hosts.vllm.layout import BLOCK_ORDERS
from kvwire.hosts.vllm.metadata import ReadyToSend
from kvwire.hosts.vllm.notices import failure_notice_for
from kvwire.hosts.vllm.rank import KEPT_FAILURES, WorkerRank
from kvwire.hosts.vllm.registration import Registration, notification_for, with_token
from kvwire.planning.head_slicing import senders, slicing_of

__all__ = ["MAX_REMEMBERED", "MAX_WAITING", "Sender"]

log = logging.getLogger("kvwire.hosts.vllm")

#: Seconds kept between a write's latest end and the moment its decode stops waiting (message delays).
_MARGIN_S = 1.0
#: Most registrations kept waiting for requests this prefill does not hold (yet); past it one more is refused.
MAX_WAITING: Final = 1024
#: Most requests whose blocks were freed (written, or unclaimed at the lease's end) remembered, so that a
#: registration for one is refused at once instead of waiting for blocks that will never come.
MAX_REMEMBERED: Final = 4096


@dataclass
class _Ready:
    block_ids: tuple[int, ...]
    deadline: float
    started: bool = False
    in_flight: int = 0  # writes started and not ended
    decode_tp: int | None = None  # across TP sizes: the decode's TP size (of the first registration)
    sent_to: set[int] = field(default_factory=set)  # across TP sizes: decode ranks a write was started for
    expected: int | None = None  # across TP sizes: how many decode ranks this rank writes


class Sender:
    """Matches ready requests with registrations and writes them (see the module docstring)."""

    def __init__(self, rank: WorkerRank, lease_s: float) -> None:
        self._connection, self._local, self._clock, self._stats = rank.connection, rank.local, rank.clock, rank.stats
        self._tp_rank, self._tp_size = rank.tp_rank, rank.tp_size
        self._lease_s = lease_s
        self._lock = threading.RLock()  # a future that is already done runs its callback at once
        self._ready: dict[str, _Ready] = {}
        # request -> decode rank (None: equal TP sizes) -> (registration, when the decode stops waiting,
        # when it stops waiting here: at most lease_s after it came)
        self._waiting: dict[str, dict[int | None, tuple[Registration, float, float]]] = {}
        self._done: set[str] = set()
        self._gone: OrderedDict[str, str] = OrderedDict()  # request -> why its blocks are no longer here
        self._peers: dict[str, Any] = {}  # endpoint -> the layout add_peer was given
        self.failures: deque[str] = deque(maxlen=KEPT_FAILURES)  # the latest refusals and failed writes

    def mark_ready(self, item: ReadyToSend) -> None:
        """The scheduler finished ``item.request_id``: its blocks may go to the decode that registers."""
        with self._lock:
            self._ready[item.request_id] = _Ready(tuple(item.block_ids), self._clock() + self._lease_s)
            self._gone.pop(item.request_id, None)
            for registration, decode_gives_up, _ in self._waiting.pop(item.request_id, {}).values():
                try:
                    self._start(registration, decode_gives_up)
                except Exception as exc:  # this runs in vLLM's step: log it, never raise it there
                    reason = str(exc) if isinstance(exc, KvwireError) else f"{type(exc).__name__}: {exc}"
                    self.failures.append(reason)
                    log.error("kvwire: request %s: refused the decode's registration: %s", item.request_id, reason)

    def handle(self, message: dict[str, Any]) -> dict[str, Any]:
        """Answer one side-channel message: start (or queue) the write, or ``{"error": why}``."""
        try:
            registration = Registration.from_dict(message)
            self._check(registration)
            decode_gives_up = self._clock() + registration.valid_for_s
            request_id = registration.prefill_request_id
            with self._lock:
                if request_id in self._ready:
                    self._start(registration, decode_gives_up)
                    return {"accepted": request_id}
                gone = self._gone.get(request_id)
                if gone is not None:
                    raise InvalidTransferError(f"request {request_id!r}: {gone}; nothing was sent")
                rank = None if registration.tp_size == self._tp_size else registration.tp_rank
                queued = self._waiting.get(request_id, {})
                if rank in queued:
                    who = "the decode" if rank is None else f"decode rank {rank}"
                    raise InvalidTransferError(
                        f"registration for {request_id!r}: one from {who} already waits for this request; a "
                        "second is refused (the first stands)"
                    )
                if sum(map(len, self._waiting.values())) >= MAX_WAITING:
                    raise InvalidTransferError(
                        f"registration for {request_id!r}: {MAX_WAITING} registrations already wait for requests "
                        "this prefill does not hold (yet), the most it keeps; refused (nothing was sent)"
                    )
                expires = min(decode_gives_up, self._clock() + self._lease_s)
                self._waiting.setdefault(request_id, {})[rank] = (registration, decode_gives_up, expires)
                return {"queued": request_id}
        except KvwireError as exc:  # LayoutError and InvalidTransferError included: the decode is told why
            self.failures.append(str(exc))
            self._stats.record_refusal()
            return {"error": str(exc)}

    def _check(self, reg: Registration) -> None:
        """Everything checkable without the scheduler's record: layers, TP, block ids against both layouts."""
        if reg.layers != self._local.layer_names:
            raise InvalidTransferError(
                f"registration for {reg.prefill_request_id!r}: the decode's layers {list(reg.layers)[:4]}... "
                f"({len(reg.layers)}) are not this prefill's {list(self._local.layer_names)[:4]}... "
                f"({len(self._local.layer_names)}): run the same model on both sides"
            )
        if reg.block_order != self._local.order:
            raise InvalidTransferError(
                f"registration for {reg.prefill_request_id!r}: the decode's blocks are {reg.block_order} "
                f"({BLOCK_ORDERS[reg.block_order]}), this prefill's {self._local.order} "
                f"({BLOCK_ORDERS[self._local.order]}): a whole block would land with its bytes in another order; "
                "run both sides with the same KV-cache layout and attention kind (nothing was sent)"
            )
        theirs, ours = len(reg.peer.layout.buffers), len(self._local.layout.buffers)
        if theirs != ours:
            raise InvalidTransferError(
                f"registration for {reg.prefill_request_id!r}: the decode's layout has {theirs} buffers, this "
                f"prefill's {ours} (one per layer); nothing was sent"
            )
        if reg.tp_size == self._tp_size:
            if reg.tp_rank != self._tp_rank:
                raise InvalidTransferError(
                    f"registration for {reg.prefill_request_id!r}: the decode is TP rank {reg.tp_rank} of "
                    f"{reg.tp_size}, this prefill worker rank {self._tp_rank} of {self._tp_size}: kvwire's vLLM "
                    "connector moves whole blocks between equal TP sizes, rank to rank"
                )
        else:
            self._check_across_tp(reg)
        self._local.check_block_ids(reg.prefill_block_ids, "prefill_block_ids")
        peer_pages = reg.peer.layout.buffers[0].num_pages
        for i, b in enumerate(reg.decode_block_ids):
            if not 0 < b < peer_pages:
                raise InvalidTransferError(
                    f"decode_block_ids[{i}] = {b} is not a block of the decode's KV cache: ids run "
                    f"1..{peer_pages - 1} (block 0 is vLLM's null block); nothing was sent"
                )

    def _check_across_tp(self, reg: Registration) -> None:
        """A decode of another TP size: both layouts record their TP rank (and heads, but for MLA), and this
        rank is one of its senders."""
        what = (
            f"registration for {reg.prefill_request_id!r}: the decode is TP rank {reg.tp_rank} of {reg.tp_size}, "
            f"this prefill worker rank {self._tp_rank} of {self._tp_size}"
        )
        local, peer = self._local.layout, reg.peer.layout
        if self._local.tp_refusal is not None:
            raise InvalidTransferError(
                f"{what}: this prefill's KV cache cannot move across TP sizes: {self._local.tp_refusal}"
            )
        if peer.attn_tp_rank is None or (reg.block_order != "latent" and peer.heads is None):
            raise InvalidTransferError(
                f"{what}: different TP sizes need both KV caches described by KV head, and the "
                "decode's is not (its connector was not given the model's total KV heads: vllm_config.model_config)"
            )
        if (peer.attn_tp_size, peer.attn_tp_rank) != (reg.tp_size, reg.tp_rank):
            raise InvalidTransferError(
                f"{what}, but the decode's layout records TP rank {peer.attn_tp_rank} of {peer.attn_tp_size}; "
                "nothing was sent"
            )
        big, small = max(reg.tp_size, self._tp_size), min(reg.tp_size, self._tp_size)
        if big % small:
            raise InvalidTransferError(
                f"{what}: the larger TP size must be a multiple of the smaller; nothing was sent"
            )
        routed = senders(self._tp_size, reg.tp_size, reg.tp_rank)
        if self._tp_rank not in routed:
            who = f"rank {routed[0]}" if len(routed) == 1 else f"ranks {routed[0]}..{routed[-1]}"
            raise InvalidTransferError(
                f"{what}: decode rank {reg.tp_rank} receives from prefill {who}, not from this one; register "
                "with the prefill ranks routed to it (nothing was sent)"
            )
        slicing_of(local, peer)  # the heads' geometry (head size, dtype, block size, KV heads) must agree

    def _start(self, reg: Registration, decode_gives_up: float) -> None:
        """Submit the write (the lock is held); InvalidTransferError before anything moves.

        A write is started only if it ends (at the latest, failed by the backend's ``timeout_s``) before
        the decode stops waiting: after that the decode frees its blocks, and vLLM may reuse them.
        """
        request_id = reg.prefill_request_id
        ready = self._ready[request_id]
        across = reg.tp_size != self._tp_size
        if across and ready.decode_tp not in (None, reg.tp_size):
            raise InvalidTransferError(
                f"request {request_id!r}: its blocks go to a decode of TP size {ready.decode_tp}, and this "
                f"registration is from one of TP size {reg.tp_size}; nothing was sent"
            )
        if across and reg.tp_rank in ready.sent_to:
            raise InvalidTransferError(
                f"request {request_id!r}: its blocks were already sent to decode rank {reg.tp_rank}"
            )
        if not across and ready.started:
            raise InvalidTransferError(f"request {request_id!r}: its blocks were already sent to a decode")
        latest_end = self._clock() + self._connection.config.timeout_s + _MARGIN_S
        if latest_end > decode_gives_up:
            raise InvalidTransferError(
                f"request {request_id!r}: the decode stops waiting in {decode_gives_up - self._clock():.2f} s, "
                f"before a write could be sure to end (transfer_timeout_s = {self._connection.config.timeout_s:g} s); "
                "not started (raise load_timeout_s on the decode above transfer_timeout_s)"
            )
        held = ready.block_ids[len(ready.block_ids) - len(reg.prefill_block_ids) :]
        if len(reg.prefill_block_ids) > len(ready.block_ids) or tuple(reg.prefill_block_ids) != held:
            raise InvalidTransferError(
                f"prefill_block_ids {list(reg.prefill_block_ids)[:8]} are not the blocks request {request_id!r} "
                f"holds ({list(ready.block_ids)[:8]}, or their tail); nothing was sent"
            )
        endpoint, layout = reg.peer.endpoint, reg.peer.layout
        if self._peers.get(endpoint) != layout:
            self._connection.add_peer(endpoint, layout)
            self._peers[endpoint] = layout
        started = self._clock()
        future = self._connection.submit_kvcache(
            endpoint,
            np.asarray(reg.prefill_block_ids, dtype=np.int32),
            [b.base for b in layout.buffers],
            np.asarray(reg.decode_block_ids, dtype=np.int32),
            notification=with_token(
                reg.token,
                notification_for(reg.decode_request_id, None if reg.tp_size == self._tp_size else self._tp_rank),
            ),
        )
        ready.started = True
        ready.in_flight += 1
        if across:
            ready.decode_tp = reg.tp_size
            ready.sent_to.add(reg.tp_rank)
            ready.expected = sum(self._tp_rank in senders(self._tp_size, reg.tp_size, d) for d in range(reg.tp_size))
        rank = None if reg.tp_size == self._tp_size else self._tp_rank
        notice = (endpoint, reg.decode_request_id, rank, reg.token)
        future.add_done_callback(lambda f: self._written(request_id, f, notice, started))

    def _written(
        self, request_id: str, future: Future[int], notice: tuple[str, str, int | None, str | None], started: float
    ) -> None:
        error = future.exception() if not future.cancelled() else None
        if error is None and not future.cancelled():
            self._stats.record_write(self._clock() - started, future.result(), getattr(future, "descriptors", None))
        else:
            self._stats.record_failed_write()
            reason = f"request {request_id!r}: the write failed: {error or 'cancelled'}"
            self.failures.append(reason)
            log.error("kvwire: %s", reason)
            endpoint, decode_request_id, rank, token = notice
            why = f"the write failed: {error or 'cancelled'}"
            message = failure_notice_for(decode_request_id, rank, why, token)
            threading.Thread(  # not on the transport's completion thread: a dead decode may block the send
                target=self._tell_decode, args=(endpoint, message), name="kvwire-vllm-failure-notice", daemon=True
            ).start()
        with self._lock:
            ready = self._ready.get(request_id)
            if ready is None:
                return
            ready.in_flight -= 1
            if ready.in_flight <= 0 and (ready.expected is None or len(ready.sent_to) >= ready.expected):
                del self._ready[request_id]  # written to every decode rank it goes to: vLLM may free it
                self._done.add(request_id)
                self._forget(request_id, "its blocks were written to a decode and freed")

    def _forget(self, request_id: str, why: str) -> None:
        """Remember that ``request_id``'s blocks are gone, and why (the latest :data:`MAX_REMEMBERED`)."""
        self._gone[request_id] = why
        while len(self._gone) > MAX_REMEMBERED:
            self._gone.popitem(last=False)

    def _tell_decode(self, endpoint: str, message: bytes) -> None:
        """Send the decode the failure notice (its blocks are free for vLLM at once); a failure is logged."""
        try:
            self._connection.send_notification(endpoint, message)
        except KvwireError as exc:  # the decode still fails the request at load_timeout_s
            log.error("kvwire: the failure notice to %.60s was not sent: %s", endpoint, exc)

    def finished(self) -> set[str]:
        """Requests whose blocks vLLM may free: written (or failed), or unclaimed past the lease."""
        now = self._clock()
        with self._lock:
            for request_id, ready in list(self._ready.items()):
                if ready.in_flight <= 0 and ready.deadline <= now:
                    if ready.sent_to:
                        log.warning(
                            "kvwire: request %s: only decode ranks %s asked for its blocks within the lease",
                            request_id,
                            sorted(ready.sent_to),
                        )
                    else:
                        log.warning("kvwire: request %s: no decode asked for its blocks within the lease", request_id)
                    del self._ready[request_id]
                    self._done.add(request_id)
                    self._forget(
                        request_id,
                        f"its lease ended (lease_s = {self._lease_s:g} s) and its blocks were freed"
                        + (" after the writes to other decode ranks" if ready.sent_to else ""),
                    )
            for request_id, queued in list(self._waiting.items()):
                for rank, (_, _, expires) in list(queued.items()):
                    if expires <= now:
                        del queued[rank]
                if not queued:
                    del self._waiting[request_id]
            done, self._done = self._done, set()
        return done
