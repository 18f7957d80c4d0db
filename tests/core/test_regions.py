"""RegionSet: registered ranges and the one range check every transport uses."""

from __future__ import annotations

import numpy as np
import pytest

from kvwire import InvalidTransferError, RegionSet

RANGES = ((0x10000, 0x1000), (0x20000, 0x2000))


def test_first_outside_finds_ranges_outside() -> None:
    regions = RegionSet.of(RANGES)
    addrs, lengths = np.array([0x10000, 0x20000, 0x20800], np.int64), np.array([0x1000, 0x2000, 0x1000], np.int64)
    assert regions.first_outside(addrs, lengths) is None
    assert regions.first_outside(np.array([0x10800], np.int64), np.array([0x1000], np.int64)) == 0  # straddles
    assert regions.first_outside(np.array([0x8000], np.int64), np.array([1], np.int64)) == 0  # before every one
    assert RegionSet.of(()).first_outside(addrs, lengths) == 0


def test_of_refuses_an_overlap_and_equals_adding_one_by_one() -> None:
    with pytest.raises(InvalidTransferError) as exc:
        RegionSet.of((*RANGES, (0x20800, 16)))
    assert str(exc.value) == "range [0x20800, 0x20810) overlaps the registered range [0x20000, 0x22000)"
    one_by_one = RegionSet()
    for base, nbytes in reversed(RANGES):
        one_by_one.add(base, nbytes)
    assert RegionSet.of(RANGES).items() == one_by_one.items() == RANGES


def test_check_names_the_range_and_the_nearest_registered_one() -> None:
    regions = RegionSet.of(RANGES)
    with pytest.raises(InvalidTransferError) as exc:
        regions.check(np.array([0x10000, 0x20800], np.int64), np.array([16, 0x2000], np.int64))
    assert str(exc.value) == (
        "src[1] = 0x20800 with length[1] = 8192 is not inside registered local memory; "
        "nearest registered range [0x20000, 0x22000)"
    )
    with pytest.raises(InvalidTransferError, match=r"^dst\[0\] = 0x10 is not in registered x: nothing is registered$"):
        RegionSet().check(np.array([16], np.int64), np.array([1], np.int64), names=("dst", "n"), where="x")
