"""``NixlAgent``: one NIXL agent (UCX backend), its lock, its progress thread and its teardown.

Every NIXL call goes through here under one lock. With one stream the agent
runs NIXL's ``NIXL_THREAD_SYNC_NONE`` mode, so it must never be entered by two
threads. With ``streams`` > 1 the UCX backend gets that many workers
(``num_workers``) and the agent runs ``NIXL_THREAD_SYNC_RW`` (UCX workers in
multi-thread mode); the thread holding the lock may then hand a write's chunks
to the agent's stream threads (:meth:`NixlAgent.on_stream`), which call NIXL in
parallel. NIXL's UCX backend binds a worker to each thread on the thread's
first ``prepXfer`` (round robin over the workers), so exactly ``streams``
threads ever prepare transfers on this agent: each posts on its own worker.

Why kvwire progresses the agent itself: NIXL 1.5's Python API starts its UCX
progress thread with a poll delay of 0, so that thread spins on a core (on 2
cores it cost up to 40% of throughput); with no progress at all on the
receiving side, a peer's first transfer never completes (UCX's connection
set-up needs the receiver to answer). So NIXL's thread is off and a kvwire
thread progresses the worker every few milliseconds, sleeping in between.

Teardown: NIXL 1.5 can crash (SIGSEGV) when an agent is still alive at
interpreter shutdown. :meth:`NixlAgent.close` (and a ``weakref.finalize``
that also runs at exit) stops the thread, releases what is left, deregisters
memory and drops the agent while Python is fully alive.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import socket
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager, suppress
from typing import Any, Final, TypeVar

import numpy as np

import kvwire
from kvwire.transport import BusyClock, Inbox
from kvwire_nixl.errors import translate
from kvwire_nixl.locate import import_nixl
from kvwire_nixl.memory import Segment
from kvwire_nixl.options import NixlOptions
from kvwire_nixl.quiet import Quiet, install_filter
from kvwire_nixl.workers import SerialThread

__all__ = ["UCX", "NixlAgent", "agent_name"]

UCX: Final = "UCX"
_T = TypeVar("_T")
_counter = itertools.count()
_UNSAFE: Final = re.compile(r"[^A-Za-z0-9._-]+")
_JOIN_S: Final = 5.0


def agent_name() -> str:
    """A name unique to this process and instance (host, pid, counter, random token)."""
    host = _UNSAFE.sub("-", socket.gethostname())[:60] or "host"
    return f"kvwire-{host}-{os.getpid()}-{next(_counter)}-{secrets.token_hex(4)}"


class _State:
    """What the progress thread and the finalizer hold (never the NixlAgent, so that it can be collected)."""

    def __init__(self, agent: Any, quiet: Quiet) -> None:
        self.agent: Any | None = agent
        self.quiet = quiet
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
        self.registrations: dict[int, Any] = {}  # base -> NIXL registration descriptor list
        self.remotes: set[str] = set()
        self.leaked: list[Any] = []  # transfer handles NIXL refused to release (still in flight)
        self.failed_loads: set[str] = set()  # peer agents whose metadata failed to load
        self.streams: list[SerialThread] = []  # the posting threads (streams > 1 only)
        # notifications drained but not yet polled; the oldest are dropped past the limit (a peer cannot flood it)
        self.inbox: Inbox[tuple[str, bytes]] = Inbox()


def _drain(state: _State, agent: Any) -> None:
    """Move the notifications NIXL received into ``state.inbox`` (``get_new_notifs`` also progresses UCX).

    NIXL hands each notification out once: whatever reads them keeps them for the next poll. A message
    longer than kvwire's limit is not one kvwire sent, and is dropped.
    """
    for sender, messages in agent.get_new_notifs().items():
        state.inbox.extend((str(sender), bytes(m)) for m in messages if len(m) <= kvwire.MAX_NOTIFICATION_BYTES)


def _progress(state: _State, interval_s: float) -> None:
    """Progress the UCX worker (``get_new_notifs``) every ``interval_s`` until stopped."""
    while not state.stop.wait(interval_s):
        with state.lock:
            agent = state.agent
            if agent is None:
                return
            with suppress(Exception):  # a broken worker is reported by the next transfer
                _drain(state, agent)


def _teardown(state: _State) -> None:
    """Stop the thread, release handles, remote agents and registrations, drop the agent; idempotent."""
    state.stop.set()
    thread = state.thread
    if thread is not None and thread is not threading.current_thread():
        thread.join(_JOIN_S)
    with state.lock:
        streams, state.streams = state.streams, []
    for stream in streams:
        stream.stop(_JOIN_S)
    with state.lock, state.quiet:
        agent, state.agent = state.agent, None
        if agent is None:
            return
        for handle in state.leaked:  # still in flight: NIXL frees what it cannot release with the agent
            with suppress(Exception):
                handle.release()
        for name in state.remotes:
            with suppress(Exception):
                agent.remove_remote_agent(name)
        for descs in state.registrations.values():
            with suppress(Exception):
                agent.deregister_memory(descs, [UCX])
        state.leaked.clear()
        state.remotes.clear()
        state.registrations.clear()
        del agent  # the last reference: NIXL's agent is destroyed here, not at interpreter shutdown


class NixlAgent:
    """A NIXL agent with the UCX backend; every call under one lock, NIXL's errors as kvwire's."""

    def __init__(self, config: kvwire.BackendConfig, options: NixlOptions) -> None:
        api = import_nixl(config)
        if not config.verbose:
            install_filter()
        self.quiet = Quiet(not config.verbose)
        self.name = agent_name()
        self.streams = options.streams
        #: each stream's working time ("stream 0", ...): prepare and post, which over ``cma`` is the copy itself
        #: (a ``raw_write``'s task also waits on the stream for its completion: that time counts too)
        self.busy = BusyClock()
        sync = api.nixl_thread_sync_t
        nixl_config = api.nixl_agent_config(
            enable_prog_thread=options.progress == "nixl",
            backends=[],  # UCX is created below, with its worker count
            sync_mode=sync.NIXL_THREAD_SYNC_RW if self.streams > 1 else sync.NIXL_THREAD_SYNC_NONE,
        )
        params = {"num_workers": str(self.streams)}
        if options.num_threads > 0:
            params["num_threads"] = str(options.num_threads)
        with self.quiet:
            try:
                agent = api.nixl_agent(self.name, nixl_config)
            except Exception as exc:
                raise kvwire.BackendUnavailableError(
                    f"NIXL could not create an agent: {type(exc).__name__}: {exc}"
                ) from None
            plugins = list(agent.get_plugin_list())
            if UCX not in plugins:
                raise kvwire.BackendUnavailableError(f"NIXL's UCX plugin did not load (plugins that did: {plugins})")
            try:
                agent.create_backend(UCX, params)
            except Exception as exc:
                raise kvwire.BackendUnavailableError(
                    f"NIXL could not create its UCX backend ({params}): {type(exc).__name__}: {exc}"
                ) from None
            self.memory_types = frozenset(str(m).removesuffix("_SEG") for m in agent.get_backend_mem_types(UCX))
        self._state = _State(agent, self.quiet)
        self._finalizer = weakref.finalize(self, _teardown, self._state)
        if self.streams > 1:
            self._state.streams = [SerialThread(f"kvwire-nixl-stream{i}-{self.name}") for i in range(self.streams)]
        if options.progress == "kvwire":
            thread = threading.Thread(
                target=_progress,
                args=(self._state, options.progress_interval_ms / 1000.0),
                name=f"kvwire-nixl-progress-{self.name}",
                daemon=True,
            )
            self._state.thread = thread
            thread.start()

    # -- calls ----------------------------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[Any]:
        with self._state.lock:
            agent = self._state.agent
            if agent is None:
                raise kvwire.TransferError("the NIXL agent is closed")
            yield agent

    def call(self, what: str, fn: Callable[[Any], _T], *, peer: str | None = None, posted: bool = False) -> _T:
        """``fn(agent)`` under the lock, quietly; NIXL's exceptions raised as kvwire's."""
        with self.quiet, self._locked() as agent:
            try:
                return fn(agent)
            except kvwire.KvwireError:
                raise
            except Exception as exc:
                # no traceback kept: its frames would hold NIXL objects (and the agent) alive past close()
                raise translate(exc, what, peer, posted=posted) from exc.with_traceback(None)

    @property
    def lock(self) -> threading.Lock:
        """The lock every call into the agent holds (``raw_write`` holds it for a whole transfer)."""
        return self._state.lock

    def on_stream(self, index: int, fn: Callable[[], _T]) -> Future[_T]:
        """Start ``fn`` on stream thread ``index`` (with one stream: run here); only while holding :attr:`lock`.

        Its running time counts as busy time of ``"stream {index}"`` in :attr:`busy`.
        """
        clock, name = self.busy, f"stream {index}"

        def timed() -> _T:
            with clock.busy(name):
                return fn()

        if self.streams == 1:
            future: Future[_T] = Future()
            try:
                future.set_result(timed())
            except BaseException as exc:  # handed to the caller, as from a stream
                future.set_exception(exc)
            return future
        streams = self._state.streams
        if index >= len(streams):
            raise kvwire.TransferError(f"no NIXL stream thread {index} (of {len(streams)}; agent closed?)")
        return streams[index].submit(timed)

    def raw(self) -> Any:
        """The ``nixl_agent`` itself; only while holding :attr:`lock`."""
        agent = self._state.agent
        if agent is None:
            raise kvwire.TransferError("the NIXL agent is closed")
        return agent

    # -- memory, metadata, peers ------------------------------------------------

    def register(self, base: int, nbytes: int, segment: Segment, device: int) -> None:
        if segment not in self.memory_types:
            raise kvwire.BackendUnavailableError(
                f"memory at {base:#x} is {segment}, which NIXL's UCX backend here does not support "
                f"(it supports {sorted(self.memory_types)})"
            )
        table = np.array([[base, nbytes, device]], dtype=np.int64)
        what = f"registering {nbytes} bytes at {base:#x}"
        descs = self.call(what, lambda a: a.register_memory(table, segment, [UCX]))
        self._state.registrations[base] = descs

    def deregister(self, base: int) -> None:
        descs = self._state.registrations.get(base)
        if descs is None:
            raise kvwire.InvalidTransferError(f"{base:#x} is not the start of memory registered with NIXL")
        self.call(f"deregistering {base:#x}", lambda a: a.deregister_memory(descs, [UCX]))
        del self._state.registrations[base]

    def metadata(self) -> bytes:
        return bytes(self.call("reading the agent metadata", lambda a: a.get_agent_metadata()))

    def add_remote(self, metadata: bytes, expected: str) -> str:
        """Load a peer's metadata (of agent ``expected``).

        NIXL 1.5 keeps the UCX connection of metadata that failed to load half-way,
        and refuses that agent's name from then on; the error then says so.
        """
        try:
            name = self.call("loading a peer's NIXL metadata", lambda a: a.add_remote_agent(metadata))
        except kvwire.KvwireError as exc:
            if expected in self._state.failed_loads:
                raise kvwire.InvalidTransferError(
                    f"{exc}; metadata of agent {expected} failed to load before, and NIXL keeps the half-made "
                    "connection: this backend instance cannot reach that agent again (create a new one)"
                ) from None
            self._state.failed_loads.add(expected)
            raise
        text = name.decode() if isinstance(name, bytes) else str(name)
        self._state.remotes.add(text)
        return text

    def remove_remote(self, name: str) -> None:
        if name in self._state.remotes:
            self._state.remotes.discard(name)
            self.call(f"forgetting peer agent {name}", lambda a: a.remove_remote_agent(name))

    @property
    def remotes(self) -> frozenset[str]:
        """Names of the peer agents whose metadata is loaded."""
        return frozenset(self._state.remotes)

    def notifications(self) -> list[tuple[str, bytes]]:
        """``(sending agent, message)`` of every notification received since the last call, each once."""
        with self.quiet, self._locked() as agent:
            try:
                _drain(self._state, agent)
            except Exception as exc:
                raise translate(exc, "reading NIXL notifications", None, posted=False) from exc.with_traceback(None)
            return self._state.inbox.drain()

    def leak(self, handle: Any) -> None:
        """Keep a handle NIXL would not release (in flight); released at close."""
        self._state.leaked.append(handle)

    def close(self) -> None:
        self._finalizer()

    @property
    def closed(self) -> bool:
        return self._state.agent is None
