"""The contract suite. Every test takes the ``kvwire_harness`` fixture (see pytest_plugin).

Import it into a backend's own tests with ``from kvwire.testing.contract import *``.

Parameter ids say what varies: ``seed1-mha-odd-page`` is random seed 1 on the shape
``mha-odd-page`` (see :data:`SHAPES`: attention kind and what is unusual about the
pages); ``dst-page-out-of-range`` and the like name the invalid input sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

from kvwire.connection.deadline import CALL_GRACE_S
from kvwire.errors import InvalidTransferError, KvwireError, TransferError, UnsupportedFeatureError
from kvwire.planning.plan import TransferPlan
from kvwire.registry.validator import validate_backend
from kvwire.spec.capabilities import FEATURES
from kvwire.spec.history import PARAMETER_FEATURES, known_versions
from kvwire.testing.harness import ContractHarness, Pair, expected_buffers
from kvwire.testing.receiver import LayoutSpec, buffer_digests
from kvwire.transport.backend import offers_raw_write
from kvwire.workload.fragment import fragmented_pages

__all__ = [
    "kvwire_invalid_pair",
    "test_contract_close_while_submissions_are_in_flight",
    "test_contract_empty_request",
    "test_contract_a_dead_peer_fails_typed_in_time_and_other_peers_are_served",
    "test_contract_incoming_writes_outside_registered_memory_are_refused",
    "test_contract_invalid_input_leaves_destination_unchanged",
    "test_contract_layer_mapping",
    "test_contract_notifications_follow_their_data",
    "test_contract_notifications_refused_without_the_feature",
    "test_contract_submit_invalid_input_is_refused_before_queueing",
    "test_contract_submit_many_in_flight",
    "test_contract_round_trip",
    "test_contract_sends_from_many_threads",
    "test_contract_signature",
    "test_contract_split_destinations",
]

SHAPES = {
    "mha-odd-page": (LayoutSpec("mha", (0, 1, 2), 64, 1000), LayoutSpec("mha", (0, 1, 2), 96, 1000), 40),
    "mla-odd-page": (LayoutSpec("mla", (0, 1, 2, 3), 48, 1152), LayoutSpec("mla", (0, 1, 2, 3), 48, 1152), 48),
    "mha-one-page": (LayoutSpec("mha", (0,), 8, 4104), LayoutSpec("mha", (0,), 8, 4104), 1),
    "mha-large-pages": (LayoutSpec("mha", (0, 1), 32, 65536), LayoutSpec("mha", (0, 1), 40, 65536), 24),
}


def _needs(harness: ContractHarness, *features: str) -> None:
    lacking = [f for f in features if f not in harness.capabilities]
    if lacking:
        pytest.skip(f"backend {harness.backend!r} does not declare {lacking}")


def test_contract_signature(kvwire_harness: ContractHarness) -> None:
    """The backend class, validated afresh, matches the spec with no finding and a known version."""
    info = kvwire_harness.info
    result = validate_backend(info.cls, info.origin)
    assert result.findings == (), "\n".join(f.render() for f in result.findings)
    assert result.status in ("ok", "adapted")
    assert result.spec_version in {str(v) for v in known_versions()}
    assert result.capabilities <= set(FEATURES)


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("seed", [1, 2], ids=lambda seed: f"seed{seed}")
def test_contract_round_trip(kvwire_harness: ContractHarness, shape: str, seed: int) -> None:
    """Random fragmented pages of random data land exactly where they should, and nowhere else."""
    local_spec, peer_spec, count = SHAPES[shape]
    _needs(kvwire_harness, local_spec.attention)
    rng = np.random.default_rng(seed)
    prefill = fragmented_pages(rng, local_spec.num_pages, count)
    dst = fragmented_pages(rng, peer_spec.num_pages, count)
    with kvwire_harness.pair(local_spec, peer_spec, seed) as pair:
        moved = pair.send(prefill, dst)
        assert moved == count * local_spec.page_bytes * len(local_spec.entries())
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, dst)


def test_contract_empty_request(kvwire_harness: ContractHarness) -> None:
    local_spec, peer_spec, _ = SHAPES["mha-odd-page"]
    empty = np.array([], np.int32)
    with kvwire_harness.pair(local_spec, peer_spec, 3) as pair:
        assert pair.send(empty, empty) == 0
        assert pair.receiver.hashes() == pair.untouched_hashes()


def test_contract_layer_mapping(kvwire_harness: ContractHarness) -> None:
    """A pipeline stage holding layers 0-1 writes into the decode side's global layers 2-3."""
    local_spec = LayoutSpec("mha", (0, 1), 32, 2048)
    peer_spec = LayoutSpec("mha", (0, 1, 2, 3), 32, 2048)
    rng = np.random.default_rng(4)
    prefill, dst = fragmented_pages(rng, 32, 12), fragmented_pages(rng, 32, 12)
    with kvwire_harness.pair(local_spec, peer_spec, 4) as pair:
        if "layer_ids" not in kvwire_harness.capabilities:
            with pytest.raises(UnsupportedFeatureError):
                pair.send(prefill, dst, [2, 3])
            assert pair.receiver.hashes() == pair.untouched_hashes()
            return
        pair.send(prefill, dst, [2, 3])
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, dst, [2, 3])


