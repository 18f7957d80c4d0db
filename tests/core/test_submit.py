"""Connection.submit_kvcache: the core's pool for backends without ``submit``, a native hook for those with it."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import pytest
from held_submit import PAGE_BYTES, HeldTransport, Memory, ids

import kvwire
from kvwire.backends.local import LocalBackend, LocalTransport
from kvwire.connection.pool import Submissions
from kvwire.testing.receiver import LayoutSpec
from kvwire.workload.memory import digest

from backends_for_tests import Recorder

SPEC = LayoutSpec("mha", (0, 1), 64, 4096)


class GatedTransport(LocalTransport):
    """The local transport, whose writes wait for ``gate`` (set by the test) before copying."""

    gate = threading.Event()
    started = threading.Semaphore(0)

    def write(self, session_id: str, plan: kvwire.TransferPlan) -> None:
        type(self).started.release()
        assert type(self).gate.wait(10), "the test never opened the gate"
        super().write(session_id, plan)


class Gated(LocalBackend):
    def open_transport(self, config: kvwire.BackendConfig) -> LocalTransport:
        return GatedTransport()


class Pair:
    def __init__(self, registry: kvwire.Registry, backend: str) -> None:
        self.src, self.dst = SPEC.allocate(1), SPEC.allocate(2)
        self.sender, self.receiver = registry.connect(backend), registry.connect(backend)
        self.sender.register_kv_buffers(self.src.layout)
        self.receiver.register_kv_buffers(self.dst.layout)
        self.endpoint = self.receiver.endpoint()
        self.sender.add_peer(self.endpoint, self.dst.layout)
        self.ptrs = [b.base for b in self.dst.layout.buffers]

    def submit(self, pages: range | list[int], **kwargs: Any) -> kvwire.TransferFuture:
        ids = np.array(list(pages), np.int32)
        return self.sender.submit_kvcache(self.endpoint, ids, self.ptrs, ids, **kwargs)

    def pages_equal(self, pages: range | list[int]) -> bool:
        return all(
            digest([s[list(pages)]]) == digest([d[list(pages)]])
            for s, d in zip(self.src.views, self.dst.views, strict=True)
        )

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


@pytest.fixture
def registry() -> kvwire.Registry:
    registry = kvwire.Registry(allow=["local"], policy="strict")
    registry.register("gated", Gated)
    return registry


@pytest.fixture
def pair(registry: kvwire.Registry) -> Iterator[Pair]:
    p = Pair(registry, "local")
    yield p
    p.close()


@pytest.fixture
def gated(registry: kvwire.Registry) -> Iterator[Pair]:
    GatedTransport.gate = threading.Event()
    GatedTransport.started = threading.Semaphore(0)
    p = Pair(registry, "gated")
    yield p
    GatedTransport.gate.set()
    p.close()


def test_submit_returns_a_future_of_the_bytes_moved_and_the_bytes_land(pair: Pair) -> None:
    future = pair.submit(range(0, 8))
    assert isinstance(future, Future) and isinstance(future, kvwire.TransferFuture)
    assert (future.session_id, future.nbytes, future.descriptors) == (pair.endpoint, 8 * 4096 * 4, 4)
    assert future.result(timeout=10) == 8 * 4096 * 4
    assert pair.pages_equal(range(0, 8))
    assert not pair.pages_equal(range(8, 16))


def test_invalid_input_is_refused_synchronously_and_nothing_is_queued(gated: Pair) -> None:
    before = digest(gated.dst.views)
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        gated.submit([1, 64])
    assert str(exc.value) == "prefill_kv_indices[1] = 64 is out of range: local buffer 0 (layer 0, k) has 64 pages"
    unknown = r"^session_id 'nobody' is unknown: call add_peer\(session_id, layout\) first \(known: "
    with pytest.raises(kvwire.InvalidTransferError, match=unknown):
        gated.sender.submit_kvcache("nobody", np.array([1], np.int32), gated.ptrs, np.array([1], np.int32))
    assert not GatedTransport.started.acquire(timeout=0.2)  # no write ever started
    GatedTransport.gate.set()
    assert digest(gated.dst.views) == before


def test_many_submissions_from_several_threads_each_complete_with_verified_bytes(pair: Pair) -> None:
    def submit_block(t: int) -> list[tuple[range, kvwire.TransferFuture]]:
        blocks = [range(t * 16 + k * 4, t * 16 + k * 4 + 4) for k in range(4)]
        return [(b, pair.submit(b)) for b in blocks]

    with ThreadPoolExecutor(4) as callers:
        submitted = [item for items in callers.map(submit_block, range(4)) for item in items]
    assert len(submitted) == 16
    for pages, future in submitted:
        assert future.result(timeout=10) == len(pages) * 4096 * 4
    assert pair.pages_equal(range(64))


class _NamingPool(ThreadPoolExecutor):
    """Records the thread each submitted job runs on, from inside the job (no race with its completion)."""

    def __init__(self) -> None:
        super().__init__(1, thread_name_prefix="host-pool")
        self.ran_on: list[str] = []

    def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Future[Any]:
        def named() -> Any:
            self.ran_on.append(threading.current_thread().name)
            return fn(*args, **kwargs)

        return super().submit(named)


def test_the_callers_executor_runs_the_send(pair: Pair) -> None:
    with _NamingPool() as pool:
        future = pair.submit(range(4), executor=pool)
        assert future.result(timeout=10) == 4 * 4096 * 4
    assert len(pool.ran_on) == 1 and pool.ran_on[0].startswith("host-pool")


def test_cancel_before_start_is_honoured_and_after_start_is_refused(gated: Pair) -> None:
    with ThreadPoolExecutor(1) as pool:
        first = gated.submit(range(0, 4), executor=pool)
        assert GatedTransport.started.acquire(timeout=10)  # the first write is running: the pool is busy
        second = gated.submit(range(4, 8), executor=pool)
        assert second.cancel() and second.cancelled()
        assert not first.cancel()  # started: runs to its end
        GatedTransport.gate.set()
        assert first.result(timeout=10) == 4 * 4096 * 4
    assert gated.pages_equal(range(0, 4)) and not gated.pages_equal(range(4, 8))


def test_asyncio_wrap_future(pair: Pair) -> None:
    async def main() -> int:
        return await asyncio.wrap_future(pair.submit(range(2)))

    assert asyncio.run(main()) == 2 * 4096 * 4


def test_a_failed_transfer_fails_its_future_with_the_typed_error(pair: Pair) -> None:
    pair.receiver.close()  # the local endpoint is gone: the write itself fails
    future = pair.submit(range(4))
    with pytest.raises(kvwire.PeerUnreachableError, match="is not in this process or was closed"):
        future.result(timeout=10)


def test_close_with_transfers_in_flight_ends_every_one(gated: Pair) -> None:
    with ThreadPoolExecutor(1) as pool:
        running = gated.submit(range(0, 4), executor=pool)
        assert GatedTransport.started.acquire(timeout=10)
        queued = [gated.submit(range(4 + 4 * k, 8 + 4 * k), executor=pool) for k in range(3)]
        threading.Timer(0.2, GatedTransport.gate.set).start()
        gated.sender.close()
        assert running.result(timeout=0) == 4 * 4096 * 4
        assert all(f.cancelled() for f in queued)
    with pytest.raises(kvwire.BackendError, match="is closed"):
        gated.submit(range(4))


def test_close_waits_for_the_core_pool_and_nothing_is_left_pending(gated: Pair) -> None:
    futures = [gated.submit(range(4 * k, 4 * k + 4)) for k in range(8)]  # 4 run, 4 wait in the core's pool
    for _ in range(4):
        assert GatedTransport.started.acquire(timeout=10)
    threading.Timer(0.2, GatedTransport.gate.set).start()
    gated.sender.close()
    _, pending = wait(futures, timeout=0)
    assert not pending
    assert sum(not f.cancelled() for f in futures) == 4
    assert all(f.result() == 4 * 4096 * 4 for f in futures if not f.cancelled())


# -- native submission (a backend that declares ``submit``) --------------------------------------------------


class NativeRecorder(Recorder):
    capabilities = Recorder.capabilities | {"submit"}
    returns: Any = None

    @kvwire.hookimpl
    def submit_kvcache(
        self, session_id: str, request: kvwire.TransferRequest, notification: bytes | None = None
    ) -> Future[int]:
        self.calls.append(("submit_kvcache", {"session_id": session_id, "request": request}))
        if type(self).returns is not None:
            return type(self).returns  # type: ignore[no-any-return]
        future: Future[int] = Future()
        future.set_result(4096)
        return future


def _native(registry: kvwire.Registry, returns: Any = None) -> kvwire.Connection:
    NativeRecorder.returns = returns
    registry.register("native", NativeRecorder)
    return registry.connect("native")


def test_a_native_backend_receives_the_checked_request(registry: kvwire.Registry) -> None:
    conn = _native(registry)
    idx = np.array([1, 2], np.int32)
    future = conn.submit_kvcache("peer:1", idx, [4096], idx, None, dst_kv_item_len=None)
    assert future.result(timeout=1) == 4096 and future.nbytes is None
    name, received = conn.backend.calls[-1]
    assert name == "submit_kvcache" and isinstance(received["request"], kvwire.TransferRequest)
    assert received["request"].arguments()["prefill_kv_indices"].tolist() == [1, 2]
    assert not any(call == "send_kvcache" for call, _ in conn.backend.calls)


@pytest.mark.parametrize(
    ("returns", "error"),
    [
        (7, "backend 'native': submit_kvcache returned int, expected a concurrent.futures.Future of the bytes moved"),
        ("bad-result", "backend 'native': submit_kvcache returned -1; the spec requires the bytes moved"),
        ("raises", "backend 'native' raised RuntimeError in submit_kvcache: engine exploded"),
    ],
)
def test_a_native_backend_that_breaks_the_contract_gets_a_backend_error(
    registry: kvwire.Registry, returns: object, error: str
) -> None:
    if returns == "bad-result":
        returns = Future()
        returns.set_result(-1)
    elif returns == "raises":
        returns = Future()
        returns.set_exception(RuntimeError("engine exploded"))
    conn = _native(registry, returns)
    idx = np.array([1], np.int32)
    if isinstance(returns, Future):
        future = conn.submit_kvcache("peer:1", idx, [4096], idx)
        with pytest.raises(kvwire.BackendError) as exc:
            future.result(timeout=1)
    else:
        with pytest.raises(kvwire.BackendError) as exc:
            conn.submit_kvcache("peer:1", idx, [4096], idx)
    assert str(exc.value).startswith(error)


def test_cancelling_the_handle_cancels_the_native_future(registry: kvwire.Registry) -> None:
    inner: Future[int] = Future()
    conn = _native(registry, inner)
    idx = np.array([1], np.int32)
    future = conn.submit_kvcache("peer:1", idx, [4096], idx)
    assert future.cancel() and inner.cancelled() and future.cancelled()


def test_a_shut_down_executor_is_refused_and_nothing_is_sent(pair: Pair) -> None:
    before = digest(pair.dst.views)
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    with pytest.raises(kvwire.BackendError) as exc:
        pair.submit(range(4), executor=pool)
    assert str(exc.value) == (
        "cannot queue the transfer on ThreadPoolExecutor: RuntimeError: cannot schedule new futures after shutdown; "
        "nothing was sent"
    )
    assert digest(pair.dst.views) == before


def test_a_submission_while_close_is_draining_is_refused(gated: Pair) -> None:
    running = gated.submit(range(0, 4))
    assert GatedTransport.started.acquire(timeout=10)
    closer = threading.Thread(target=gated.sender.close)
    closer.start()
    deadline = time.monotonic() + 10
    while not gated.sender._submissions.closing and time.monotonic() < deadline:
        time.sleep(0.001)
    before = digest(gated.dst.views[0][4:8])
    with pytest.raises(kvwire.BackendError) as exc:
        gated.submit(range(4, 8))
    assert str(exc.value) == "connection to backend 'gated' is closing; nothing was sent"
    GatedTransport.gate.set()
    closer.join(timeout=10)
    assert running.result(timeout=0) == 4 * 4096 * 4
    assert digest(gated.dst.views[0][4:8]) == before


def test_a_core_pool_submission_is_planned_once_and_its_bytes_land(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvwire.planning import planner

    calls: list[int] = []
    real = planner.plan_transfer

    def counted(*args: Any, **kwargs: Any) -> kvwire.TransferPlan:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, "plan_transfer", counted)
    assert pair.submit(range(4)).result(timeout=10) == 4 * 4096 * 4
    assert len(calls) == 1  # the Connection planned it; the backend's send reused that plan
    assert pair.pages_equal(range(4))
    ids = np.arange(4, 8, dtype=np.int32)
    assert pair.sender.send_kvcache(pair.endpoint, ids, pair.ptrs, ids) == 4 * 4096 * 4
    assert len(calls) == 2 and pair.pages_equal(range(4, 8))


def test_a_send_reaches_the_base_as_plain_arguments_on_the_callers_thread() -> None:
    """The Connection hands the request it built, the caller's executor and its plan to send_request, same thread."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from kvwire.backends.local import LocalBackend, LocalTransport

    seen: list[tuple[object, ...]] = []

    class Watched(LocalBackend):
        def send_request(self, session_id: str, request: kvwire.TransferRequest, executor: object = None,
                         *, plan: kvwire.TransferPlan | None = None) -> int:  # fmt: skip
            seen.append((request, executor, plan, threading.get_ident()))
            return super().send_request(session_id, request, executor, plan=plan)  # type: ignore[arg-type]

        def open_transport(self, config: kvwire.BackendConfig) -> LocalTransport:
            return LocalTransport()

    registry = kvwire.Registry(allow=["watched"], policy="strict")
    registry.register("watched", Watched)
    page = np.zeros((8, 512), np.uint8)
    with registry.connect("watched") as conn, kvwire.connect("local") as peer, ThreadPoolExecutor(1) as pool:
        dst = np.zeros_like(page)
        conn.register_kv_buffers(kvwire.KVLayout.mla([page]))
        peer.register_kv_buffers(kvwire.KVLayout.mla([dst]))
        conn.add_peer(peer.endpoint(), kvwire.KVLayout.mla([dst]))
        src_ids, dst_ids = np.array([1, 2], np.int32), np.array([5, 6], np.int32)
        assert conn.send_kvcache(peer.endpoint(), src_ids, [int(dst.ctypes.data)], dst_ids, pool) == 1024
        ((request, executor, plan, thread),) = seen
        assert isinstance(request, kvwire.TransferRequest) and request.dst_kv_indices is dst_ids
        assert request.prefill_kv_indices is src_ids and executor is pool
        assert isinstance(plan, kvwire.TransferPlan) and plan.nbytes == 1024  # planned once, by the Connection
        assert thread == threading.get_ident()  # no call thread for a backend bounded by contract
        assert conn.stuck_calls == ()


