"""``kvwire.submit.BusyClock``: per-worker busy seconds, bounded, and the fractions the bench prints."""

from __future__ import annotations

import threading

import pytest

import kvwire.submit.busy as busy_module
from kvwire.submit import BusyClock
from kvwire.submit.busy import busy_fractions


def test_busy_blocks_add_their_time_also_when_they_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([10.0, 10.25, 20.0, 20.5])
    monkeypatch.setattr(busy_module.time, "perf_counter", lambda: next(ticks))
    clock = BusyClock()
    with clock.busy("stream 0"):
        pass
    with pytest.raises(KeyError), clock.busy("stream 0"):
        raise KeyError("a failed write is busy time too")
    assert clock.snapshot() == {"stream 0": 0.75}


def test_a_snapshot_is_a_copy_and_fractions_are_per_name_between_two_snapshots() -> None:
    clock = BusyClock()
    clock.add("peer a", 1.0)
    before = clock.snapshot()
    before["peer a"] = 99.0  # the clock keeps its own table
    clock.add("peer a", 0.5)
    clock.add("peer b", 2.0)
    assert busy_fractions({"peer a": 1.0}, clock.snapshot(), 4.0) == {"peer a": 0.125, "peer b": 0.5}
    with pytest.raises(ValueError, match="seconds must be > 0, got 0"):
        busy_fractions({}, {}, 0)


def test_the_table_keeps_the_most_recently_busy_names_only() -> None:
    clock = BusyClock(max_names=2)
    clock.add("peer a", 1.0)
    clock.add("peer b", 1.0)
    clock.add("peer a", 1.0)  # a is now the most recently busy
    clock.add("peer c", 1.0)  # drops b, the longest idle
    assert clock.snapshot() == {"peer a": 2.0, "peer c": 1.0}
    with pytest.raises(ValueError, match="max_names must be >= 1, got 0"):
        BusyClock(max_names=0)


def test_concurrent_adds_lose_nothing() -> None:
    clock = BusyClock()

    def add() -> None:
        for _ in range(2000):
            clock.add("stream 0", 0.001)
            clock.add("stream 1", 0.002)

    threads = [threading.Thread(target=add) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = clock.snapshot()
    assert snap["stream 0"] == pytest.approx(8.0) and snap["stream 1"] == pytest.approx(16.0)