def test_contract_split_destinations(kvwire_harness: ContractHarness) -> None:
    """Host buffers take dst_kv_indices, device buffers dst_device_kv_indices (independent ids)."""
    local_spec = LayoutSpec("mla", (0, 1, 2), 24, 1152)
    peer_spec = LayoutSpec("mla", (0,), 64, 1152, device_layers=(1, 2))
    rng = np.random.default_rng(5)
    prefill = fragmented_pages(rng, 24, 10)
    host, device = fragmented_pages(rng, 64, 10), fragmented_pages(rng, 64, 10)
    if "device_memory" not in kvwire_harness.capabilities:
        pytest.skip(f"backend {kvwire_harness.backend!r} does not declare 'device_memory'")
    with kvwire_harness.pair(local_spec, peer_spec, 5) as pair:
        if "device_kv_indices" not in kvwire_harness.capabilities:
            with pytest.raises(UnsupportedFeatureError, match="device_kv_indices"):
                pair.send(prefill, host, None, device)
            assert pair.receiver.hashes() == pair.untouched_hashes()
            return
        pair.send(prefill, host, None, device)
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, host, None, device)


def _i32(*values: int) -> Any:
    return np.array(values, np.int32)


INVALID: dict[str, tuple[Callable[[Pair], dict[str, Any]], str]] = {
    "src-page-out-of-range": (lambda p: {"prefill": _i32(1, 64), "dst_pages": _i32(1, 2)}, "prefill_kv_indices"),
    "dst-page-out-of-range": (lambda p: {"prefill": _i32(1, 2), "dst_pages": _i32(3, 96)}, "dst_kv_indices"),
    "negative-index": (lambda p: {"prefill": _i32(-1, 2), "dst_pages": _i32(1, 2)}, "prefill_kv_indices"),
    "length-mismatch": (lambda p: {"prefill": _i32(1, 2, 3), "dst_pages": _i32(1, 2)}, "dst_kv_indices"),
    "float-indices": (lambda p: {"prefill": np.array([1.0, 2.0]), "dst_pages": _i32(1, 2)}, "prefill_kv_indices"),
    "two-dimensional": (
        lambda p: {"prefill": np.array([[1, 2]], np.int32), "dst_pages": _i32(1, 2)},
        "prefill_kv_indices",
    ),
    "list-not-array": (lambda p: {"prefill": [1, 2], "dst_pages": _i32(1, 2)}, "prefill_kv_indices"),
    "ptr-count": (
        lambda p: {"prefill": _i32(1), "dst_pages": _i32(1), "dst_kv_ptrs": p.dst_kv_ptrs[:-1]},
        "dst_kv_ptrs",
    ),
    "ptr-value": (
        lambda p: {
            "prefill": _i32(1),
            "dst_pages": _i32(1),
            "dst_kv_ptrs": [p.dst_kv_ptrs[0] + 4096, *p.dst_kv_ptrs[1:]],
        },
        "dst_kv_ptrs",
    ),
    "layer-ids-duplicate": (
        lambda p: {"prefill": _i32(1), "dst_pages": _i32(1), "dst_layer_ids": [0, 0, 1]},
        "dst_layer_ids",
    ),
    "layer-ids-unknown": (
        lambda p: {"prefill": _i32(1), "dst_pages": _i32(1), "dst_layer_ids": [0, 1, 9]},
        "dst_layer_ids",
    ),
    "device-indices-without-device-buffers": (
        lambda p: {"prefill": _i32(1), "dst_pages": _i32(1), "dst_device_kv_indices": _i32(1)},
        "dst_device_kv_indices",
    ),
}


