"""``MooncakeEngine``: lifecycle, registration, the checked and recovered write, and the borrow seam.

The other modules of this package each hold one concern; this one puts them
together behind the methods a backend uses: ``register`` / ``unregister`` /
``unregister_all``, ``write``, ``submit``, ``notify`` / ``notifications``,
``endpoint``, ``forget_peer``, ``close``, and :meth:`MooncakeEngine.borrow` for
code that needs the bare engine (benchmarks).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any, Final

import numpy as np
from numpy.typing import NDArray

from kvwire import RegionSet
from kvwire.config import BackendConfig
from kvwire.errors import InvalidTransferError, PeerUnreachableError, TransferError
from kvwire.transport import BusyClock
from kvwire_mooncake.engine import failures, notify
from kvwire_mooncake.engine.arrays import as_addresses, write_arrays
from kvwire_mooncake.engine.binding import (
    P2P_HANDSHAKE,
    TransferEngineLike,
    create_engine,
    default_engine_factory,
    p2p_endpoint,
)
from kvwire_mooncake.engine.confine import Confinement
from kvwire_mooncake.engine.dispatch import Chunk, Dispatcher, Lists, Outcome, Peer
from kvwire_mooncake.engine.environment import prepare_environment
from kvwire_mooncake.engine.periodic import Periodic
from kvwire_mooncake.engine.queues import PeerQueues
from kvwire_mooncake.engine.slots import Slot, Slots
from kvwire_mooncake.engine.workers import Workers
from kvwire_mooncake.options import MooncakeOptions

__all__ = ["MooncakeEngine"]

#: Fewest seconds between two renewals of the sending engine for one peer.
RENEW_INTERVAL_S: Final = 30.0
#: Seconds between two probes of the peers the sending engine wrote to (``sweep_dead_peers``).
SWEEP_INTERVAL_S: Final = 30.0
#: Seconds one probe of a sweep is waited for.
PROBE_WAIT_S: Final = 1.0
#: Forgotten peers the sending engine may keep connections to before it is replaced (see ``forget_peer``).
RECYCLE_AFTER_FORGOTTEN: Final = 64
_NO_RENEWAL: Final = (
    "kvwire does not renew an engine the host supplied (BackendConfig.options['engine']); "
    "recreate it in the host, or let kvwire create its own"
)


class MooncakeEngine:
    """A Mooncake ``TransferEngine`` with exceptions, local checks, chunking, deadlines and recovery.

    Thread-safe: any number of threads may :meth:`write` at once; the descriptors
    in flight to one peer stay <= ``options.max_inflight_per_peer``.

    Args:
        config: host, protocol, metadata server, device, ``timeout_s``, ``verbose``,
            ``process_settings``, and the options of :class:`~kvwire_mooncake.options.MooncakeOptions`.
        engine_factory: returns a new, uninitialised engine with Mooncake's call
            surface (:class:`TransferEngineLike`); default ``mooncake.engine.TransferEngine``,
            imported here. The wrapper may call it again to renew its sending engine.
            Never called when ``config.options['engine']`` hands in the host's engine.

    Raises:
        ConfigError: a bad option.
        BackendUnavailableError: the engine wheel or a system library is missing, or
            the engine failed to initialise (the message carries the engine's log when captured).
    """

    def __init__(self, config: BackendConfig, *, engine_factory: Callable[[], Any] | None = None) -> None:
        self.config = config
        self.options = MooncakeOptions.from_config(config)
        self._p2p = config.metadata_server == P2P_HANDSHAKE
        self._factory: Callable[[], TransferEngineLike] | None = None
        self._confinement = Confinement(config.host)
        engine = self.options.engine
        if engine is None:
            if config.process_settings:
                prepare_environment(config)  # before the import: MC_LOG_LEVEL is read then
            self._factory = engine_factory if engine_factory is not None else default_engine_factory()
            engine, self._confinement = create_engine(
                self._factory, config, restrict_listeners=self.options.restrict_listeners
            )
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # in-flight budgets
        self._admin = threading.RLock()  # register / unregister / renew / close
        self._regions = RegionSet()
        self._slots = Slots(self._lock, engine, owned=self._factory is not None)
        self._renewals = 0
        self._recycles = 0
        port = int(engine.get_rpc_port())
        self._endpoint = p2p_endpoint(config.host, port) if self._p2p else config.host
        self._workers = Workers(f"kvwire-mooncake-{port}")
        self._queues = PeerQueues(self._workers)
        #: each peer's writing time ("peer <session id>"): while any write's engine calls to it run
        self.busy = BusyClock()
        self._dispatch = Dispatcher(
            self._cond,
            self._slots,
            self._workers,
            timeout_s=config.timeout_s,
            max_inflight=self.options.max_inflight_per_peer,
        )
        owned = self._factory is not None  # a host's engine is the host's to drain and to prune
        # A bounded inbox, drained from the engine (a host's own notifications stay in a host's engine).
        slots = weakref.ref(self._slots)  # the threads must not keep a dropped engine alive
        self._received = (
            notify.Received(lambda: (s := slots()) and s.primary.engine, f"kvwire-mooncake-{port}")
            if owned and hasattr(engine, "get_notifies")
            else None
        )
        # Peers that died unannounced are found and forgotten (their connections count toward recycling).
        self._sweeper = (
            Periodic(self.sweep_dead_peers, f"kvwire-mooncake-{port}-sweep", SWEEP_INTERVAL_S) if owned else None
        )

    @property
    def endpoint(self) -> str:
        """The session id peers address this engine by.

        With the P2P handshake it is ``f"{host}:{rpc_port}"`` (the port is chosen
        by the engine at random in ``MC_MIN_RPC_PORT..MC_MAX_RPC_PORT``, default
        15000-17000). With a metadata server it is ``config.host`` itself: the name
        the engine publishes under ``mooncake/ram/<name>``; the advertised IP is
        the first non-loopback address (``MC_TCP_BIND_ADDRESS`` overrides it).
        """
        return self._endpoint

    @property
    def recycles(self) -> int:
        """How many times the sending engine was replaced to drop the connections of forgotten peers."""
        return self._recycles

    @property
    def confinement(self) -> Confinement:
        """Where the receiving engine's listeners accept connections (see :mod:`kvwire_mooncake.engine.confine`).

        Empty for a host's engine (kvwire does not touch its sockets) and off Linux.
        """
        return self._confinement

    @property
    def registered(self) -> tuple[tuple[int, int], ...]:
        """The registered local ranges, ``(address, nbytes)``, by address."""
        return self._regions.items()

    @property
    def renewals(self) -> int:
        """How many times the sending engine was recreated to recover a broken session."""
        return self._renewals

    # ------------------------------------------------------------------ memory and lifecycle

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` of local memory at ``ptr`` (source or destination of transfers).

        Raises InvalidTransferError for a non-positive address or size or a range
        overlapping one already registered (Mooncake returns -7 for that), and
        TransferError(code=...) if the engine refuses.
        """
        ptr, nbytes = RegionSet.checked_range(ptr, nbytes, names=("ptr", "nbytes"))
        with self._admin:
            self._check_open()
            self._regions.require_free(ptr, nbytes)
            if not self.options.host_registered:  # else the host's engine has it registered already
                self._slots.register(ptr, nbytes)
            self._regions.add(ptr, nbytes)

    def unregister(self, ptr: int) -> None:
        """Unregister the range that starts at ``ptr`` (as passed to :meth:`register`)."""
        ptr = int(ptr)
        with self._admin:
            self._regions.remove(ptr)
            if not self.options.host_registered:
                self._slots.unregister(ptr)

    def unregister_all(self) -> None:
        """Unregister every registered range; raises the first failure after trying all."""
        first: TransferError | None = None
        with self._admin:
            for ptr, _ in self._regions.items():
                try:
                    self.unregister(ptr)
                except TransferError as exc:
                    first = first or exc
        if first is not None:
            raise first

    def forget_peer(self, session_id: str) -> None:
        """Drop what is kept for a peer that is gone (in-flight budget, renewal interval); idempotent.

        A call still inside the engine keeps holding the peer's budget until it
        returns. Mooncake itself keeps each peer's pooled data connections (up
        to ``MC_TCP_LANES_PER_PEER``, default 4, sockets; they sit in CLOSE_WAIT
        once the peer died) and its segment descriptor until the engine is
        destroyed, and its binding has no call to drop them. So once
        ``RECYCLE_AFTER_FORGOTTEN`` forgotten peers were written to through the
        current sending engine (TCP, P2P, an engine kvwire created), it is
        replaced by a fresh one and destroyed, which closes those sockets (the
        receiving engine, and so :attr:`endpoint`, stays). A failure to create
        the fresh engine is left for the next call.
        """
        self._dispatch.forget(session_id)
        with self._lock:
            sender = self._slots.sender
            if session_id not in sender.succeeded:
                return
            sender.forgotten.add(session_id)
            due = len(sender.forgotten) >= RECYCLE_AFTER_FORGOTTEN
        if due and self._factory is not None and self._p2p and self.config.protocol == "tcp":
            with self._admin, contextlib.suppress(Exception):
                with self._lock:
                    if self._dispatch.closed or self._slots.sender is not sender:
                        return
                self._install_fresh_sender(self._factory, "recycling the sending Mooncake engine")
                self._recycles += 1

    def sweep_dead_peers(self) -> list[str]:
        """Probe each peer the sending engine wrote to and did not forget; forget those that refuse.

        Mooncake keeps pooled connections to every peer it wrote to until the
        engine is destroyed; a host that never calls ``remove_peer`` for a
        receiver that died would keep them for ever. So every
        ``SWEEP_INTERVAL_S`` a thread runs this: each such peer is probed
        (``send_probe``, a TCP connection to its handshake port) and the ones
        that refuse are forgotten, counting toward recycling as forgotten peers
        do. Returns the peers forgotten. A peer that does not answer within
        ``PROBE_WAIT_S`` is left alone: frozen is not dead.
        """
        with self._lock:
            if self._dispatch.closed:
                return []
            sender = self._slots.sender
            peers = sorted(sender.succeeded - sender.forgotten)
        dead = []
        for session_id in peers:
            supported, code = failures.probe(self._slots, self._workers, session_id, PROBE_WAIT_S)
            if not supported:
                break
            if code is not None and code != 0:
                self.forget_peer(session_id)
                dead.append(session_id)
        return dead

    @contextmanager
    def borrow(self) -> Iterator[TransferEngineLike]:
        """The current sending engine itself, pinned for the block (never destroyed under it).

        For callers that need the bare binding (see :func:`kvwire_mooncake.raw.raw_write`);
        nothing the wrapper does for :meth:`write` applies to calls made on it.
        Raises TransferError once closed.
        """
        self._check_open()
        with self._slots.borrow() as engine:
            yield engine

    def close(self) -> None:
        """Unregister everything and destroy the engine(s) kvwire created; idempotent.

        An engine still inside a call (a write past its deadline) is destroyed
        when that call returns, never under it. A host's engine is left open.
        """
        with self._admin:
            if self._dispatch.closed:
                return
            self._dispatch.close()  # writers waiting for budget give up now
            for thread in (self._received, self._sweeper):
                if thread is not None:
                    thread.close()
            self._queues.close()  # submitted writes not started fail now
            try:
                self.unregister_all()
            finally:
                self._workers.close()
                self._slots.retire_all()

    def __enter__(self) -> MooncakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._dispatch.closed:
            raise TransferError("MooncakeEngine is closed")

    # ------------------------------------------------------------------ write

    def check_local(self, src_addrs: NDArray[np.int64], lengths: NDArray[np.int64]) -> None:
        """Raise InvalidTransferError unless each ``src_addrs[i] .. +lengths[i]`` is in one registered range.

        Mooncake's TCP transport reads an unregistered source without complaint;
        this is the check it lacks (vectorised).
        """
        src = as_addresses(src_addrs, "src_addrs")
        length = as_addresses(lengths, "lengths")
        if src.shape != length.shape:
            raise InvalidTransferError(
                f"src_addrs and lengths must have the same length, got {src.size} and {length.size}"
            )
        self._regions.check(src, length, names=("src_addrs", "lengths"))

    def write(self, session_id: str, src: NDArray[np.int64], dst: NDArray[np.int64], length: NDArray[np.int64]) -> None:
        """Write ``length[i]`` bytes from local ``src[i]`` to ``dst[i]`` in the peer ``session_id``.

        Validates first (1-D integer arrays of one length, all values > 0, every
        source inside registered local memory); nothing is sent on bad input.
        Then writes in calls of at most ``max_descriptors_per_call`` descriptors,
        with at most ``max_inflight_per_peer`` descriptors in flight to the peer
        across all threads. Returns when every byte is written.

        Raises:
            InvalidTransferError: bad input (names the argument, index and value).
            PeerUnreachableError: the peer does not answer connections (dead, wrong id).
            TransferTimeoutError: no completion within ``config.timeout_s`` (frozen or
                overloaded peer), or an earlier write to this peer is still stuck.
            TransferError: the peer answers but the write failed, most likely a
                destination outside its registered memory (the whole call is rejected);
                also when renewing the sending engine to recover a broken session failed.
        """
        if not isinstance(session_id, str) or not session_id:
            raise InvalidTransferError(f"session_id must be a non-empty str, got {session_id!r}")
        s, d, n = write_arrays(src, dst, length)
        if s.size == 0:
            return
        self._check_open()
        self._regions.check(s, n)

        per_call = self.options.max_descriptors_per_call
        bounds = [(i, min(i + per_call, s.size)) for i in range(0, s.size, per_call)]
        sizes = np.add.reduceat(n, np.array([b[0] for b in bounds], dtype=np.int64))
        nbytes = {b: int(x) for b, x in zip(bounds, sizes.tolist())}
        lists: Lists = (s.tolist(), d.tolist(), n.tolist())  # pybind11 converts lists ~3x faster than arrays
        peer = self._dispatch.peer(session_id)

        with self.busy.busy(f"peer {session_id}"):
            failed, unsent = self._dispatch.run(session_id, peer, bounds, nbytes, lists)
        if not failed:
            return
        error, renew = self._classify(session_id, failed, nbytes, allow_renew=True)
        if isinstance(error, PeerUnreachableError):
            self.forget_peer(session_id)  # dead: its pooled sockets count toward recycling, remove_peer or not
        if not renew:
            raise error
        try:
            renewed = self._renew(failed[0].slot, peer)
        except Exception as exc:  # a write raises TransferError, whatever the factory raised
            code = exc.code if isinstance(exc, TransferError) and exc.code is not None else error.code
            raise TransferError(
                f"{error}; renewing the sending engine to recover the session failed: {type(exc).__name__}: {exc}",
                code=code,
                peer=session_id,
            ) from exc
        if not renewed:
            raise error
        # Writing the same bytes twice is harmless: retry the failed calls and send the rest.
        retry = sorted([o.chunk for o in failed] + unsent)
        with self.busy.busy(f"peer {session_id}"):
            failed, _ = self._dispatch.run(session_id, peer, retry, nbytes, lists)
        if failed:
            raise self._classify(session_id, failed, nbytes, allow_renew=False)[0]

    # ------------------------------------------------------------------ non-blocking use and notifications

    def submit(self, session_id: str, job: Callable[[], None]) -> Future[None]:
        """Queue ``job`` (a :meth:`write`, then a :meth:`notify`) behind the jobs to the peer (:mod:`.queues`)."""
        self._check_open()
        return self._queues.submit(session_id, job)

    def notify(self, session_id: str, message: bytes) -> None:
        """``message`` to ``session_id`` after every write to it that returned (:mod:`.notify`), within timeout_s."""
        self._check_open()
        src = next((base for base, _ in self._regions.items()), 0)  # a zero-length write: any address
        notify.deliver(self._slots, self._workers, session_id, self._endpoint, message, src, self.config.timeout_s)

    def notifications(self) -> list[tuple[str, bytes]]:
        """``(sender endpoint, message)`` of each kvwire notification received since the last call."""
        self._check_open()
        if self._received is not None:
            return self._received.take()
        engine = self._slots.primary.engine
        return [] if engine is None else notify.received(engine)

    # ------------------------------------------------------------------ failure and recovery

    def _classify(
        self, session_id: str, failed: list[Outcome], nbytes: dict[Chunk, int], *, allow_renew: bool
    ) -> tuple[TransferError, bool]:
        outcome = failed[0]
        with self._lock:
            worked_before = allow_renew and self._p2p and session_id in outcome.slot.succeeded
        return failures.classify(
            session_id,
            outcome,
            len(failed),
            nbytes,
            timeout_s=self.config.timeout_s,
            probe=functools.partial(failures.probe, self._slots, self._workers, session_id),
            worked_before=worked_before,
            no_renewal=None if self._factory is not None else _NO_RENEWAL,
        )

    def _renew(self, old: Slot, peer: Peer) -> bool:
        """Replace the sending engine ``old`` by a fresh one with all memory registered; True if renewed.

        Used when a session that worked on ``old`` fails while its peer answers
        probes: the engine caches a peer's segment descriptor forever, so a peer
        restarted on the same endpoint (or a session broken by a queue overflow)
        can only be reached through a new engine. The first engine is kept for
        receiving, so :attr:`endpoint` does not change. At most once per
        ``RENEW_INTERVAL_S`` per peer, so repeated bad destinations cannot make
        it churn. Never for a host's engine (no factory).
        """
        factory = self._factory
        if factory is None:
            return False
        with self._admin:
            now = time.monotonic()
            with self._lock:
                if self._dispatch.closed or now - peer.last_renewal < RENEW_INTERVAL_S:
                    return False
                peer.last_renewal = now
                if self._slots.sender is not old:
                    return True  # another thread renewed it meanwhile
            self._install_fresh_sender(factory, "renewing the Mooncake engine")
            self._renewals += 1
            return True

    def _install_fresh_sender(self, factory: Callable[[], TransferEngineLike], purpose: str) -> None:
        """A new engine with all memory registered becomes the sender; the old one is retired (unless primary)."""
        engine, _ = create_engine(factory, self.config, restrict_listeners=self.options.restrict_listeners)
        self._slots.install_sender(Slots.filled(engine, self._regions.items(), purpose))
