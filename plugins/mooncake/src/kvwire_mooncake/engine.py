"""``MooncakeEngine``: a small, well-behaved wrapper around ``mooncake.engine.TransferEngine``.

Mooncake's Python binding has sharp edges that every backend built on it would
otherwise meet again (all measured with ``mooncake-transfer-engine-non-cuda``
0.3.13.post1, TCP, two processes on one host):

* Nothing raises: every call returns an int. ``batch_transfer_sync_write``
  returns ``-1`` for *every* failure (bad peer, dead peer, frozen peer, remote
  range outside the peer's memory, queue overflow), so the code alone says
  nothing. This wrapper classifies a failure by how long it took and by
  ``send_probe`` (the engine's own reachability RPC: 0, or ``-102``
  ``ERR_SOCKET``) and raises :class:`~kvwire.PeerUnreachableError`,
  :class:`~kvwire.TransferTimeoutError` or :class:`~kvwire.TransferError`.
* Over TCP the engine never checks that a *local* source lies in registered
  memory: :meth:`MooncakeEngine.check_local` does, vectorised, before any call.
* More than about 2060 descriptors outstanding to one peer fail with ``-1``
  (partly written); far beyond that the peer's session stays broken for that
  engine. Writes are chunked (``max_descriptors_per_call``) and the descriptors
  in flight per peer are bounded across threads (``max_inflight_per_peer``).
* A write to a peer frozen after the first contact blocks 30 s by default
  (``MC_TCP_STATUS_TIMEOUT_SEC`` / ``MC_TCP_PROGRESS_TIMEOUT_SEC``, set here
  to 80% of ``timeout_s``, see :func:`prepare_environment`). The first contact
  with a frozen peer (the P2P handshake) blocks 60 s whatever the settings
  (``SO_RCVTIMEO`` is hard-coded). So every call also runs in a worker thread
  with a Python-side deadline: a write never hangs longer than ``timeout_s``
  (plus 1 s per GiB, Mooncake's own allowance); a call left behind keeps its
  peer's later writes waiting, never piling up in the engine.
* A peer restarted on the same endpoint is never reachable again through an
  engine that talked to its previous incarnation (the engine caches the old
  segment descriptor; the same holds for a session broken by a queue
  overflow). In P2P mode the wrapper then renews its *sending* engine (a fresh
  engine, all memory re-registered) and retries once; the first engine stays
  alive for receiving, so :attr:`MooncakeEngine.endpoint` never changes.
* The engine logs from C++ straight to file descriptor 2. Quiet by default:
  ``MC_LOG_LEVEL=ERROR`` before the import, and fd 2 is captured around engine
  creation (the two lines it always prints there); errors still show.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import queue
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any, Final, Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from kvwire.config import BackendConfig
from kvwire.errors import (
    BackendUnavailableError,
    InvalidTransferError,
    PeerUnreachableError,
    TransferError,
    TransferTimeoutError,
)

__all__ = [
    "ENGINE_ERROR_CODES",
    "MooncakeEngine",
    "TransferEngineLike",
    "engine_timeout_s",
    "prepare_environment",
]

T = TypeVar("T")

#: Mooncake's ``mooncake-transfer-engine/include/error.h``. Register/unregister and
#: ``send_probe`` return these; ``batch_transfer_sync_write`` returns only 0 or -1.
ENGINE_ERROR_CODES: Final[Mapping[int, str]] = {
    -1: "ERR_INVALID_ARGUMENT",
    -2: "ERR_TOO_MANY_REQUESTS",
    -3: "ERR_ADDRESS_NOT_REGISTERED",
    -4: "ERR_BATCH_BUSY",
    -6: "ERR_DEVICE_NOT_FOUND",
    -7: "ERR_ADDRESS_OVERLAPPED",
    -101: "ERR_DNS",
    -102: "ERR_SOCKET",
    -103: "ERR_MALFORMED_JSON",
    -104: "ERR_REJECT_HANDSHAKE",
    -200: "ERR_METADATA",
    -201: "ERR_ENDPOINT",
    -202: "ERR_CONTEXT",
    -300: "ERR_NUMA",
    -301: "ERR_CLOCK",
    -302: "ERR_MEMORY",
    -303: "ERR_NOT_IMPLEMENTED",
}

P2P_HANDSHAKE: Final = "P2PHANDSHAKE"

#: Debian packages the non-CUDA wheel needs and does not bundle.
_SYSTEM_PACKAGES: Final = "libibverbs1 libnuma1 libcurl4"
_LIB_PACKAGES: Final[Mapping[str, str]] = {
    "libibverbs": "libibverbs1",
    "libnuma": "libnuma1",
    "libcurl": "libcurl4",
    "librdmacm": "librdmacm1",
}
_INT64_MAX: Final = int(np.iinfo(np.int64).max)
#: Mooncake's own rule for the time a batch may take: its timeout plus 1 s per GiB.
_BYTES_PER_SECOND_ALLOWANCE: Final = float(1 << 30)
#: Longest wait for a probe after a fast failure (the probe of a frozen peer blocks 60 s).
_PROBE_WAIT_S: Final = 1.0
#: Fewest seconds between two renewals of the sending engine for one peer.
_RENEW_INTERVAL_S: Final = 30.0
#: Keep at most this many idle worker threads per engine.
_MAX_IDLE_WORKERS: Final = 8
_GLOG_LINE: Final = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]+\] |WARNING: Logging before InitGoogleLogging)"
)


class TransferEngineLike(Protocol):
    """The call surface of ``mooncake.engine.TransferEngine`` this wrapper uses (all return codes).

    Engine doubles passed through ``engine_factory`` implement these methods. An
    optional ``send_probe(session_id) -> int`` (0 = peer answers) lets failures be
    classified as unreachable vs rejected; without it a failure is a plain
    :class:`~kvwire.TransferError`.
    """

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, /) -> int: ...

    def get_rpc_port(self) -> int: ...

    def register_memory(self, buffer_addr: int, capacity: int, /) -> int: ...

    def unregister_memory(self, buffer_addr: int, /) -> int: ...

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        /,
    ) -> int: ...


# ----------------------------------------------------------------------------- environment and import


def _env_seconds(name: str, default: int) -> int:
    """An integer-seconds variable as Mooncake parses it (``atoi``, values <= 0 mean the default)."""
    try:
        value = int(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


#: The values this module put into ``os.environ``: a value equal to ours was not set by the user.
_OWN_ENV: dict[str, str] = {}
_ENV_LOCK = threading.Lock()


def _set_env(name: str, value: int, *, lower_only: bool) -> None:
    """Set ``name`` unless the user did; with ``lower_only``, only ever lower our own earlier value."""
    current = os.environ.get(name)
    if current is not None and _OWN_ENV.get(name) != current:
        return  # the user's
    if current is not None and lower_only and _env_seconds(name, 0) <= value:
        return
    if current != str(value):
        os.environ[name] = _OWN_ENV[name] = str(value)


def engine_timeout_s() -> float:
    """Seconds after which the engine itself fails a write to a silent peer (the stricter TCP deadline)."""
    return float(min(_env_seconds("MC_TCP_STATUS_TIMEOUT_SEC", 30), _env_seconds("MC_TCP_PROGRESS_TIMEOUT_SEC", 30)))


def prepare_environment(config: BackendConfig) -> None:
    """Set Mooncake's environment from ``config``, never overriding a value the user set.

    Where and when Mooncake reads each variable (0.3.13 binary and source):

    * ``MC_LOG_LEVEL``: once per process, when ``mooncake.engine`` is imported
      (later changes are ignored). Set to ``ERROR`` unless ``config.verbose``.
    * ``MC_HANDSHAKE_CONNECT_TIMEOUT``: once per process, at import (default 5 s);
      bounds ``connect()`` of the handshake to an unroutable address.
    * ``MC_TRANSFER_TIMEOUT``: when a ``TransferEngine`` is constructed; bound on a
      whole batch (plus 1 s per GiB), clamped to >= 5 s (default 30 s). Set per
      engine to ``ceil(timeout_s)``.
    * ``MC_TCP_STATUS_TIMEOUT_SEC`` / ``MC_TCP_PROGRESS_TIMEOUT_SEC``: at every
      transfer; deadlines for the peer's acknowledgement and for payload progress
      (default 30 s each). These end a write to a frozen peer. Set to 80% of
      ``timeout_s`` (>= 1 s) so the engine gives up, and frees the call, before the
      Python-side deadline. Process-wide: with several engines the strictest wins.
    """
    with _ENV_LOCK:
        if not config.verbose and "MC_LOG_LEVEL" not in os.environ:
            os.environ["MC_LOG_LEVEL"] = _OWN_ENV["MC_LOG_LEVEL"] = "ERROR"
        engine_s = max(1, int(config.timeout_s * 0.8))
        _set_env("MC_HANDSHAKE_CONNECT_TIMEOUT", engine_s, lower_only=True)
        _set_env("MC_TCP_STATUS_TIMEOUT_SEC", engine_s, lower_only=True)
        _set_env("MC_TCP_PROGRESS_TIMEOUT_SEC", engine_s, lower_only=True)
        _set_env("MC_TRANSFER_TIMEOUT", max(5, math.ceil(config.timeout_s)), lower_only=False)


def _unavailable_message(exc: ImportError) -> str:
    """What to install, from the import error of ``mooncake.engine``."""
    text = str(exc)
    lib = re.search(r"(lib[\w+-]+)\.so[\w.]*", text)
    if lib is not None:
        name = lib.group(1)
        if name.startswith(("libcudart", "libcuda", "libcublas", "libnvidia")):
            return (
                f"cannot load the Mooncake transfer engine: {text}. The CUDA build of the engine is "
                "installed on a machine without CUDA: pip uninstall mooncake-transfer-engine and "
                "pip install 'kvwire-mooncake[cpu]' (mooncake-transfer-engine-non-cuda)"
            )
        package = _LIB_PACKAGES.get(name)
        which = f" ({name} is in the Debian package {package})" if package else ""
        return (
            f"cannot load the Mooncake transfer engine: {text}. A system library is missing{which}: "
            f"apt-get update && apt-get install -y {_SYSTEM_PACKAGES}"
        )
    return (
        f"the Mooncake transfer engine is not installed ({text}): pip install 'kvwire-mooncake[cpu]' "
        "(installs mooncake-transfer-engine-non-cuda; [cuda] or [cuda13] for GPU machines)"
    )


def _default_engine_factory() -> Callable[[], TransferEngineLike]:
    """``mooncake.engine.TransferEngine``, imported now (never when kvwire_mooncake is imported)."""
    try:
        module = importlib.import_module("mooncake.engine")
    except ImportError as exc:
        raise BackendUnavailableError(_unavailable_message(exc)) from exc
    factory: Callable[[], TransferEngineLike] = module.TransferEngine
    return factory


#: Held for the whole window in which fd 2 is redirected (dup, dup2, restore, write-back):
#: fd 2 is process-wide, so two overlapping windows (two engines created at once) would
#: restore each other's temp file and leave fd 2 pointing at a deleted file. Reentrant,
#: so an engine factory that itself creates an engine cannot deadlock.
_STDERR_LOCK: Final = threading.RLock()


@contextmanager
def _captured_stderr(enabled: bool) -> Iterator[list[str]]:
    """Capture file descriptor 2 for the block; yields a list that receives the engine's lines.

    The engine prints two log lines whenever one is created, whatever the log
    level. Lines in glog's format are kept out of the terminal (and handed to the
    caller, for an error message); anything else written meanwhile, such as
    another thread's traceback, is written back to fd 2 afterwards. fd 2 is
    always restored. Captures are serialised process-wide (``_STDERR_LOCK``), so
    engines created concurrently wait for each other here.
    """
    lines: list[str] = []
    if not enabled:
        yield lines
        return
    with _STDERR_LOCK:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):
            yield lines
            return
        try:
            with tempfile.TemporaryFile() as tmp:
                os.dup2(tmp.fileno(), 2)
                try:
                    yield lines
                finally:
                    with suppress(OSError, ValueError, AttributeError):
                        sys.stderr.flush()
                    os.dup2(saved, 2)
                    tmp.seek(0)
                    other: list[str] = []
                    for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                        (lines if _GLOG_LINE.match(line) else other).append(line.rstrip("\n"))
                    if other:
                        with suppress(OSError):
                            os.write(2, ("\n".join(other) + "\n").encode())
        finally:
            os.close(saved)


# ----------------------------------------------------------------------------- worker threads


class _Workers:
    """Daemon threads that run blocking engine calls, so the caller can stop waiting.

    Threads are daemons because a call stuck in the engine must not block
    interpreter exit; one is started whenever no idle thread is free, so a stuck
    call never delays another.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future[Any]] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0
        self._started = 0
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("workers are closed")
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
            else:
                self._started += 1
                index = self._started
        self._queue.put((fn, fut))
        if spawn:
            threading.Thread(target=self._run, name=f"{self._name}-{index}", daemon=True).start()
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as exc:  # handed to the waiting caller
                    fut.set_exception(exc)
            del item, fn, fut
            with self._lock:
                if self._closed or self._idle >= _MAX_IDLE_WORKERS:
                    return
                self._idle += 1

    def close(self) -> None:
        """Stop idle threads; busy ones stop when their call returns."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, 0
        for _ in range(idle):
            self._queue.put(None)


# ----------------------------------------------------------------------------- state


@dataclass(eq=False)
class _Slot:
    """One engine and the calls using it; destroyed once retired and unused."""

    engine: TransferEngineLike | None
    name: str
    users: int = 0
    retired: bool = False
    registered: set[int] = field(default_factory=set)
    succeeded: set[str] = field(default_factory=set)  # sessions written to successfully


@dataclass(eq=False)
class _Peer:
    """Per-session bookkeeping: descriptors in flight, calls abandoned in the engine."""

    inflight: int = 0
    stuck: int = 0
    last_renewal: float = -math.inf


@dataclass(eq=False)
class _Call:
    """One engine call; ``abandoned``/``finished`` are guarded by the engine's lock."""

    slot: _Slot
    peer: _Peer
    count: int
    nbytes: int
    submitted: float = 0.0
    abandoned: bool = False
    finished: bool = False