@pytest.fixture(scope="module")
def kvwire_invalid_pair(kvwire_harness: ContractHarness) -> Iterator[Pair]:
    local_spec, peer_spec, _ = SHAPES["mha-odd-page"]  # local: 64 pages, peer: 96 pages, layers 0-2
    with kvwire_harness.pair(local_spec, peer_spec, 6) as pair:
        yield pair


@pytest.mark.parametrize("case", list(INVALID))
def test_contract_invalid_input_leaves_destination_unchanged(
    kvwire_harness: ContractHarness, kvwire_invalid_pair: Pair, case: str
) -> None:
    """Bad input raises a typed error naming the argument; the destination is unchanged."""
    make, argument = INVALID[case]
    args = make(kvwire_invalid_pair)
    expected: type[Exception] = InvalidTransferError
    for parameter, feature in PARAMETER_FEATURES.items():
        if parameter in args and feature not in kvwire_harness.capabilities:
            expected, argument = UnsupportedFeatureError, feature
    ptrs = args.pop("dst_kv_ptrs", kvwire_invalid_pair.dst_kv_ptrs)
    with pytest.raises(expected, match=argument):
        kvwire_invalid_pair.connection.send_kvcache(
            kvwire_invalid_pair.receiver.endpoint,
            args["prefill"],
            ptrs,
            args["dst_pages"],
            None,
            args.get("dst_layer_ids"),
            args.get("dst_device_kv_indices"),
        )
    assert kvwire_invalid_pair.receiver.hashes() == kvwire_invalid_pair.untouched_hashes()


def test_contract_incoming_writes_outside_registered_memory_are_refused(kvwire_harness: ContractHarness) -> None:
    """A write that runs past the end of the peer's registered memory is refused whole; nothing lands.

    kvwire's planner never builds one: this sends a hand-made plan through the backend's bare engine call
    (``raw_write``, offered by a transport that implements kvwire.RawWriter), as a buggy or hostile peer would.
    The receiving side must check every incoming range against what it registered, not trust the sender (see
    the README, "Writing a backend").
    """
    if kvwire_harness.info.cls is None or not offers_raw_write(kvwire_harness.info.cls):
        pytest.skip(f"backend {kvwire_harness.backend!r} offers no raw_write (its transport is no kvwire.RawWriter)")
    local_spec, peer_spec, _ = SHAPES["mha-large-pages"]
    with kvwire_harness.pair(local_spec, peer_spec, 9) as pair:
        last = pair.receiver.layout.buffers[-1]
        straddling = last.base + last.nbytes - last.page_bytes  # its last page, then one page past the end
        plan = TransferPlan(
            np.array([pair.local.buffers[0].base], dtype=np.int64),
            np.array([straddling], dtype=np.int64),
            np.array([2 * last.page_bytes], dtype=np.int64),
            1,
        )
        with pytest.raises(KvwireError):
            pair.connection.raw_write(pair.receiver.endpoint, plan)
        assert pair.receiver.hashes() == pair.untouched_hashes()
        one, two = np.array([1], np.int32), np.array([2], np.int32)
        assert pair.send(one, two) > 0  # the session still works
        assert pair.receiver.hashes() == pair.expected_hashes(one, two)


# -- non-blocking sends and notifications (spec 1.5) ----------------------------------------------------------

