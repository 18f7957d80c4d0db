"""Hostile input, round 3 (issue 23): what a peer or a caller pushes at the watcher, the planner and the adapter.

Each test states the defect it closes and fails on the code before the fix.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor, wait
from pathlib import Path

import numpy as np
import pytest
from numpy.typing import NDArray
from submit_scenarios import _outcome

import kvwire
from kvwire.testing.receiver import LayoutSpec
from kvwire_sglang import SglangSender

SPEC = LayoutSpec("mha", (0, 1), 32, 1024)

Pair = tuple[kvwire.Connection, kvwire.Connection, str]


@pytest.fixture
def pair() -> Iterator[Pair]:
    src, dst = SPEC.allocate(1), SPEC.allocate(2)
    with kvwire.connect("local") as sender, kvwire.connect("local") as receiver:
        sender.register_kv_buffers(src.layout)
        receiver.register_kv_buffers(dst.layout)
        sender.add_peer(receiver.endpoint(), dst.layout)
        yield sender, receiver, receiver.endpoint()


# -- NotificationWatcher ---------------------------------------------------------------------------------


def test_a_flood_nobody_takes_is_bounded_and_counted(pair: Pair) -> None:
    """Defect 4: every arrival was kept; 100,000 x 1 KiB took RSS from 39 to 160 MiB."""
    sender, receiver, endpoint = pair
    seen = threading.Event()
    count = [0]

    def on_arrival(_: kvwire.Arrival) -> None:
        count[0] += 1
        if count[0] == 20_000:
            seen.set()

    with kvwire.NotificationWatcher(receiver, on_arrival, max_kept=1000) as watcher:
        for i in range(20_000):
            sender.send_notification(endpoint, i.to_bytes(4, "big") + bytes(1020))
        assert seen.wait(30)
        kept = watcher.wait(1000, timeout_s=5)
        assert len(kept) == 1000 and watcher.dropped == 19_000
        assert [a.notification.message[:4] for a in kept] == [i.to_bytes(4, "big") for i in range(19_000, 20_000)]
        assert watcher.wait_for((0).to_bytes(4, "big") + bytes(1020), timeout_s=0) is None  # dropped: the oldest
        taken = watcher.wait_for((19_500).to_bytes(4, "big") + bytes(1020), timeout_s=0)
        assert taken is not None and len(watcher.wait(0, timeout_s=0)) == 999


def test_a_watcher_that_keeps_nothing_keeps_nothing(pair: Pair) -> None:
    sender, receiver, endpoint = pair
    got: list[bytes] = []
    done = threading.Event()

    def on_arrival(arrival: kvwire.Arrival) -> None:
        got.append(arrival.notification.message)
        if len(got) == 3:
            done.set()

    with kvwire.NotificationWatcher(receiver, on_arrival, max_kept=0) as watcher:
        for m in (b"a", b"b", b"c"):
            sender.send_notification(endpoint, m)
        assert done.wait(10)
        assert got == [b"a", b"b", b"c"]
        assert watcher.wait(0, timeout_s=0) == [] and watcher.dropped == 3


def test_a_raising_callback_loses_no_arrival_of_its_poll(pair: Pair) -> None:
    """Defect 5: n2 and n3 of the poll whose n1 made on_arrival raise could no longer be obtained."""
    sender, receiver, endpoint = pair
    for m in (b"n1", b"n2", b"n3"):
        sender.send_notification(endpoint, m)  # before the watcher: its first poll takes all three at once

    def on_arrival(arrival: kvwire.Arrival) -> None:
        raise RuntimeError(f"cannot digest {arrival.notification.message!r}")

    watcher = kvwire.NotificationWatcher(receiver, on_arrival)
    with pytest.raises(RuntimeError, match="cannot digest b'n1'"):
        watcher.wait(3, timeout_s=10)
    with pytest.raises(RuntimeError, match="cannot digest b'n1'"):
        watcher.stop()
    assert [a.notification.message for a in watcher.kept] == [b"n1", b"n2", b"n3"]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda w: w.wait("1", 0.1), "count must be an int >= 0, got '1'"),
        (lambda w: w.wait(1, "0.1"), "timeout_s must be a finite number of seconds >= 0, got '0.1'"),
        (lambda w: w.wait_for("abc", 0.1), "message must be bytes (notifications are bytes), got str"),
        (lambda w: w.wait_for(b"x", float("nan")), "timeout_s must be a finite number of seconds >= 0, got nan"),
        (lambda w: w.stop(-1), "timeout_s must be a finite number of seconds >= 0, got -1"),
        (lambda w: w.wait(5000, 0.1), "count 5000 is more than this watcher keeps (max_kept=4096)"),
    ],
    ids=["count-str", "timeout-str", "message-str", "timeout-nan", "stop-negative", "count-over-kept"],
)
def test_the_wait_methods_refuse_bad_arguments_by_name(pair: Pair, call: object, message: str) -> None:
    """Defect 12: wait("1", 0.1) raised a raw TypeError; wait_for("abc") silently never matched."""
    _, receiver, _ = pair
    with kvwire.NotificationWatcher(receiver) as watcher, pytest.raises(kvwire.ConfigError) as exc:
        call(watcher)  # type: ignore[operator]
    assert str(exc.value) == message


def test_stop_says_when_the_callback_thread_is_still_running(pair: Pair) -> None:
    """Defect 12: stop() returned normally after its join while the callback still ran."""
    sender, receiver, endpoint = pair
    inside, release = threading.Event(), threading.Event()

    def on_arrival(_: kvwire.Arrival) -> None:
        inside.set()
        release.wait(30)

    watcher = kvwire.NotificationWatcher(receiver, on_arrival)
    sender.send_notification(endpoint, b"slow")
    assert inside.wait(10)
    try:
        with pytest.raises(kvwire.TransferTimeoutError) as exc:
            watcher.stop(timeout_s=0.05)
        assert str(exc.value) == (
            "the notification watcher's thread is still running 0.05 s after stop(): its on_arrival callback "
            "has not returned; it stops polling once it does"
        )
    finally:
        release.set()
    watcher.stop()  # once the callback returned, stop() is clean


# -- planning and the sglang adapter ------------------------------------------------------------------------


@pytest.mark.parametrize("layer_ids", [{0: 1, 1: 0}, {1, 0}], ids=["dict", "set"])
def test_dst_layer_ids_without_an_order_are_refused_and_nothing_moves(pair: Pair, layer_ids: object) -> None:
    """Defect 8: {0: 1} was read as its keys: the data landed in peer layer 0, and the adapter returned 0."""
    sender, receiver, endpoint = pair
    ids = np.arange(2, dtype=np.int32)
    ptrs = [b.base for b in receiver._local.buffers]  # type: ignore[union-attr]
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        sender.send_kvcache(endpoint, ids, ptrs, ids, dst_layer_ids=layer_ids)  # type: ignore[arg-type]
    assert str(exc.value) == f"dst_layer_ids must be a sequence of ints or None, got {type(layer_ids).__name__}"
    assert SglangSender(sender).send_kvcache(endpoint, ids, ptrs, ids, None, dst_layer_ids=layer_ids) == -22  # type: ignore[arg-type]


def test_plan_transfer_with_something_else_than_a_layout_names_the_argument() -> None:
    """Defect 11: plan_transfer("x", ...) raised an untyped AttributeError."""
    layout = SPEC.allocate(1).layout
    ids = np.arange(2, dtype=np.int32)
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        kvwire.plan_transfer("x", layout, ids, [0], ids)  # type: ignore[arg-type]
    assert str(exc.value) == "local must be a kvwire.KVLayout, got str"
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        kvwire.plan_transfer(layout, None, ids, [0], ids)  # type: ignore[arg-type]
    assert str(exc.value) == "peer must be a kvwire.KVLayout, got NoneType"


def test_layer_ids_that_are_not_ints_are_a_refusal_not_a_crash_of_sglangs_worker(pair: Pair) -> None:
    sender, receiver, endpoint = pair
    ids = np.arange(2, dtype=np.int32)
    ptrs = [b.base for b in receiver._local.buffers]  # type: ignore[union-attr]
    assert SglangSender(sender).send_kvcache(endpoint, ids, ptrs, ids, None, dst_layer_ids=["0", "1"]) == -22  # type: ignore[arg-type, list-item]


# -- sizes a peer controls ----------------------------------------------------------------------------------


def test_a_ten_megabyte_endpoint_is_refused_in_a_description_and_as_a_session_id(pair: Pair) -> None:
    """Leftover of round 1: a 10 MB endpoint string was accepted by PeerDescription.from_dict."""
    sender, receiver, _ = pair
    huge = "x" * (10 << 20)
    data = kvwire.PeerDescription(receiver.endpoint(), SPEC.allocate(3).layout).to_dict()
    data["endpoint"] = huge
    with pytest.raises(kvwire.LayoutError) as exc:
        kvwire.PeerDescription.from_dict(data)
    assert str(exc.value) == "peer description: 'endpoint' is 10485760 characters, over the limit of 4194304"
    with pytest.raises(kvwire.InvalidTransferError) as refused:
        sender.add_peer(huge, SPEC.allocate(3).layout)
    assert str(refused.value) == "session_id is 10485760 characters, over the limit of 4194304"


# -- the caller's executor --------------------------------------------------------------------------------


class _Refuses(Executor):
    def submit(self, fn: object, /, *args: object, **kwargs: object) -> Future[object]:
        raise ValueError("no more work today")


def test_an_executor_that_refuses_the_job_is_a_typed_error_and_leaves_nothing_in_flight(pair: Pair) -> None:
    """Defect 3: a ValueError from the executor's submit() got out untyped and left a pending future."""
    sender, receiver, endpoint = pair
    ids = np.arange(2, dtype=np.int32)
    ptrs = [b.base for b in receiver._local.buffers]  # type: ignore[union-attr]
    with pytest.raises(kvwire.BackendError) as exc:
        sender.submit_kvcache(endpoint, ids, ptrs, ids, executor=_Refuses())
    assert str(exc.value) == "cannot queue the transfer on _Refuses: ValueError: no more work today; nothing was sent"
    assert sender._submissions.pending() == []


