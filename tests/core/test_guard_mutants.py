"""Guards a mutation audit found untested: each test fails when its guard is weakened.

Base-class guards are driven on :class:`kvwire.TransportBackend` subclasses over the local transport, called
directly (a Connection refuses first, so it never lets such a call reach the base); the rest go through real
connections, layouts and the public planner. Ordering is fixed with events, never with sleeps.
"""

from __future__ import annotations

import textwrap
import threading
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray

import kvwire
from kvwire import BackendConfig, KVBuffer, KVLayout, TransferPlan
from kvwire.backends.local import LocalBackend, LocalTransport
from kvwire.connection.pool import Submissions
from kvwire.lint import lint_tree

from backends_for_tests import ReturnsStatus

PAGES = 8
PAGE_BYTES = 64


class _EngineFuture(Future[None]):
    """An engine's future for one submitted write; records that someone asked to cancel it."""

    def __init__(self) -> None:
        super().__init__()
        self.cancel_asked = threading.Event()

    def cancel(self) -> bool:
        self.cancel_asked.set()
        return super().cancel()


class _HeldTransport(LocalTransport):
    """The local transport with a non-blocking ``submit`` whose futures the test completes (``held``, in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[_EngineFuture] = []

    def submit(self, session_id: str, plan: TransferPlan, notification: bytes | None) -> Future[None]:
        future = _EngineFuture()
        self.held.append(future)
        return future


class HeldSubmit(LocalBackend):
    """The local backend, submitting natively through :class:`_HeldTransport` (notifications too)."""

    capabilities = LocalBackend.capabilities | {"submit"}

    def open_transport(self, config: BackendConfig) -> _HeldTransport:
        return _HeldTransport()


class SubmitWithoutNotifications(HeldSubmit):
    """Submits natively, declares no notifications (its transport would carry them: only the base refuses)."""

    capabilities = frozenset({"submit", "mla", "host_memory"})


class _Memory:
    """A source and a destination MLA buffer of ``PAGES`` pages, with the sender's and receiver's layouts."""

    def __init__(self) -> None:
        rng = np.random.default_rng(7)
        self.src, self.dst = rng.integers(0, 256, (2, PAGES, PAGE_BYTES), dtype=np.uint8)
        self.local, self.peer = KVLayout.mla([self.src]), KVLayout.mla([self.dst])
        self.ptrs = [int(self.dst.ctypes.data)]


def _ids(*pages: int) -> NDArray[np.int32]:
    return np.array(pages, np.int32)


def _refusal(backend: str, why: str) -> str:
    return f"backend {backend} does not support 'notifications', needed for {why}; nothing was sent"


@pytest.fixture
def direct() -> Iterator[tuple[SubmitWithoutNotifications, LocalBackend, str, _Memory]]:
    """A submit-only backend called directly, its layout registered and a receiving local backend as its peer."""
    memory = _Memory()
    sender, receiver = SubmitWithoutNotifications(BackendConfig()), LocalBackend(BackendConfig())
    sender.register_kv_buffers(memory.local)
    receiver.register_kv_buffers(memory.peer)
    endpoint = receiver.endpoint()
    sender.add_peer(endpoint, memory.peer)
    yield sender, receiver, endpoint, memory
    sender.close()
    receiver.close()


# -- TransportBackend: a direct caller gets the refusal the Connection gives -------------------------------------------


def test_the_base_submit_refuses_a_notification_its_backend_does_not_declare(
    direct: tuple[SubmitWithoutNotifications, LocalBackend, str, _Memory],
) -> None:
    sender, receiver, endpoint, memory = direct
    request = kvwire.TransferRequest(_ids(1, 2), memory.ptrs, _ids(3, 4))
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        sender.submit_kvcache(endpoint, request, notification=b"req-1")
    assert str(exc.value) == _refusal("'SubmitWithoutNotifications'", "submit_kvcache")
    transport = sender.transport
    assert isinstance(transport, _HeldTransport)
    assert transport.held == []  # nothing reached the transport
    future = sender.submit_kvcache(endpoint, request)  # the same submission without a notification is taken
    assert len(transport.held) == 1 and not future.done()
    assert receiver.poll_notifications() == []


def test_the_base_send_notification_refuses_a_backend_that_does_not_declare_notifications(
    direct: tuple[SubmitWithoutNotifications, LocalBackend, str, _Memory],
) -> None:
    sender, receiver, endpoint, _ = direct
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        sender.send_notification(endpoint, b"req-1")
    assert str(exc.value) == _refusal("'SubmitWithoutNotifications'", "send_notification")
    assert receiver.poll_notifications() == []  # the transport, which carries them, was never asked
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        sender.poll_notifications()
    assert str(exc.value) == _refusal("'SubmitWithoutNotifications'", "poll_notifications")


# -- Connection --------------------------------------------------------------------------------------------------------


@pytest.fixture
def registry() -> kvwire.Registry:
    registry = kvwire.Registry(allow=["local"], policy="strict")
    registry.register("held", HeldSubmit)
    return registry


@pytest.fixture
def held(registry: kvwire.Registry) -> Iterator[tuple[kvwire.Connection, _HeldTransport, str, _Memory]]:
    """A connection to a native-submit backend whose engine futures the test completes, and its peer."""
    memory = _Memory()
    sender, receiver = registry.connect("held"), kvwire.connect("local")
    sender.register_kv_buffers(memory.local)
    receiver.register_kv_buffers(memory.peer)
    endpoint = receiver.endpoint()
    sender.add_peer(endpoint, memory.peer)
    transport = sender.backend.transport
    assert isinstance(transport, _HeldTransport)
    yield sender, transport, endpoint, memory
    for future in transport.held:
        if not future.done() and not future.cancel():
            future.set_result(None)  # started: complete it
    sender.close()
    receiver.close()


def test_a_native_submission_while_close_is_draining_never_reaches_the_backend(
    held: tuple[kvwire.Connection, _HeldTransport, str, _Memory],
) -> None:
    sender, transport, endpoint, memory = held
    running = sender.submit_kvcache(endpoint, _ids(0, 1), memory.ptrs, _ids(0, 1))
    (engine,) = transport.held
    assert engine.set_running_or_notify_cancel()  # the engine started it: close() must wait for it
    closer = threading.Thread(target=sender.close)
    closer.start()
    try:
        assert engine.cancel_asked.wait(10)  # close() is draining (it refuses new transfers before it cancels)
        with pytest.raises(kvwire.BackendError) as exc:
            sender.submit_kvcache(endpoint, _ids(2, 3), memory.ptrs, _ids(2, 3))
        assert str(exc.value) == "connection to backend 'held' is closing; nothing was sent"
        assert transport.held == [engine]  # the refused request never reached the backend
    finally:
        engine.set_result(None)
        closer.join(timeout=10)
    assert not closer.is_alive()
    assert running.result(timeout=0) == 2 * PAGE_BYTES


def test_a_native_transfer_whose_engine_future_is_cancelled_is_cancelled(
    held: tuple[kvwire.Connection, _HeldTransport, str, _Memory],
) -> None:
    sender, transport, endpoint, memory = held
    future = sender.submit_kvcache(endpoint, _ids(0, 1), memory.ptrs, _ids(0, 1))
    (engine,) = transport.held
    assert engine.cancel()  # the engine (or the backend) cancels its own future, not the handle
    done, _ = wait([future], timeout=0)
    assert done == {future}
    assert future.cancelled()


@pytest.mark.parametrize("flag", [True, False])
def test_a_bool_returned_as_bytes_moved_is_a_backend_error(flag: bool) -> None:
    registry = kvwire.Registry(allow=["local"], policy="strict")
    registry.register("flag", type("ReturnsFlag", (ReturnsStatus,), {"returns": flag}))
    layout = KVLayout((KVBuffer(4096, PAGE_BYTES, 16, 0, "kv"),))  # the recorder moves nothing: no memory needed
    with registry.connect("flag") as conn:
        conn.register_kv_buffers(layout)
        conn.add_peer("p", layout)
        with pytest.raises(kvwire.BackendError) as exc:
            conn.send_kvcache("p", _ids(1), [4096], _ids(1))
        assert str(exc.value) == (
            f"backend 'flag': send_kvcache returned {flag}; the spec requires the bytes moved (an int >= 0) "
            "and failures raised as kvwire.TransferError"
        )
        future = conn.submit_kvcache("p", _ids(1), [4096], _ids(1))  # the core's pool runs the same hook
        with pytest.raises(kvwire.BackendError) as exc:
            future.result(timeout=10)
        assert str(exc.value) == (
            f"backend 'flag': send_kvcache returned {flag}; the spec requires the bytes moved (an int >= 0) "
            "and failures raised as kvwire.TransferError"
        )


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


# -- NotificationWatcher -----------------------------------------------------------------------------------------------


def test_the_notifications_of_one_poll_are_kept_and_seen_in_arrival_order() -> None:
    memory = _Memory()
    with kvwire.connect("local") as sender, kvwire.connect("local") as receiver:
        sender.register_kv_buffers(memory.local)
        receiver.register_kv_buffers(memory.peer)
        endpoint = receiver.endpoint()
        sender.add_peer(endpoint, memory.peer)
        messages = [b"r%d" % k for k in range(6)]
        for message in messages:
            sender.send_notification(endpoint, message)
        seen: list[bytes] = []
        with kvwire.NotificationWatcher(receiver, lambda a: seen.append(a.notification.message)) as watcher:
            kept = watcher.wait(len(messages), 10.0)  # all six came in the watcher's first poll
        assert [a.notification.message for a in kept] == messages
        assert seen == messages


@pytest.mark.parametrize("poll_s", [1.5, 60, float("inf")])
def test_a_poll_interval_above_one_second_is_refused(poll_s: float) -> None:
    with kvwire.connect("local") as receiver:
        with pytest.raises(kvwire.ConfigError) as exc:
            kvwire.NotificationWatcher(receiver, poll_s=poll_s)
        assert str(exc.value) == f"poll_s must be a number of seconds in [0, 1], got {poll_s!r}"


# -- planning: ids past the first 16 are range-checked by the fast path, naming the argument ---------------------------


_PLAN_LOCAL = KVLayout((KVBuffer(1 << 20, PAGE_BYTES, 64, 0, "kv"),))
_PLAN_PEER = KVLayout((KVBuffer(1 << 30, PAGE_BYTES, 64, 0, "kv"),))


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
@pytest.mark.parametrize("argument", ["prefill_kv_indices", "dst_kv_indices"])
@pytest.mark.parametrize("bad", [-1, 64, 1000])
def test_a_bad_page_id_past_the_first_16_is_refused_naming_the_argument(
    dtype: type[np.integer], argument: str, bad: int
) -> None:
    src, dst = np.arange(20, dtype=dtype), np.arange(20, dtype=dtype)
    (src if argument == "prefill_kv_indices" else dst)[17] = bad
    if bad < 0:
        message = f"{argument}[17] = {bad} is negative: page ids must be >= 0"
    elif argument == "prefill_kv_indices":
        message = f"prefill_kv_indices[17] = {bad} is out of range: local buffer 0 (layer 0, kv) has 64 pages"
    else:
        message = f"dst_kv_indices[17] = {bad} is out of range: peer buffer 0 (layer 0, kv, host) has 64 pages"
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        kvwire.plan_transfer(_PLAN_LOCAL, _PLAN_PEER, src, [1 << 30], dst)
    assert str(exc.value) == message


def test_a_negative_int32_page_id_is_refused_when_buffers_have_more_than_2_31_pages() -> None:
    huge = 1 << 32  # an int32 -1 read as unsigned (2**32 - 1) is below this limit
    local = KVLayout((KVBuffer(1 << 20, 1, huge, 0, "kv"),))
    peer = KVLayout((KVBuffer(1 << 40, 1, huge, 0, "kv"),))
    src = np.arange(20, dtype=np.int32)
    dst = np.arange(20, dtype=np.int32)
    src[17] = -1
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        kvwire.plan_transfer(local, peer, src, [1 << 40], dst)
    assert str(exc.value) == "prefill_kv_indices[17] = -1 is negative: page ids must be >= 0"


# -- layout: a buffer may end at 2**63 - 1, not past it ----------------------------------------------------------------


def test_a_buffer_may_end_exactly_at_the_address_limit_and_not_one_byte_past() -> None:
    last = 2**63 - 1 - PAGE_BYTES * 4  # base + 4 pages ends at 2**63 - 1
    assert KVBuffer(last, PAGE_BYTES, 4, 0).end == 2**63 - 1
    with pytest.raises(kvwire.LayoutError) as exc:
        KVBuffer(last + 1, PAGE_BYTES, 4, 0)
    assert str(exc.value) == (
        f"KVBuffer.base + page_bytes * num_pages = {last + 1:#x} + 64 * 4 ends past 2**63 - 1: "
        "not an address range of this platform"
    )


# -- kvwire lint -------------------------------------------------------------------------------------------------------


def test_an_override_taking_kwargs_accepts_a_keyword_only_base_parameter(tmp_path: Path) -> None:
    source = """
        class Base:
            def f(self, x, *, key=1):
                pass


        class Passes(Base):
            def f(self, x, **kwargs):
                pass


        class Drops(Base):
            def f(self, x):
                pass
    """
    (tmp_path / "mod.py").write_text(textwrap.dedent(source).lstrip("\n"))
    found = [(f.subclass, f.parameter, f.message) for f in lint_tree(tmp_path)]
    assert found == [
        ("Drops", "key", "keyword-only parameter `key` of the base is missing (a caller passing it gets a TypeError)")
    ]  # `Passes` takes key= through **kwargs: no finding