SUBMIT_SHAPE = (LayoutSpec("mha", (0, 1), 96, 2048), LayoutSpec("mha", (0, 1), 96, 2048))
#: 1.5 MiB per request: long enough a write that a notification sent ahead of its data is caught mid-write.
NOTIFY_SHAPE = (LayoutSpec("mha", (0, 1), 96, 65536), LayoutSpec("mha", (0, 1), 96, 65536))


def _disjoint_requests(rng: np.random.Generator, count: int, per: int) -> list[tuple[Any, Any]]:
    """``count`` requests of ``per`` fragmented pages each, their destination pages pairwise disjoint."""
    dst = rng.permutation(96)[: count * per].astype(np.int32)
    return [(fragmented_pages(rng, 96, per), np.sort(dst[k * per : (k + 1) * per])) for k in range(count)]


def _many_from_threads(harness: ContractHarness, seed: int, threads: int, *, submit: bool) -> None:
    """Twelve requests with disjoint destinations from ``threads`` threads at once: each moves its bytes, all land."""
    requests = _disjoint_requests(np.random.default_rng(seed), 12, 6)
    with harness.pair(*SUBMIT_SHAPE, seed) as pair:
        call: Callable[[tuple[Any, Any]], Any] = (lambda r: pair.submit(*r)) if submit else (lambda r: pair.send(*r))
        with ThreadPoolExecutor(threads) as callers:
            results = list(callers.map(call, requests))
        moved = [f.result(timeout=60) for f in results] if submit else results
        assert moved == [6 * 2048 * 4] * len(requests)
        prefill = np.concatenate([p for p, _ in requests])
        dst = np.concatenate([d for _, d in requests])
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, dst)


def test_contract_submit_many_in_flight(kvwire_harness: ContractHarness) -> None:
    """Twelve submissions from three threads, all in flight together: each returns its bytes, all bytes land."""
    _many_from_threads(kvwire_harness, 7, 3, submit=True)


@pytest.mark.parametrize("case", ["src-page-out-of-range", "dst-page-out-of-range", "ptr-value", "float-indices"])
def test_contract_submit_invalid_input_is_refused_before_queueing(
    kvwire_harness: ContractHarness, kvwire_invalid_pair: Pair, case: str
) -> None:
    """submit_kvcache raises the same typed error as send_kvcache, synchronously; the destination is unchanged."""
    make, argument = INVALID[case]
    args = make(kvwire_invalid_pair)
    ptrs = args.pop("dst_kv_ptrs", kvwire_invalid_pair.dst_kv_ptrs)
    with pytest.raises(InvalidTransferError, match=argument):
        kvwire_invalid_pair.connection.submit_kvcache(
            kvwire_invalid_pair.receiver.endpoint, args["prefill"], ptrs, args["dst_pages"]
        )
    assert kvwire_invalid_pair.receiver.hashes() == kvwire_invalid_pair.untouched_hashes()


def test_contract_notifications_follow_their_data(kvwire_harness: ContractHarness) -> None:
    """Each notification is seen only once its transfer's pages are complete in the receiver's memory.

    Twelve submissions with a notification each (all in flight together), then
    a blocking send followed by send_notification; the receiver digests each
    notification's pages the moment it sees it.
    """
    _needs(kvwire_harness, "notifications")
    rng = np.random.default_rng(8)
    requests = _disjoint_requests(rng, 13, 6)
    messages = [f"kit-{k}".encode() for k in range(len(requests))]
    with kvwire_harness.pair(*NOTIFY_SHAPE, 8) as pair:
        pair.receiver.start_watch({m: [int(i) for i in d] for m, (_, d) in zip(messages, requests, strict=True)})
        futures = [pair.submit(p, d, m) for (p, d), m in zip(requests[:-1], messages, strict=False)]
        for future in futures:
            future.result(timeout=60)
        pair.send(*requests[-1])
        pair.connection.send_notification(pair.receiver.endpoint, messages[-1])
        arrivals = pair.receiver.collect(len(messages), 60.0)
        assert sorted(m for _, m, _ in arrivals) == sorted(messages)
        assert arrivals[-1][1] == messages[-1]  # sent after every other one had been delivered
        sender = pair.connection.endpoint()
        expected = {m: pair.expected_page_digest(p, d) for m, (p, d) in zip(messages, requests, strict=True)}
        for source, message, seen in arrivals:
            assert seen == expected[message], f"notification {message!r} was seen before its data was complete"
            assert source and isinstance(source, str) and (source == sender or kvwire_harness.two_process)
        pair.receiver.start_watch({})
        assert pair.receiver.collect(1, 0.05) == []  # each is delivered once