def test_a_job_the_callers_executor_drops_at_shutdown_ends_cancelled_not_pending(pair: Pair) -> None:
    """Defect 2: after shutdown(cancel_futures=True) with the job queued, kvwire's future stayed PENDING."""
    sender, receiver, endpoint = pair
    ids = np.arange(2, dtype=np.int32)
    ptrs = [b.base for b in receiver._local.buffers]  # type: ignore[union-attr]
    pool = ThreadPoolExecutor(1)
    gate = threading.Event()
    pool.submit(gate.wait, 10)  # the one worker is busy: the transfer stays queued
    future = sender.submit_kvcache(endpoint, ids, ptrs, ids, executor=pool)
    pool.shutdown(wait=False, cancel_futures=True)
    gate.set()
    done, _ = wait([future], timeout=10)
    assert done == {future} and future.cancelled()
    assert sender._submissions.pending() == []


def test_a_job_a_process_pool_cannot_take_fails_typed_instead_of_pending(pair: Pair) -> None:
    """Defect 2: a ProcessPoolExecutor cannot pickle the job; its own future got the error, kvwire's stayed PENDING."""
    sender, receiver, endpoint = pair
    ids = np.arange(2, dtype=np.int32)
    ptrs = [b.base for b in receiver._local.buffers]  # type: ignore[union-attr]
    with ProcessPoolExecutor(1) as pool:
        future = sender.submit_kvcache(endpoint, ids, ptrs, ids, executor=pool)
        with pytest.raises(kvwire.BackendError) as exc:
            future.result(timeout=30)
    assert str(exc.value).startswith("the executor did not run the transfer (")
    assert str(exc.value).endswith("); nothing was sent")
    assert sender._submissions.pending() == []


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["mooncake", "nixl"])
def test_close_does_not_wait_for_the_submissions_it_cancelled(backend: str) -> None:
    """Defect 1: close() cancelled the queued futures, then waited timeout_s for them anyway (6.0 s at 5)."""
    from kvwire.testing.harness import ContractHarness

    spec = LayoutSpec("mha", tuple(range(8)), 512, 65536)
    harness = ContractHarness(backend, two_process=True, config=kvwire.BackendConfig(timeout_s=5.0))
    with harness.pair(spec, spec, 3) as pair:
        futures = [pair.submit(np.arange(256, dtype=np.int32), np.arange(256, dtype=np.int32))]  # 256 MiB
        futures += [
            pair.submit(np.arange(k, k + 4, dtype=np.int32), np.arange(k + 256, k + 260, dtype=np.int32))
            for k in range(0, 256, 4)
        ]
        started = time.monotonic()
        pair.connection.close()
        took = time.monotonic() - started
        assert all(f.done() for f in futures)
        # 64 small writes queued behind a 256 MiB one: some never start (cancelled, or failed "nothing was sent"
        # where the backend had taken them); the old close then waited timeout_s for the cancelled ones.
        outcomes = "".join(_outcome(f) for f in futures)
        assert "U" in outcomes, f"every submission started before close ({outcomes}): nothing was tested"
        assert took < 5.0, f"close() took {took:.2f} s with timeout_s=5: it waited for cancelled submissions"