@dataclass(frozen=True)
class _Outcome:
    """Result of one chunk: engine code and seconds in the engine; rc None = Python deadline hit."""

    rc: int | None
    elapsed: float
    slot: _Slot
    chunk: tuple[int, int]


def _p2p_endpoint(host: str, port: int) -> str:
    """The engine's own P2P session name: ``host`` without any port, IPv6 in brackets, then the rpc port."""
    if host.startswith("["):
        host = host[1 : host.index("]")] if "]" in host else host[1:]
    elif host.count(":") == 1:
        host = host.split(":", 1)[0]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _as_addresses(value: object, name: str) -> NDArray[np.int64]:
    """``value`` as a 1-D int64 array, or InvalidTransferError naming ``name``."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise InvalidTransferError(f"{name} must be a 1-D array, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise InvalidTransferError(f"{name} must have an integer dtype (int64), got {arr.dtype}")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
        i = int(np.argmax(arr > _INT64_MAX))
        raise InvalidTransferError(f"{name}[{i}] = {int(arr[i])} does not fit in int64")
    return arr.astype(np.int64, copy=False)


def _require_positive(arr: NDArray[np.int64], name: str) -> None:
    bad = arr <= 0
    if bad.any():
        i = int(np.argmax(bad))
        raise InvalidTransferError(f"{name}[{i}] = {int(arr[i])} must be > 0")


# ----------------------------------------------------------------------------- the wrapper


class MooncakeEngine:
    """A Mooncake ``TransferEngine`` with exceptions, local checks, chunking, deadlines and recovery.

    Thread-safe: any number of threads may :meth:`write` at once; the descriptors
    in flight to one peer stay <= ``config.max_inflight_per_peer``.

    Args:
        config: host, protocol, metadata server, device, ``timeout_s``, chunk and
            in-flight bounds, ``verbose``.
        engine_factory: returns a new, uninitialised engine with Mooncake's call
            surface (:class:`TransferEngineLike`); default ``mooncake.engine.TransferEngine``,
            imported here. The wrapper may call it again to renew its sending engine.

    Raises:
        BackendUnavailableError: the engine wheel or a system library is missing, or
            the engine failed to initialise (the message carries the engine's log).
    """

    def __init__(self, config: BackendConfig, *, engine_factory: Callable[[], Any] | None = None) -> None:
        self.config = config
        prepare_environment(config)
        self._factory: Callable[[], TransferEngineLike] = (
            engine_factory if engine_factory is not None else _default_engine_factory()
        )
        self._p2p = config.metadata_server == P2P_HANDSHAKE
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # in-flight budgets
        self._admin = threading.RLock()  # register / unregister / renew / close
        self._regions: dict[int, int] = {}
        empty = np.zeros(0, dtype=np.int64)
        self._index: tuple[NDArray[np.int64], NDArray[np.int64]] = (empty, empty)  # (starts, ends), by start
        self._peers: dict[str, _Peer] = {}
        self._closed = False
        self._renewals = 0
        engine = self._create_engine(config.host)
        self._primary = _Slot(engine, config.host)
        self._sender = self._primary
        port = int(engine.get_rpc_port())
        self._endpoint = _p2p_endpoint(config.host, port) if self._p2p else config.host
        self._workers = _Workers(f"kvwire-mooncake-{port}")

    # ------------------------------------------------------------------ properties

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
    def registered(self) -> tuple[tuple[int, int], ...]:
        """The registered local ranges, ``(address, nbytes)``, by address."""
        with self._lock:
            return tuple(sorted(self._regions.items()))

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def renewals(self) -> int:
        """How many times the sending engine was recreated to recover a broken session."""
        return self._renewals

    # ------------------------------------------------------------------ engine lifecycle

    def _create_engine(self, local_name: str) -> TransferEngineLike:
        """A new engine from the factory, initialised; its creation log is kept off stderr."""
        cfg = self.config
        prepare_environment(cfg)  # MC_TRANSFER_TIMEOUT is read by the constructor
        with _captured_stderr(not cfg.verbose) as log:
            engine: TransferEngineLike | None = self._factory()
            assert engine is not None
            rc = int(engine.initialize(local_name, cfg.metadata_server, cfg.protocol, cfg.device))
            if rc != 0:
                engine = None  # destroyed here, so its shutdown log is captured too
        if engine is None:
            detail = ("; engine log: " + " | ".join(log[-8:])) if log else ""
            raise BackendUnavailableError(
                f"Mooncake engine initialize({local_name!r}, {cfg.metadata_server!r}, {cfg.protocol!r}, "
                f"{cfg.device!r}) returned {rc}{detail}"
            )
        return engine

    def _destroy(self, slot: _Slot) -> None:
        """Unregister the slot's memory, close and drop its engine (Mooncake's destructor takes ~0.5-1 s).

        Mooncake's binding has no ``close``; an engine that has one (such as
        :class:`~kvwire_mooncake.engine_double.HostMemoryEngine`, which leaves its
        process-wide registry) is closed. Failures here are swallowed: the slot is
        already out of use and the caller is tearing down.
        """
        engine, slot.engine = slot.engine, None
        if engine is None:
            return
        try:
            for ptr in sorted(slot.registered):
                with suppress(Exception):
                    engine.unregister_memory(ptr)
            slot.registered.clear()
            close = getattr(engine, "close", None)
            if callable(close):
                with suppress(Exception):
                    close()
        finally:
            del engine

    def _release_slot(self, slot: _Slot) -> None:
        with self._lock:
            slot.users -= 1
            destroy = slot.retired and slot.users == 0
        if destroy:
            self._destroy(slot)

    def _retire(self, slot: _Slot) -> None:
        with self._lock:
            slot.retired = True
            destroy = slot.users == 0
        if destroy:
            self._destroy(slot)

    def _live_slots(self) -> list[_Slot]:
        slots = [self._primary] if self._sender is self._primary else [self._primary, self._sender]
        return [s for s in slots if s.engine is not None]

    # ------------------------------------------------------------------ memory registration

    def _update_region_index(self) -> None:
        items = sorted(self._regions.items())
        starts = np.array([a for a, _ in items], dtype=np.int64)
        ends = np.array([a + n for a, n in items], dtype=np.int64)
        self._index = (starts, ends)  # one assignment: readers never see a mixed pair

    def register(self, ptr: int, nbytes: int) -> None:
        """Register ``nbytes`` of local memory at ``ptr`` (source or destination of transfers).

        Raises InvalidTransferError for a non-positive address or size or a range
        overlapping one already registered (Mooncake returns -7 for that), and
        TransferError(code=...) if the engine refuses.
        """
        for name, value in (("ptr", ptr), ("nbytes", nbytes)):
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
                raise InvalidTransferError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        ptr, nbytes = int(ptr), int(nbytes)
        if ptr <= 0 or ptr > _INT64_MAX:
            raise InvalidTransferError(f"ptr must be a valid address > 0, got {ptr:#x}")
        if nbytes <= 0 or nbytes > _INT64_MAX - ptr:
            raise InvalidTransferError(f"nbytes must be > 0 and end below 2**63, got {nbytes}")
        with self._admin:
            self._check_open()
            for start, size in self._regions.items():
                if ptr < start + size and start < ptr + nbytes:
                    raise InvalidTransferError(
                        f"range [{ptr:#x}, {ptr + nbytes:#x}) overlaps the registered range "
                        f"[{start:#x}, {start + size:#x}); unregister it first"
                    )
            done: list[_Slot] = []
            for slot in self._live_slots():
                assert slot.engine is not None
                rc = int(slot.engine.register_memory(ptr, nbytes))
                if rc != 0:
                    for other in done:
                        assert other.engine is not None
                        other.engine.unregister_memory(ptr)
                        other.registered.discard(ptr)
                    cls = InvalidTransferError if rc == -7 else TransferError
                    message = (
                        f"Mooncake register_memory({ptr:#x}, {nbytes}) returned {rc} "
                        f"({ENGINE_ERROR_CODES.get(rc, 'unknown')})"
                    )
                    raise cls(message) if cls is InvalidTransferError else TransferError(message, code=rc)
                slot.registered.add(ptr)
                done.append(slot)
            with self._lock:
                self._regions[ptr] = nbytes
                self._update_region_index()

    def unregister(self, ptr: int) -> None:
        """Unregister the range that starts at ``ptr`` (as passed to :meth:`register`)."""
        ptr = int(ptr)
        with self._admin:
            with self._lock:
                if ptr not in self._regions:
                    raise InvalidTransferError(f"ptr {ptr:#x} is not the start of a registered range")
                del self._regions[ptr]
                self._update_region_index()
            failures: list[int] = []
            for slot in self._live_slots():
                assert slot.engine is not None
                if ptr in slot.registered:
                    slot.registered.discard(ptr)
                    rc = int(slot.engine.unregister_memory(ptr))
                    if rc != 0:
                        failures.append(rc)
            if failures:
                rc = failures[0]
                name = ENGINE_ERROR_CODES.get(rc, "unknown")
                raise TransferError(f"Mooncake unregister_memory({ptr:#x}) returned {rc} ({name})", code=rc)

    def unregister_all(self) -> None:
        """Unregister every registered range; raises the first failure after trying all."""
        first: TransferError | None = None
        with self._admin:
            for ptr, _ in self.registered:
                try:
                    self.unregister(ptr)
                except TransferError as exc:
                    first = first or exc
        if first is not None:
            raise first

    def close(self) -> None:
        """Unregister everything and destroy the engine(s); idempotent.

        An engine still inside a call (a write past its deadline) is destroyed
        when that call returns, never under it.
        """
        with self._admin:
            if self._closed:
                return
            with self._cond:
                self._closed = True
                self._cond.notify_all()  # writers waiting for budget give up now
            try:
                self.unregister_all()
            finally:
                self._workers.close()
                for slot in {id(s): s for s in (self._sender, self._primary)}.values():
                    self._retire(slot)

    def __enter__(self) -> MooncakeEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError("MooncakeEngine is closed")

    # ------------------------------------------------------------------ checks

    def check_local(self, src_addrs: NDArray[np.int64], lengths: NDArray[np.int64]) -> None:
        """Raise InvalidTransferError unless each ``src_addrs[i] .. +lengths[i]`` is in one registered range.

        Mooncake's TCP transport reads an unregistered source without complaint;
        this is the check it lacks. Vectorised: one ``searchsorted`` over the
        registered ranges.
        """
        src = _as_addresses(src_addrs, "src_addrs")
        length = _as_addresses(lengths, "lengths")
        if src.shape != length.shape:
            raise InvalidTransferError(
                f"src_addrs and lengths must have the same length, got {src.size} and {length.size}"
            )
        self._check_local(src, length, "src_addrs", "lengths")

    def _check_local(self, src: NDArray[np.int64], length: NDArray[np.int64], sname: str, lname: str) -> None:
        starts, ends = self._index
        if src.size == 0:
            return
        if starts.size == 0:
            raise InvalidTransferError(
                f"{sname}[0] = {int(src[0]):#x} is not in registered local memory: nothing is registered"
            )
        idx = np.searchsorted(starts, src, side="right") - 1
        inside = idx >= 0
        idx = np.maximum(idx, 0)
        # length <= end - src, written so that it cannot overflow
        ok = inside & (length <= ends[idx] - src)
        if not ok.all():
            i = int(np.argmin(ok))
            s, n = int(src[i]), int(length[i])
            j = int(idx[i])
            near = f"; nearest registered range [{int(starts[j]):#x}, {int(ends[j]):#x})" if inside[i] else ""
            raise InvalidTransferError(
                f"{sname}[{i}] = {s:#x} with {lname}[{i}] = {n} is not inside registered local memory{near}"
            )

    # ------------------------------------------------------------------ write

    def write(
        self,
        session_id: str,
        src: NDArray[np.int64],
        dst: NDArray[np.int64],
        length: NDArray[np.int64],
    ) -> None:
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
        s = _as_addresses(src, "src")
        d = _as_addresses(dst, "dst")
        n = _as_addresses(length, "length")
        if not s.shape == d.shape == n.shape:
            raise InvalidTransferError(
                f"src, dst and length must have the same length, got {s.size}, {d.size} and {n.size}"
            )
        if s.size == 0:
            return
        _require_positive(s, "src")
        _require_positive(d, "dst")
        _require_positive(n, "length")
        too_far = n > _INT64_MAX - d
        if too_far.any():
            i = int(np.argmax(too_far))
            raise InvalidTransferError(f"dst[{i}] + length[{i}] overflows int64")
        self._check_open()
        self._check_local(s, n, "src", "length")

        per_call = self.config.max_descriptors_per_call
        bounds = [(i, min(i + per_call, s.size)) for i in range(0, s.size, per_call)]
        sizes = np.add.reduceat(n, np.array([b[0] for b in bounds], dtype=np.int64))
        nbytes = {b: int(x) for b, x in zip(bounds, sizes.tolist())}
        lists = (s.tolist(), d.tolist(), n.tolist())  # pybind11 converts lists ~3x faster than arrays
        peer = self._peer(session_id)

        failed, unsent = self._run_chunks(session_id, peer, bounds, nbytes, lists)
        if not failed:
            return
        error, renew_from = self._classify(session_id, failed[0], len(failed), nbytes)
        if renew_from is None:
            raise error
        try:
            renewed = self._renew(renew_from, peer)
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
        failed, _ = self._run_chunks(session_id, peer, retry, nbytes, lists)
        if failed:
            error, _ = self._classify(session_id, failed[0], len(failed), nbytes, allow_renew=False)
            raise error

    def raw_write(
        self,
        session_id: str,
        src: NDArray[np.int64],
        dst: NDArray[np.int64],
        length: NDArray[np.int64],
    ) -> None:
        """The bare engine call, for benchmarks: :meth:`write` minus its checks, threads and recovery.

        Sequential ``batch_transfer_sync_write`` calls of ``max_descriptors_per_call``
        descriptors (one unchunked call beyond ~2060 would break the session), in
        the caller's thread, no deadline; a non-zero code raises TransferError.
        """
        with self._lock:
            slot = self._sender
            slot.users += 1
        try:
            engine = slot.engine
            if engine is None:
                raise TransferError("MooncakeEngine is closed")
            step = self.config.max_descriptors_per_call
            for i in range(0, len(src), step):
                j = i + step
                rc = int(
                    engine.batch_transfer_sync_write(
                        session_id, src[i:j].tolist(), dst[i:j].tolist(), length[i:j].tolist()
                    )
                )
                if rc != 0:
                    raise TransferError(
                        f"batch_transfer_sync_write to {session_id} returned {rc}", code=rc, peer=session_id
                    )
        finally:
            self._release_slot(slot)

    def _peer(self, session_id: str) -> _Peer:
        with self._lock:
            peer = self._peers.get(session_id)
            if peer is None:
                peer = self._peers[session_id] = _Peer()
            return peer

    def _run_chunks(
        self,
        session_id: str,
        peer: _Peer,
        chunks: list[tuple[int, int]],
        nbytes: Mapping[tuple[int, int], int],
        lists: tuple[list[int], list[int], list[int]],
    ) -> tuple[list[_Outcome], list[tuple[int, int]]]:
        """Run the chunks, concurrently as the in-flight budget allows.

        Returns the failed calls and the chunks not sent because one had failed
        (both empty on success). Raises TransferTimeoutError if the in-flight
        budget stayed full for ``timeout_s`` or the peer has a call stuck in the engine.
        """
        timeout = self.config.timeout_s
        limit = self.config.max_inflight_per_peer
        started: list[tuple[_Call, Future[tuple[int, float]], tuple[int, int]]] = []
        failed: list[_Outcome] = []
        budget_error: TransferError | None = None
        unsent: list[tuple[int, int]] = []
        for k, chunk in enumerate(chunks):
            count = chunk[1] - chunk[0]
            if any(f.done() and (f.exception() is not None or f.result()[0] != 0) for _, f, _ in started):
                unsent = chunks[k:]
                break  # a call already failed: do not send more
            with self._cond:
                # Wait for room in the peer's budget, and for any call abandoned in the engine
                # (past its deadline) to return: no new call joins one that is stuck.
                room = limit - count
                ready = lambda: self._closed or (peer.stuck == 0 and peer.inflight <= room)  # noqa: B023, E731
                if not self._cond.wait_for(ready, timeout):
                    if peer.stuck:
                        why = "an earlier write to it passed its deadline and is still inside the engine"
                    else:
                        why = f"{peer.inflight} descriptors stayed in flight (max_inflight_per_peer={limit})"
                    budget_error = TransferTimeoutError(
                        f"waited {timeout:g} s to send to {session_id}: {why}", peer=session_id
                    )
                    break
                if self._closed:
                    budget_error = TransferError("MooncakeEngine was closed during the write", peer=session_id)
                    break
                peer.inflight += count
                slot = self._sender
                slot.users += 1
            call = _Call(slot, peer, count, nbytes[chunk], time.monotonic())
            a, b = chunk
            args = (lists[0][a:b], lists[1][a:b], lists[2][a:b])
            try:
                fut = self._workers.submit(functools.partial(self._engine_call, session_id, call, args))
            except RuntimeError:
                self._finish(call)
                budget_error = TransferError("MooncakeEngine was closed during the write", peer=session_id)
                break
            started.append((call, fut, chunk))

        first_exc: BaseException | None = None
        for call, fut, chunk in started:
            # Mooncake's own allowance: the timeout plus 1 s per GiB, from submission.
            deadline = call.submitted + timeout + call.nbytes / _BYTES_PER_SECOND_ALLOWANCE
            try:
                rc, elapsed = fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except FutureTimeoutError:
                with self._lock:
                    if not call.finished:
                        call.abandoned = True
                        peer.stuck += 1
                if call.abandoned:
                    failed.append(_Outcome(None, time.monotonic() - call.submitted, call.slot, chunk))
                    continue
                rc, elapsed = fut.result()
            except BaseException as exc:  # the binding raised (e.g. TypeError); keep the first
                first_exc = first_exc or exc
                continue
            if rc != 0:
                failed.append(_Outcome(rc, elapsed, call.slot, chunk))
        if first_exc is not None:
            message = f"Mooncake batch_transfer_sync_write raised {first_exc!r}"
            raise TransferError(message, peer=session_id) from first_exc
        if failed:
            return failed, unsent
        if budget_error is not None:
            raise budget_error
        return failed, unsent

    def _engine_call(
        self, session_id: str, call: _Call, args: tuple[list[int], list[int], list[int]]
    ) -> tuple[int, float]:
        """Runs in a worker: one ``batch_transfer_sync_write``; always releases budget and slot."""
        try:
            engine = call.slot.engine
            if engine is None:
                return -1, 0.0
            t0 = time.monotonic()
            rc = int(engine.batch_transfer_sync_write(session_id, *args))
            elapsed = time.monotonic() - t0
            if rc == 0:
                with self._lock:
                    call.slot.succeeded.add(session_id)
            return rc, elapsed
        finally:
            self._finish(call)

    def _finish(self, call: _Call) -> None:
        with self._cond:
            call.finished = True
            if call.abandoned:
                call.peer.stuck -= 1
            call.peer.inflight -= call.count
            self._cond.notify_all()
        self._release_slot(call.slot)

    # ------------------------------------------------------------------ failure classification and recovery

    def _probe(self, session_id: str) -> tuple[bool, int | None]:
        """``(supported, code)`` of ``send_probe`` through the current sender, waited for at most ~1 s.

        ``code`` is None when the engine has no ``send_probe`` or the peer did not
        answer in time (a frozen peer keeps a probe blocked for 60 s: it finishes in
        its worker thread, unwaited).
        """
        with self._lock:
            slot = self._sender
            probe = getattr(slot.engine, "send_probe", None)
            if probe is None:
                return False, None
            slot.users += 1

        def run() -> int:
            try:
                return int(probe(session_id))
            finally:
                self._release_slot(slot)

        try:
            fut = self._workers.submit(run)
        except RuntimeError:
            self._release_slot(slot)
            return True, None
        try:
            return True, fut.result(timeout=min(_PROBE_WAIT_S, self.config.timeout_s))
        except FutureTimeoutError:
            return True, None

    def _classify(
        self,
        session_id: str,
        outcome: _Outcome,
        nfailed: int,
        nbytes: Mapping[tuple[int, int], int],
        *,
        allow_renew: bool = True,
    ) -> tuple[TransferError, _Slot | None]:
        """The exception for a failed chunk, and the slot to renew if the session looks broken."""
        a, b = outcome.chunk
        what = f"write of {b - a} descriptor(s), {nbytes[outcome.chunk]} bytes, to {session_id}"
        if nfailed > 1:
            what += f" (and {nfailed - 1} more call(s))"
        if outcome.rc is None:
            return (
                TransferTimeoutError(
                    f"{what} did not complete within {outcome.elapsed:.1f} s (config.timeout_s = "
                    f"{self.config.timeout_s:g}); the call is still inside the engine; new writes to the "
                    "peer wait for it to return",
                    peer=session_id,
                ),
                None,
            )
        rc = outcome.rc
        engine_s = engine_timeout_s()
        if outcome.elapsed >= engine_s - 0.05:
            return (
                TransferTimeoutError(
                    f"{what} failed with code {rc} after {outcome.elapsed:.1f} s: the peer did not "
                    f"acknowledge or make progress within the engine's {engine_s:g} s deadline "
                    "(frozen or overloaded peer)",
                    code=rc,
                    peer=session_id,
                ),
                None,
            )
        probe_supported, probe_rc = self._probe(session_id)
        if probe_supported and probe_rc is None:
            return (
                TransferTimeoutError(
                    f"{what} failed with code {rc}, and the peer accepted a probe connection but did not "
                    f"answer within {min(_PROBE_WAIT_S, self.config.timeout_s):g} s",
                    code=rc,
                    peer=session_id,
                ),
                None,
            )
        if probe_rc is not None and probe_rc != 0:
            return (
                PeerUnreachableError(
                    f"peer {session_id} is unreachable: {what} failed with code {rc} and a probe failed with "
                    f"{probe_rc} ({ENGINE_ERROR_CODES.get(probe_rc, 'unknown')}); is the process alive and "
                    "the session id its current endpoint?",
                    code=probe_rc,
                    peer=session_id,
                ),
                None,
            )
        renew = None
        if allow_renew and probe_rc == 0 and self._p2p:
            with self._lock:
                if session_id in outcome.slot.succeeded:
                    renew = outcome.slot
        return (
            TransferError(
                f"{what} failed with code {rc} although the peer answers: most likely a destination range "
                "outside the peer's registered memory (the engine then rejects the whole call), or a peer "
                "restarted on the same endpoint",
                code=rc,
                peer=session_id,
            ),
            renew,
        )

    def _renew(self, old: _Slot, peer: _Peer) -> bool:
        """Replace the sending engine ``old`` by a fresh one with all memory registered; True if renewed.

        Used when a session that worked on ``old`` fails while its peer answers
        probes: the engine caches a peer's segment descriptor forever, so a peer
        restarted on the same endpoint (or a session broken by a queue overflow)
        can only be reached through a new engine. The first engine is kept for
        receiving, so :attr:`endpoint` does not change. At most once per
        ``_RENEW_INTERVAL_S`` per peer, so repeated bad destinations cannot make
        it churn.
        """
        with self._admin:
            now = time.monotonic()
            with self._lock:
                if self._closed or now - peer.last_renewal < _RENEW_INTERVAL_S:
                    return False
                peer.last_renewal = now
                if self._sender is not old:
                    return True  # another thread renewed it meanwhile
            name = self.config.host
            engine = self._create_engine(name)
            slot = _Slot(engine, name)
            try:
                for ptr, size in sorted(self._regions.items()):
                    rc = int(engine.register_memory(ptr, size))
                    if rc != 0:
                        message = f"renewing the Mooncake engine: register_memory({ptr:#x}, {size}) returned {rc}"
                        raise TransferError(message, code=rc)
                    slot.registered.add(ptr)
            except BaseException:
                self._destroy(slot)
                raise
            with self._lock:
                self._sender = slot
            self._renewals += 1
            if old is not self._primary:
                self._retire(old)
            return True
