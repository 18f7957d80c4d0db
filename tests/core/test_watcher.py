"""NotificationWatcher: arrivals seen on its thread, taken by message, errors raised to the waiter (local backend)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest

import kvwire
from kvwire.testing.receiver import LayoutSpec

SPEC = LayoutSpec("mha", (0,), 32, 1024)


@pytest.fixture
def pair() -> Iterator[tuple[kvwire.Connection, kvwire.Connection, str]]:
    src, dst = SPEC.allocate(1), SPEC.allocate(2)
    with kvwire.connect("local") as sender, kvwire.connect("local") as receiver:
        sender.register_kv_buffers(src.layout)
        receiver.register_kv_buffers(dst.layout)
        endpoint = receiver.endpoint()
        sender.add_peer(endpoint, dst.layout)
        yield sender, receiver, endpoint


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