def test_a_send_that_reaches_the_backend_after_close_is_told_it_is_closed_not_blamed() -> None:
    """Defect 10: 10 of 2,787 sends racing close() got "register_kv_buffers() must be called before send_kvcache()"."""
    from kvwire.backends.local import LocalBackend

    src, dst = SPEC.allocate(1), SPEC.allocate(2)
    backend, receiver = LocalBackend(kvwire.BackendConfig()), LocalBackend(kvwire.BackendConfig())
    backend.register_kv_buffers(src.layout)
    receiver.register_kv_buffers(dst.layout)
    backend.add_peer(receiver.endpoint(), dst.layout)
    ids = np.arange(2, dtype=np.int32)
    backend.close()  # what a racing close() has done by the time the send's hook runs
    with pytest.raises(kvwire.BackendError) as exc:
        backend.send_kvcache(receiver.endpoint(), ids, [b.base for b in dst.layout.buffers], ids, None)
    assert str(exc.value) == "backend LocalBackend is closed; nothing was sent"
    receiver.close()


# -- kvwire lint on hostile trees ------------------------------------------------------------------------------


def test_lint_reads_only_regular_files_and_reports_each_bad_one_while_checking_the_rest(tmp_path: Path) -> None:
    """Defect 9: a FIFO named x.py hung lint, a .py link to /dev/zero was read without limit, 100,000 nested
    unary minus signs and a 2,000-module re-export chain ended the run with a traceback."""
    from kvwire.lint import lint_tree

    (tmp_path / "base.py").write_text("class Base:\n    def send(self, a, b):\n        pass\n")
    (tmp_path / "good.py").write_text(
        "from base import Base\n\n\nclass Drifted(Base):\n    def send(self, a):\n        pass\n"
    )
    os.mkfifo(tmp_path / "fifo.py")
    (tmp_path / "zero.py").symlink_to("/dev/zero")
    deep = (
        "from base import Base\n\n\nclass Deep(Base):\n    def send(self, a, b=" + "-" * 100_000 + "1):\n        pass\n"
    )
    (tmp_path / "deep.py").write_text(deep)
    (tmp_path / "chain0.py").write_text("from base import Base\n")
    for i in range(1, 2000):
        (tmp_path / f"chain{i}.py").write_text(f"from chain{i - 1} import Base\n")
    (tmp_path / "far.py").write_text(
        "from chain1999 import Base\n\n\nclass Far(Base):\n    def send(self, a):\n        pass\n"
    )
    warnings: list[str] = []
    result: list[object] = []
    worker = threading.Thread(target=lambda: result.append(lint_tree(tmp_path, ["send"], warn=warnings.append)))
    worker.start()
    worker.join(60)
    assert not worker.is_alive(), "kvwire lint hung on the tree"
    (findings,) = result
    assert ("good.py", "Drifted") in {(Path(f.file).name, f.subclass) for f in findings}  # type: ignore[attr-defined]
    by_file = {w.split(":", 1)[0].rsplit("/", 1)[-1]: w for w in warnings}
    assert by_file["fifo.py"].endswith("fifo.py: not a regular file; skipped")
    assert by_file["zero.py"].endswith("zero.py: not a regular file; skipped")
    assert by_file["deep.py"].endswith("deep.py: cannot parse (MemoryError: nested too deeply); skipped")
    # the chain either resolves (Far's drift found) or is reported: never a traceback that ends the run
    far = any(Path(f.file).name == "far.py" for f in findings)  # type: ignore[attr-defined]
    assert far or any("RecursionError" in w or "nested too deeply" in w for w in warnings), warnings