def test_a_native_submission_while_close_is_draining_never_reaches_the_backend(
    held: tuple[kvwire.Connection, HeldTransport, str, Memory],
) -> None:
    sender, transport, endpoint, memory = held
    running = sender.submit_kvcache(endpoint, ids(0, 1), memory.ptrs, ids(0, 1))
    (engine,) = transport.held
    assert engine.set_running_or_notify_cancel()  # the engine started it: close() must wait for it
    closer = threading.Thread(target=sender.close)
    closer.start()
    try:
        assert engine.cancel_asked.wait(10)  # close() is draining (it refuses new transfers before it cancels)
        with pytest.raises(kvwire.BackendError) as exc:
            sender.submit_kvcache(endpoint, ids(2, 3), memory.ptrs, ids(2, 3))
        assert str(exc.value) == "connection to backend 'held' is closing; nothing was sent"
        assert transport.held == [engine]  # the refused request never reached the backend
    finally:
        engine.set_result(None)
        closer.join(timeout=10)
    assert not closer.is_alive()
    assert running.result(timeout=0) == 2 * PAGE_BYTES


def test_a_native_transfer_whose_engine_future_is_cancelled_is_cancelled(
    held: tuple[kvwire.Connection, HeldTransport, str, Memory],
) -> None:
    sender, transport, endpoint, memory = held
    future = sender.submit_kvcache(endpoint, ids(0, 1), memory.ptrs, ids(0, 1))
    (engine,) = transport.held
    assert engine.cancel()  # the engine (or the backend) cancels its own future, not the handle
    done, _ = wait([future], timeout=0)
    assert done == {future}
    assert future.cancelled()


# -- the core's pool ---------------------------------------------------------------------------------------------------


def test_a_job_the_executor_refuses_leaves_its_future_cancelled_not_pending() -> None:
    submissions = Submissions("unit")
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    future = kvwire.TransferFuture("peer", 0, 0)
    ran: list[str] = []

    def job() -> int:
        ran.append("job")
        return 0

    with pytest.raises(kvwire.BackendError) as exc:
        submissions.run(future, job, pool)
    assert str(exc.value) == (
        "cannot queue the transfer on ThreadPoolExecutor: RuntimeError: cannot schedule new futures after shutdown; "
        "nothing was sent"
    )
    done, _ = wait([future], timeout=0)
    assert done == {future} and future.cancelled()
    assert submissions.pending() == []
    assert ran == []
