"""The decode worker's side: register a request's blocks with its prefill, then learn they arrived or failed.

For each :class:`~kvwire.hosts.vllm.metadata.ToReceive` the worker checks the
block ids (the decode's own against its cache; the prefill's count against its
own), maps them (block ``i`` of the prefill's tail lands on block ``i`` of the
decode's: prefix-cache hits here shorten the decode's list) and sends a
:class:`~kvwire.hosts.vllm.registration.Registration` to the prefill worker of
its TP rank. The request is done when the prefill's arrival notification comes
(the bytes are in place by then), and failed when the prefill refuses, cannot be
reached, sends a failure notice for a write it had accepted
(:mod:`~kvwire.hosts.vllm.notices`), or nothing arrives within
``load_timeout_s``: then it is reported in ``finished_recving`` and its blocks
by ``get_block_ids_with_load_errors`` in the same step, as vLLM asks.

A prefill of another TP size ``P`` (this decode rank ``d`` of ``D``): the
worker registers with every prefill rank that sends to it
(:func:`kvwire.planning.head_slicing.senders`: rank ``d * P // D``, or the
``P // D`` ranks from there), at ``remote_port + rank``, and each sender's
notification names its rank. The request is done when every sender's arrived;
it fails when any sender refuses, cannot be reached, or has not arrived within
``load_timeout_s``. A failure is reported once every other sender is settled
(refused, unreachable or arrived) or the deadline passed, so that no accepted
write can still land in blocks vLLM frees.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from kvwire.connection.watcher import Arrival, NotificationWatcher
from kvwire.errors import InvalidTransferError
from kvwire.hosts.vllm.channel import RegistrationClient, ReplyCallback
from kvwire.hosts.vllm.metadata import ToReceive
from kvwire.hosts.vllm.notices import FailureNotice, parse_failure_notice
from kvwire.hosts.vllm.rank import KEPT_FAILURES, WorkerRank
from kvwire.hosts.vllm.registration import (
    Registration,
    new_token,
    parse_notification,
    split_token,
    token_matches,
)
from kvwire.layout.buffers import LayoutError
from kvwire.layout.peer import PeerDescription
from kvwire.planning.head_slicing import senders

__all__ = ["Receiver"]

log = logging.getLogger("kvwire.hosts.vllm")


@dataclass
class _Pending:
    block_ids: tuple[int, ...]
    deadline: float
    senders: frozenset[int | None]  # prefill ranks that write here (None: the one sender of equal TP sizes)
    arrived: set[int | None]
    settled: set[int | None]  # arrived, refused or unreachable
    failure: str | None = None  # the first sender's failure
    registered: set[int | None] = field(default_factory=set)  # senders the registration was handed to
    token: str | None = None  # the registration's: only notifications and notices tagged with it count


class Receiver:
    """Tracks the decode's requests from registration to arrival or failure (see the module docstring)."""

    def __init__(self, rank: WorkerRank, client: RegistrationClient, load_timeout_s: float) -> None:
        connection, self._local, self._clock, self._stats = rank.connection, rank.local, rank.clock, rank.stats
        self._tp_rank, self._tp_size = rank.tp_rank, rank.tp_size
        self._client = client
        self._timeout_s = load_timeout_s
        self._peer = PeerDescription(connection.endpoint(), self._local.layout)
        self._lock = threading.Lock()
        self._pending: dict[str, _Pending] = {}
        self._errors: set[int] = set()
        self.failures: dict[str, str] = {}  # request id -> why it failed (the latest KEPT_FAILURES)
        #: Notifications and notices ignored for lacking their registration's token (not from its senders).
        self.spoofed = 0
        self._connection = connection
        self._closed = False
        self.watcher_restarts = 0
        self._watcher = self._new_watcher()

    def _new_watcher(self) -> NotificationWatcher:
        return NotificationWatcher(self._connection, self._on_arrival, max_kept=0, name="kvwire-vllm-arrivals")

    def _keep_watching(self) -> None:
        """A watcher stopped by a failed poll is logged and replaced (each step): arrivals never stop silently."""
        if self._closed or self._watcher.running:
            return
        error = self._watcher.error
        self.watcher_restarts += 1
        log.error(
            "kvwire: the decode's notification watcher stopped (%s: %s); restarting it (restart %d)",
            type(error).__name__,
            error,
            self.watcher_restarts,
        )
        try:
            self._watcher = self._new_watcher()
        except Exception as exc:  # the backend cannot poll now: the next step tries again
            log.error("kvwire: restarting the notification watcher failed: %s", exc)

    def _senders(self, tp_size: int) -> tuple[int | None, ...]:
        """The prefill ranks that write this rank's blocks (None: rank to rank, equal TP sizes)."""
        if tp_size == self._tp_size:
            return (None,)
        return tuple(senders(tp_size, self._tp_size, self._tp_rank))

    def start(self, item: ToReceive) -> None:
        """Register ``item``'s blocks with its prefill ranks (a refusal here fails it at the next :meth:`finished`)."""
        remote = item.remote
        valid = tuple(b for b in item.block_ids if isinstance(b, int) and 0 < b < self._local.num_blocks)
        ranks = self._senders(remote.tp_size)
        token = new_token()
        with self._lock:
            self._pending[item.request_id] = _Pending(
                valid, self._clock() + self._timeout_s, frozenset(ranks), set(), set(), token=token
            )
        try:
            local = self._local.check_block_ids(item.block_ids, "decode block_ids")
            if not local or len(local) > len(remote.block_ids):
                raise InvalidTransferError(
                    f"request {item.request_id!r}: {len(local)} decode blocks for {len(remote.block_ids)} prefill "
                    "blocks; the decode can take at most the prefill's blocks"
                )
            if remote.tp_size != self._tp_size and self._local.tp_refusal is not None:
                raise InvalidTransferError(
                    f"request {item.request_id!r}: the prefill runs TP size {remote.tp_size}, this decode "
                    f"{self._tp_size}, and this decode's KV cache cannot move across TP sizes: "
                    f"{self._local.tp_refusal}"
                )
        except (InvalidTransferError, LayoutError) as exc:
            self._fail(item.request_id, None, f"refused before anything moved: {exc}", every=True)
            return
        registration = Registration(
            prefill_request_id=remote.request_id,
            decode_request_id=item.request_id,
            prefill_block_ids=remote.block_ids[len(remote.block_ids) - len(local) :],
            decode_block_ids=tuple(local),
            layers=self._local.layer_names,
            tp_rank=self._tp_rank,
            tp_size=self._tp_size,
            valid_for_s=max(0.001, self._deadline_of(item.request_id) - self._clock()),
            peer=self._peer,
            block_order=self._local.order,
            token=token,
        )
        message = registration.to_dict()
        for rank in ranks:
            self._client.send(
                remote.host,
                remote.port + (self._tp_rank if rank is None else rank),
                message,
                self._on_reply(item.request_id, rank, remote.tp_size),
            )
            with self._lock:
                self._pending[item.request_id].registered.add(rank)

    def fail_request(self, item: ToReceive, reason: str) -> None:
        """:meth:`start` failed for ``item``: it fails, reported (its blocks as load errors) once every sender
        its registration was handed to is settled, as for a refusal; the senders it never reached are settled."""
        log.error("kvwire: request %s: %s", item.request_id, reason)
        with self._lock:
            pending = self._pending.get(item.request_id)
            if pending is None:
                valid = tuple(b for b in item.block_ids if isinstance(b, int) and 0 < b < self._local.num_blocks)
                pending = self._pending[item.request_id] = _Pending(
                    valid, self._clock() + self._timeout_s, frozenset({None}), set(), set()
                )
            if pending.failure is None:
                pending.failure = reason
            pending.settled.update(pending.senders - pending.registered)

    def _on_reply(self, request_id: str, rank: int | None, tp_size: int) -> ReplyCallback:
        """The callback for sender ``rank``'s answer to ``request_id``'s registration."""
        return lambda reply, reason: self._answered(request_id, rank, tp_size, reply, reason)

    def _deadline_of(self, request_id: str) -> float:
        with self._lock:
            return self._pending[request_id].deadline

    def _answered(
        self, request_id: str, rank: int | None, tp_size: int, reply: dict[str, Any] | None, reason: str | None
    ) -> None:
        if reply is None:
            who = "the prefill" if rank is None else f"prefill rank {rank} (of {tp_size})"
            self._fail(request_id, rank, f"{who} did not take the registration: {reason}")

    def _fail(self, request_id: str, rank: int | None, reason: str, *, every: bool = False) -> None:
        """Sender ``rank`` failed the request (``every``: all of them, nothing was sent)."""
        log.error("kvwire: request %s: %s", request_id, reason)
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is None:
                return
            if pending.failure is None:
                pending.failure = reason
            pending.settled.update(pending.senders if every else (rank,))

    def _on_arrival(self, arrival: Arrival) -> None:
        try:
            self._take_arrival(arrival)
        except Exception as exc:  # one message kvwire cannot read: that message only, the watcher goes on
            log.error(
                "kvwire: ignored a notification (%r...): %s: %s",
                arrival.notification.message[:60],
                type(exc).__name__,
                exc,
            )

    def _take_arrival(self, arrival: Arrival) -> None:
        token, message = split_token(arrival.notification.message)
        notice = parse_failure_notice(message)
        if notice is not None:
            self._failed_write(notice, token)
            return
        parsed = parse_notification(message)
        if parsed is None:
            return
        request_id, rank = parsed
        with self._lock:
            pending = self._pending.get(request_id)
            if pending is not None and rank in pending.senders:
                if not token_matches(pending.token, token):
                    self._spoofed(request_id, "arrival notification")
                    return
                pending.arrived.add(rank)
                pending.settled.add(rank)

    def _spoofed(self, request_id: str, what: str) -> None:
        """A message naming ``request_id`` without its registration's token: not from a sender it reached."""
        self.spoofed += 1
        if self.spoofed == 1 or self.spoofed % 1000 == 0:  # a flood is not a flood of log lines
            log.warning(
                "kvwire: request %s: ignored an %s without the token its registration carried (not from a prefill "
                "it registered with; %d so far)",
                request_id,
                what,
                self.spoofed,
            )

    def _failed_write(self, notice: FailureNotice, token: str | None) -> None:
        """A sender's write failed: that sender is settled, and the request fails once every sender is."""
        with self._lock:
            pending = self._pending.get(notice.request_id)
            if pending is None or notice.prefill_rank not in pending.senders:
                return  # not a request of this rank, or not from one of its senders
            if not token_matches(pending.token, token):
                self._spoofed(notice.request_id, "failure notice")
                return
        rank = notice.prefill_rank
        who = "the prefill" if rank is None else f"prefill rank {rank}"
        self._fail(notice.request_id, rank, f"{who} failed writing its blocks: {notice.reason}")

    def finished(self) -> set[str]:
        """Requests done receiving (arrived, or failed: their blocks then go to :meth:`load_errors`)."""
        self._keep_watching()
        now = self._clock()
        done: set[str] = set()
        with self._lock:
            for request_id, pending in list(self._pending.items()):
                if pending.failure is None and pending.arrived == pending.senders:
                    pass
                elif pending.settled == pending.senders or pending.deadline <= now:
                    reason = pending.failure or self._timeout_reason(pending)
                    self.failures[request_id] = reason
                    while len(self.failures) > KEPT_FAILURES:
                        del self.failures[next(iter(self.failures))]
                    self._errors.update(pending.block_ids)
                    self._stats.record_failed_load()
                else:
                    continue
                del self._pending[request_id]
                done.add(request_id)
        return done

    def _timeout_reason(self, pending: _Pending) -> str:
        reason = f"its blocks did not arrive within load_timeout_s = {self._timeout_s:g} s"
        missing = sorted(r for r in pending.senders - pending.arrived if r is not None)
        return f"{reason} (from prefill ranks {missing})" if missing else reason

    def load_errors(self) -> set[int]:
        """Blocks of the requests that failed since the last call (reported with them by :meth:`finished`)."""
        with self._lock:
            errors, self._errors = self._errors, set()
        return errors

    @property
    def pending(self) -> int:
        """Requests registered and not finished yet."""
        with self._lock:
            return len(self._pending)

    def close(self) -> None:
        self._closed = True
        try:
            self._watcher.stop()
        except Exception as exc:  # what stopped it was logged when it was restarted, or is logged now
            log.error("kvwire: the decode's notification watcher had stopped: %s: %s", type(exc).__name__, exc)