def test_lint_checks_a_class_nested_in_a_class_body(tmp_path: Path) -> None:
    """Defect 9: a class nested inside a class body was never checked, so its drift was missed."""
    from kvwire.lint import lint_tree

    (tmp_path / "base.py").write_text("class Base:\n    def send(self, a, b):\n        pass\n")
    (tmp_path / "outer.py").write_text(
        "from base import Base\n\n\nclass Outer:\n    class Inner(Base):\n        class Deeper(Base):\n"
        "            def send(self, a, b, c):\n                pass\n\n        def send(self, a):\n            pass\n"
    )
    found = sorted((f.subclass, f.rule, f.parameter) for f in lint_tree(tmp_path, ["send"]))
    assert found == [("Deeper", "override-required-parameter", "c"), ("Inner", "override-missing-parameter", "b")]


# -- notifications nobody polls ------------------------------------------------------------------------------


def test_a_receiver_that_never_polls_keeps_at_most_the_limit_oldest_dropped_and_counted(pair: Pair) -> None:
    """Defect 6: unpolled notifications grew without bound; every transport now keeps them in kvwire.transport.Inbox."""
    from kvwire.transport import MAX_UNPOLLED_NOTIFICATIONS

    sender, receiver, endpoint = pair
    flood = MAX_UNPOLLED_NOTIFICATIONS + 1000
    for i in range(flood):
        sender.send_notification(endpoint, i.to_bytes(4, "big"))
    inbox = receiver.backend.transport._inbox
    assert len(inbox) == MAX_UNPOLLED_NOTIFICATIONS and inbox.dropped == 1000
    got = receiver.poll_notifications()
    assert [n.message for n in got[:2]] == [(1000).to_bytes(4, "big"), (1001).to_bytes(4, "big")]  # the oldest went
    assert got[-1].message == (flood - 1).to_bytes(4, "big") and receiver.poll_notifications() == []


