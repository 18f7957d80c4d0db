"""Notifications: API, limits, ordering, NotificationWatcher (local backend); the validator's optional-hook rules."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future

import numpy as np
import pytest
from held_submit import Memory

import kvwire
from kvwire.registry.findings import BackendOrigin
from kvwire.testing.receiver import LayoutSpec

from backends_for_tests import Recorder

SPEC = LayoutSpec("mha", (0,), 32, 1024)
ORIGIN = BackendOrigin("t", "kvtest", "1.0", "mod:Cls")


@pytest.fixture
def pair() -> Iterator[tuple[kvwire.Connection, kvwire.Connection, str]]:
    src, dst = SPEC.allocate(1), SPEC.allocate(2)
    with kvwire.connect("local") as sender, kvwire.connect("local") as receiver:
        sender.register_kv_buffers(src.layout)
        receiver.register_kv_buffers(dst.layout)
        endpoint = receiver.endpoint()
        sender.add_peer(endpoint, dst.layout)
        yield sender, receiver, endpoint


def test_messages_arrive_once_in_order_with_the_sender(pair: tuple[kvwire.Connection, kvwire.Connection, str]) -> None:
    sender, receiver, endpoint = pair
    assert receiver.poll_notifications() == []
    for i in range(100):
        sender.send_notification(endpoint, i.to_bytes(2, "big") + b"\x00\xff")
    got = receiver.poll_notifications()
    assert [n.message for n in got] == [i.to_bytes(2, "big") + b"\x00\xff" for i in range(100)]
    assert {n.sender for n in got} == {sender.endpoint()}
    assert receiver.poll_notifications() == []


def test_an_attached_notification_follows_its_bytes(pair: tuple[kvwire.Connection, kvwire.Connection, str]) -> None:
    sender, receiver, endpoint = pair
    ids = np.arange(4, dtype=np.int32)
    ptrs = [b.base for b in receiver._local.buffers]  # type: ignore[union-attr]
    future = sender.submit_kvcache(endpoint, ids, ptrs, ids, notification=b"req-1")
    assert future.result(timeout=10) == 4 * 1024 * 2
    assert receiver.poll_notifications() == [kvwire.Notification(sender.endpoint(), b"req-1")]


@pytest.mark.parametrize(
    ("message", "error"),
    [
        ("text", "message must be bytes, got str"),
        (b"x" * 4097, "message is 4097 bytes; a notification carries at most 4096 bytes"),
    ],
)
def test_bad_messages_are_refused_naming_the_argument(
    pair: tuple[kvwire.Connection, kvwire.Connection, str], message: object, error: str
) -> None:
    sender, receiver, endpoint = pair
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        sender.send_notification(endpoint, message)  # type: ignore[arg-type]
    assert str(exc.value).startswith(error)
    ids = np.arange(1, dtype=np.int32)
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        sender.submit_kvcache(endpoint, ids, [0], ids, notification=message)  # type: ignore[arg-type]
    assert str(exc.value).startswith(error.replace("message", "notification", 1))
    assert receiver.poll_notifications() == []


def test_the_largest_message_and_bytes_likes_are_carried(
    pair: tuple[kvwire.Connection, kvwire.Connection, str],
) -> None:
    sender, receiver, endpoint = pair
    sender.send_notification(endpoint, bytes(range(256)) * 16)
    sender.send_notification(endpoint, bytearray(b"ba"))  # type: ignore[arg-type]
    assert [n.message for n in receiver.poll_notifications()] == [bytes(range(256)) * 16, b"ba"]


def test_unknown_peer_is_refused(pair: tuple[kvwire.Connection, kvwire.Connection, str]) -> None:
    sender, _, _ = pair
    with pytest.raises(kvwire.InvalidTransferError, match=r"^session_id 'local://nobody' is unknown"):
        sender.send_notification("local://nobody", b"x")


def test_a_backend_without_notifications_refuses_them() -> None:
    registry = kvwire.Registry(allow=["local"], policy="strict")
    registry.register("recorder", Recorder)
    conn = registry.connect("recorder")
    conn.add_peer("p", kvwire.KVLayout((kvwire.KVBuffer(4096, 64, 16, 0, "kv", "host"),)))
    message = "backend 'recorder' (spec 1.5) does not support 'notifications', needed for {}; nothing was sent"
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        conn.send_notification("p", b"x")
    assert str(exc.value) == message.format("send_notification")
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        conn.poll_notifications()
    assert str(exc.value) == message.format("poll_notifications")
    idx = np.array([1], np.int32)
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        conn.submit_kvcache("p", idx, [4096], idx, notification=b"x")
    assert str(exc.value) == message.format("notification")
    assert [c for c, _ in conn.backend.calls] == ["add_peer"]


# -- the validator and optional hooks ------------------------------------------------------------------------


def test_declaring_a_hook_feature_without_its_hooks_is_drift() -> None:
    class Claims(Recorder):
        capabilities = Recorder.capabilities | {"notifications", "submit"}

    result = kvwire.validate_backend(Claims, ORIGIN)
    assert result.status == "drift"
    assert all(f.rule == "missing-hook" for f in result.findings)
    assert [(f.hook, f.message) for f in result.findings] == [
        ("send_notification", "declares 'notifications' but does not implement its hook `send_notification`"),
        ("poll_notifications", "declares 'notifications' but does not implement its hook `poll_notifications`"),
        ("submit_kvcache", "declares 'submit' but does not implement its hook `submit_kvcache`"),
    ]
    assert result.findings[2].fix == (
        "add `@kvwire.hookimpl def submit_kvcache(self, session_id: str, request: TransferRequest, "
        "notification: bytes | None = None) -> Future[int]`, or drop 'submit'"
    )


def test_an_optional_hook_that_drifted_is_reported() -> None:
    class Drifted(Recorder):
        capabilities = Recorder.capabilities | {"submit"}

        @kvwire.hookimpl
        def submit_kvcache(self, session_id: str, request: kvwire.TransferRequest) -> Future[int]:
            raise NotImplementedError

    result = kvwire.validate_backend(Drifted, ORIGIN)
    assert result.status == "drift"
    assert [(f.hook, f.rule) for f in result.findings] == [("submit_kvcache", "missing-parameter")]


def test_a_spec_14_backend_may_not_declare_a_15_feature() -> None:
    class Old(Recorder):
        spec_version = "1.4"
        capabilities = Recorder.capabilities | {"notifications"}

    result = kvwire.validate_backend(Old, ORIGIN)
    assert [f.message for f in result.findings] == [
        "declares 'notifications', but spec 1.4 has no parameter or hook for it"
    ]


def test_a_backend_without_optional_hooks_is_ok_at_15_and_inferred_as_15() -> None:
    class Undeclared(Recorder):
        spec_version = None

    assert kvwire.validate_backend(Recorder, ORIGIN).status == "ok"
    result = kvwire.validate_backend(Undeclared, ORIGIN)
    assert (result.status, result.spec_version) == ("ok", "1.5")


# -- NotificationWatcher: arrivals seen on its thread, taken by message, errors raised to the waiter --


def test_arrivals_are_taken_by_message_and_the_callback_sees_each_first(
    pair: tuple[kvwire.Connection, kvwire.Connection, str],
) -> None:
    sender, receiver, endpoint = pair
    called: list[tuple[bytes, str]] = []

    def on_arrival(arrival: kvwire.Arrival) -> None:
        called.append((arrival.notification.message, threading.current_thread().name))

    ids = np.arange(4, dtype=np.int32)
    ptrs = [b.base for b in receiver._local.buffers]  # type: ignore[union-attr]
    with kvwire.NotificationWatcher(receiver, on_arrival, name="test-watch") as watcher:
        futures = [sender.submit_kvcache(endpoint, ids, ptrs, ids, notification=f"r{i}".encode()) for i in range(5)]
        assert [f.result(timeout=10) for f in futures] == [4 * 1024 * 2] * 5
        r3 = watcher.wait_for(b"r3", 10.0)
        assert r3 is not None and r3.notification == kvwire.Notification(sender.endpoint(), b"r3")
        assert watcher.wait_for(b"r3", 0.05) is None  # taken once
        kept = [a.notification.message for a in watcher.wait(4, 10.0)]
        assert sorted(kept) == [b"r0", b"r1", b"r2", b"r4"]  # attached: in the order the transfers completed
        assert [m for m, _ in called if m != b"r3"] == kept  # the callback saw each first, in arrival order
        assert sorted(m for m, _ in called) == [b"r0", b"r1", b"r2", b"r3", b"r4"]
        assert {t for _, t in called} == {"test-watch"}
        seen = [a.seen for a in watcher.wait(4, 0)]
        assert seen == sorted(seen)


def test_an_error_in_the_callback_stops_the_watcher_and_reaches_the_waiter(
    pair: tuple[kvwire.Connection, kvwire.Connection, str],
) -> None:
    sender, receiver, endpoint = pair

    def broken(arrival: kvwire.Arrival) -> None:
        raise ValueError(f"cannot schedule {arrival.notification.message!r}")

    watcher = kvwire.NotificationWatcher(receiver, broken)
    sender.send_notification(endpoint, b"x")
    with pytest.raises(ValueError, match="cannot schedule b'x'"):
        watcher.wait_for(b"x", 10.0)
    with pytest.raises(ValueError, match="cannot schedule b'x'"):
        watcher.stop()


def test_a_bad_poll_interval_is_refused_at_once_naming_it() -> None:
    with kvwire.connect("local") as receiver:
        with pytest.raises(kvwire.ConfigError, match=r"poll_s must be a number of seconds in \[0, 1\], got -1"):
            kvwire.NotificationWatcher(receiver, poll_s=-1)
        with pytest.raises(kvwire.ConfigError, match=r"got True"):
            kvwire.NotificationWatcher(receiver, poll_s=True)


def test_notifications_that_arrived_before_the_watcher_are_kept(
    pair: tuple[kvwire.Connection, kvwire.Connection, str],
) -> None:
    sender, receiver, endpoint = pair
    sender.send_notification(endpoint, b"early")
    with kvwire.NotificationWatcher(receiver) as watcher:  # its first poll finds "early": kept, not dropped
        sender.send_notification(endpoint, b"late")
        assert [a.notification.message for a in watcher.wait(2, 10.0)] == [b"early", b"late"]


# -- NotificationWatcher -----------------------------------------------------------------------------------------------


def test_the_notifications_of_one_poll_are_kept_and_seen_in_arrival_order() -> None:
    memory = Memory()
    with kvwire.connect("local") as sender, kvwire.connect("local") as receiver:
        endpoint = memory.pair(sender, receiver)
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
