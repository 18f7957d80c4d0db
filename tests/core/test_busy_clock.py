"""``kvwire.transport.BusyClock``: per-worker busy seconds, overlaps counted once, bounded; the bench's fractions."""

from __future__ import annotations

import threading

import pytest

from kvwire.transport import BusyClock
from kvwire.transport.busy import busy_fractions


class _Ticks:
    """A clock the test sets by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_busy_blocks_add_their_time_also_when_they_raise() -> None:
    ticks = _Ticks()
    clock = BusyClock(clock=ticks)
    with clock.busy("stream 0"):
        ticks.now += 0.25
    with pytest.raises(KeyError), clock.busy("stream 0"):
        ticks.now += 0.5
        raise KeyError("a failed write is busy time too")
    assert clock.snapshot() == {"stream 0": 0.75}


def test_overlapping_blocks_of_one_name_count_once_and_a_running_stretch_counts_up_to_now() -> None:
    ticks = _Ticks()
    clock = BusyClock(clock=ticks)
    first = clock.busy("peer a")
    first.__enter__()  # one thread writing to peer a
    ticks.now += 1.0
    with clock.busy("peer a"):  # a second thread writing to peer a at the same time
        ticks.now += 2.0
    assert clock.snapshot() == {"peer a": 3.0}  # still running: counted up to now
    ticks.now += 1.0
    first.__exit__(None, None, None)
    ticks.now += 5.0  # idle
    assert clock.snapshot() == {"peer a": 4.0}  # 4 s of wall time busy, not 1 + 2 + 1 + 2


def test_fractions_are_per_name_between_two_snapshots_and_never_negative() -> None:
    ticks = _Ticks()
    clock = BusyClock(clock=ticks)
    with clock.busy("peer a"):
        ticks.now += 1.0
    before = clock.snapshot()
    before["peer a"] = 1.0
    with clock.busy("peer a"):
        ticks.now += 0.5
    with clock.busy("peer b"):
        ticks.now += 2.0
    assert busy_fractions(before, clock.snapshot(), 4.0) == {"peer a": 0.125, "peer b": 0.5}
    assert busy_fractions({"peer a": 9.0}, {"peer a": 1.0}, 1.0) == {"peer a": 0.0}  # dropped and met again
    with pytest.raises(ValueError, match="seconds must be > 0, got 0"):
        busy_fractions({}, {}, 0)


def test_the_table_keeps_the_most_recently_busy_names_and_never_drops_a_busy_one() -> None:
    ticks = _Ticks()
    clock = BusyClock(max_names=2, clock=ticks)
    for name in ("peer a", "peer b", "peer a", "peer c"):  # c drops b, the one idle longest
        with clock.busy(name):
            ticks.now += 1.0
    assert clock.snapshot() == {"peer a": 2.0, "peer c": 1.0}
    with clock.busy("peer a"), clock.busy("peer c"), clock.busy("peer d"):  # both others busy: none dropped
        ticks.now += 1.0
    assert clock.snapshot() == {"peer a": 3.0, "peer c": 2.0, "peer d": 1.0}
    with pytest.raises(ValueError, match="max_names must be >= 1, got 0"):
        BusyClock(max_names=0)


def test_concurrent_blocks_keep_the_table_consistent() -> None:
    clock = BusyClock()

    def work() -> None:
        for _ in range(2000):
            with clock.busy("stream 0"), clock.busy("stream 1"):
                pass

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    snap = clock.snapshot()
    assert set(snap) == {"stream 0", "stream 1"}
    assert 0 < snap["stream 1"] <= snap["stream 0"]  # stream 1's stretches lie inside stream 0's
    assert clock.snapshot() == snap  # nothing left running