def test_the_inbox_keeps_the_newest_and_counts_what_it_dropped() -> None:
    from kvwire.transport import Inbox

    inbox: Inbox[int] = Inbox(limit=3)
    inbox.extend(range(5))
    assert (inbox.drain(), inbox.dropped) == ([2, 3, 4], 2)
    inbox.extend([9])
    assert (inbox.drain(), inbox.dropped, inbox.drain()) == ([9], 2, [])


def test_lint_leaves_a_nested_class_whose_base_is_bound_in_the_enclosing_body(tmp_path: Path) -> None:
    """Python binds Impl's base to Outer.Base; lint resolves at module level, so it must not judge Impl by Base."""
    from kvwire.lint import lint_tree

    (tmp_path / "m.py").write_text(
        "class Base:\n    def send(self, a, b):\n        pass\n\n\nclass Outer:\n    class Base:\n"
        "        def send(self, a):\n            pass\n\n"
        "    class Impl(Base):\n        def send(self, a):\n            pass\n"
    )
    assert lint_tree(tmp_path, ["send"]) == []


# -- a backend call that never returns ----------------------------------------------------------------------


def test_a_send_that_never_returns_fails_typed_within_the_deadline_and_other_peers_are_still_served() -> None:
    """Leftover: a third-party backend whose send blocks forever hung the caller (timeout_s was not enforced).

    A hook-style backend (not built on kvwire.TransportBackend, whose transports end every call within
    timeout_s by contract) runs on the Connection's call threads, under the deadline.
    """
    from kvwire.backends.local import LocalBackend
    from kvwire.connection.deadline import CALL_GRACE_S

    release = threading.Event()
    entered = threading.Event()

    class Frozen:
        """A third party's hook-style backend over the local one, whose send never returns for one peer."""

        spec_version = "1.5"
        capabilities = frozenset({"layer_ids", "mha", "mla", "host_memory"})

        def __init__(self, config: kvwire.BackendConfig) -> None:
            self.inner = LocalBackend(config)

        @kvwire.hookimpl
        def register_kv_buffers(self, layout: kvwire.KVLayout) -> None:
            self.inner.register_kv_buffers(layout)

        @kvwire.hookimpl
        def endpoint(self) -> str:
            return self.inner.endpoint()

        @kvwire.hookimpl
        def add_peer(self, session_id: str, layout: kvwire.KVLayout) -> None:
            self.inner.add_peer(session_id, layout)

        @kvwire.hookimpl
        def remove_peer(self, session_id: str) -> None:
            self.inner.remove_peer(session_id)

        @kvwire.hookimpl
        def send_kvcache(
            self,
            session_id: str,
            prefill_kv_indices: NDArray[np.int32],
            dst_kv_ptrs: Sequence[int],
            dst_kv_indices: NDArray[np.int32],
            executor: Executor | None,
            dst_layer_ids: Sequence[int] | None = None,
            dst_device_kv_indices: NDArray[np.int32] | None = None,
            dst_kv_item_len: int | None = None,
            dst_attn_tp_size: int | None = None,
        ) -> int:
            if session_id == frozen_peer[0]:
                entered.set()
                release.wait(60)
            return self.inner.send_kvcache(
                session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, executor, dst_layer_ids
            )

        @kvwire.hookimpl
        def close(self) -> None:
            self.inner.close()

    frozen_peer = [""]
    registry = kvwire.Registry(allow=["frozen"], policy="strict")
    registry.register("frozen", Frozen)
    timeout_s = 0.3
    src, dst, other = SPEC.allocate(1), SPEC.allocate(2), SPEC.allocate(3)
    conn = registry.connect("frozen", kvwire.BackendConfig(timeout_s=timeout_s))
    try:
        with kvwire.connect("local") as frozen, kvwire.connect("local") as alive:
            frozen.register_kv_buffers(dst.layout)
            alive.register_kv_buffers(other.layout)
            conn.register_kv_buffers(src.layout)
            frozen_peer[0] = frozen.endpoint()
            for peer, spec in ((frozen, dst), (alive, other)):
                conn.add_peer(peer.endpoint(), spec.layout)
            ids = np.arange(4, dtype=np.int32)
            started = time.monotonic()
            with pytest.raises(kvwire.TransferTimeoutError) as exc:
                conn.send_kvcache(frozen.endpoint(), ids, [b.base for b in dst.layout.buffers], ids)
            took = time.monotonic() - started
            assert entered.is_set()
            assert timeout_s + CALL_GRACE_S <= took < timeout_s + CALL_GRACE_S + 2.0
            assert exc.value.peer == frozen.endpoint()
            assert str(exc.value).startswith(
                f"backend 'frozen': send_kvcache() did not return within {timeout_s + CALL_GRACE_S:g} s "
                f"(timeout_s plus {CALL_GRACE_S:g} s grace); it keeps running on its own thread"
            )
            assert conn.state == "degraded"
            (stuck,) = conn.stuck_calls
            assert (stuck.hook, stuck.peer) == ("send_kvcache", frozen.endpoint())
            assert "degraded" in repr(conn)
            # The process keeps serving the other peer, on the same connection, meanwhile.
            moved = conn.send_kvcache(alive.endpoint(), ids, [b.base for b in other.layout.buffers], ids)
            assert moved == 4 * SPEC.page_bytes * len(src.views)
            assert all(np.array_equal(there[:4], here[:4]) for there, here in zip(other.views, src.views))
            # A submission through the core's pool ends the same way: its future fails typed.
            future = conn.submit_kvcache(frozen.endpoint(), ids, [b.base for b in dst.layout.buffers], ids)
            with pytest.raises(kvwire.TransferTimeoutError):
                future.result(timeout=timeout_s + CALL_GRACE_S + 5)
            release.set()  # the backend returns at last: the connection is whole again
            deadline = time.monotonic() + 10
            while conn.stuck_calls and time.monotonic() < deadline:
                time.sleep(0.01)
            assert conn.stuck_calls == () and conn.state == "open"
    finally:
        release.set()
        conn.close()
    assert conn.state == "closed"