def test_contract_notifications_refused_without_the_feature(kvwire_harness: ContractHarness) -> None:
    if "notifications" in kvwire_harness.capabilities:
        pytest.skip(f"backend {kvwire_harness.backend!r} declares 'notifications'")
    with kvwire_harness.pair(*SUBMIT_SHAPE, 9) as pair:
        with pytest.raises(UnsupportedFeatureError, match="notifications"):
            pair.connection.send_notification(pair.receiver.endpoint, b"x")
        with pytest.raises(UnsupportedFeatureError, match="notifications"):
            pair.submit(np.array([1], np.int32), np.array([1], np.int32), b"x")
        assert pair.receiver.hashes() == pair.untouched_hashes()


# -- the rules of kvwire.Transport (its docstring): concurrency, close racing writes, bounded calls ---------------

#: The ``timeout_s`` the dead-peer test runs under: every call must end within it (plus the call grace).
DEAD_PEER_TIMEOUT_S = 3.0


def test_contract_sends_from_many_threads(kvwire_harness: ContractHarness) -> None:
    """Rule 1: blocking sends run concurrently, from four threads to one peer; every byte lands."""
    _many_from_threads(kvwire_harness, 10, 4, submit=False)


def test_contract_close_while_submissions_are_in_flight(kvwire_harness: ContractHarness) -> None:
    """Rule 2: close() racing twelve submissions leaves none pending: each moved its bytes, was cancelled
    before it started, or failed with a kvwire error."""
    rng = np.random.default_rng(11)
    requests = _disjoint_requests(rng, 12, 6)
    with kvwire_harness.pair(*SUBMIT_SHAPE, 11) as pair:
        futures = [pair.submit(*r) for r in requests]
        pair.connection.close()
        assert all(f.done() for f in futures)
        for future in futures:
            if future.cancelled():
                continue
            error = future.exception(timeout=0)
            assert error is None or isinstance(error, KvwireError), repr(error)
            if error is None:
                assert future.result(timeout=0) == 6 * 2048 * 4
        assert pair.connection.state == "closed"


def test_contract_a_dead_peer_fails_typed_in_time_and_other_peers_are_served(kvwire_harness: ContractHarness) -> None:
    """Rules 4 and 5: a send to a peer that is gone fails with a TransferError within ``timeout_s`` (plus the
    call grace), and the same connection goes on serving another peer, bytes verified."""
    harness = kvwire_harness.with_timeout(DEAD_PEER_TIMEOUT_S)
    local_spec, peer_spec = SUBMIT_SHAPE
    rng = np.random.default_rng(12)
    prefill, dst = fragmented_pages(rng, 96, 8), fragmented_pages(rng, 96, 8)
    with harness.pair(local_spec, peer_spec, 12) as pair, harness.receiver(peer_spec, 13) as other:
        pair.connection.add_peer(other.endpoint, other.layout)
        pair.receiver.close()  # the first peer goes away
        started = time.monotonic()
        with pytest.raises(TransferError):
            pair.send(prefill, dst)
        took = time.monotonic() - started
        assert took <= DEAD_PEER_TIMEOUT_S + CALL_GRACE_S, f"a send to a dead peer took {took:.1f} s"
        ptrs = [b.base for b in other.layout.buffers]
        moved = pair.connection.send_kvcache(other.endpoint, prefill, ptrs, dst, None)
        assert moved == 8 * local_spec.page_bytes * len(local_spec.entries())
        initial = peer_spec.allocate(13).views
        expected = expected_buffers(pair.memory.views, pair.local, initial, other.layout, prefill, dst)
        assert other.hashes() == buffer_digests(expected)