def test_what_the_inbox_dropped_is_counted_in_metrics_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    """Deliverable 2: the drops of every backend's bounded inbox reach kvwire_notifications_dropped_total."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from kvwire.metrics import Metrics
    from kvwire.transport import MAX_UNPOLLED_NOTIFICATIONS

    registry = prometheus_client.CollectorRegistry()
    metrics = Metrics(registry)
    src, dst = SPEC.allocate(1), SPEC.allocate(2)
    with kvwire.connect("local") as sender, kvwire.connect("local", middleware=[metrics.middleware("local")]) as rx:
        sender.register_kv_buffers(src.layout)
        rx.register_kv_buffers(dst.layout)
        sender.add_peer(rx.endpoint(), dst.layout)
        for i in range(MAX_UNPOLLED_NOTIFICATIONS + 7):
            sender.send_notification(rx.endpoint(), i.to_bytes(4, "big"))
        with caplog.at_level("WARNING", logger="kvwire.notifications"):
            got = rx.poll_notifications()
        assert len(got) == MAX_UNPOLLED_NOTIFICATIONS
        assert registry.get_sample_value("kvwire_notifications_dropped_total", {"backend": "local"}) == 7
        assert registry.get_sample_value("kvwire_notifications_received_total", {"backend": "local"}) == len(got)
        assert f"7 notification(s) dropped since the last poll: more than {MAX_UNPOLLED_NOTIFICATIONS}" in caplog.text
        rx.poll_notifications()  # nothing new dropped: the counter stays
        assert registry.get_sample_value("kvwire_notifications_dropped_total", {"backend": "local"}) == 7


@pytest.mark.slow
def test_a_mooncake_receiver_that_never_polls_is_drained_into_the_bounded_inbox() -> None:
    """Defect 6 on Mooncake: the C++ engine kept every unpolled notification; kvwire now drains it into an Inbox."""
    pytest.importorskip("mooncake")
    from kvwire.transport import Inbox
    from kvwire_mooncake.engine import MooncakeEngine

    with MooncakeEngine(kvwire.BackendConfig(host="127.0.0.1")) as tx, MooncakeEngine(
        kvwire.BackendConfig(host="127.0.0.1")
    ) as rx:
        buf = np.zeros(4096, dtype=np.uint8)
        tx.register(int(buf.ctypes.data), buf.nbytes)
        assert rx._received is not None
        rx._received.inbox = Inbox(limit=50)  # the default bound (65,536) is the same code with a bigger number
        for i in range(200):
            tx.notify(rx.endpoint, i.to_bytes(4, "big") * 1024)
        deadline = time.monotonic() + 30
        while rx._received.inbox.dropped < 150 and time.monotonic() < deadline:
            time.sleep(0.01)  # the drainer runs without anyone polling
        assert (len(rx._received.inbox), rx._received.inbox.dropped) == (50, 150)
        got = rx.notifications()
        assert [m for _, m in got] == [i.to_bytes(4, "big") * 1024 for i in range(150, 200)]
        assert rx.notifications() == []


def test_calls_that_never_return_take_at_most_a_bounded_number_of_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backend hanging on every call must not make the process start a thread per retry without end."""
    from kvwire.connection import deadline

    monkeypatch.setattr(deadline, "MAX_STUCK_CALLS", 3)
    calls = deadline.CallThreads("hung", 0.05)
    release = threading.Event()
    try:
        for _ in range(3):
            with pytest.raises(kvwire.TransferTimeoutError):
                calls.call("send_kvcache", "peer", lambda: release.wait(30))
        threads = threading.active_count()
        with pytest.raises(kvwire.BackendError) as exc:
            calls.call("send_kvcache", "peer", lambda: 1)
        assert str(exc.value).startswith(
            "backend 'hung': 3 calls are still running past their deadline (the most a connection lets hold a "
            "thread); send_kvcache() was not called."
        )
        assert threading.active_count() == threads  # refused before a thread was taken
        release.set()
        deadline_at = time.monotonic() + 10
        while calls.stuck and time.monotonic() < deadline_at:
            time.sleep(0.01)
        assert calls.call("send_kvcache", "peer", lambda: 7) == 7  # they returned: calls go through again
    finally:
        release.set()
        calls.close()
