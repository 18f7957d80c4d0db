"""kvwire-nixl end to end: the contract kit over two real processes, faults, and the bench."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from freezing import freeze

import kvwire
from kvwire import BackendConfig
from kvwire_nixl.endpoint import Region, decode_endpoint, encode_endpoint
from kvwire_nixl.locate import nixl_availability

if (_reason := nixl_availability()) is not None:
    pytest.skip(f"kvwire-nixl cannot run here: {_reason}", allow_module_level=True)

from kvwire.testing.contract import *  # noqa: F403 - the contract suite, two real processes
from kvwire.testing.harness import ContractHarness, expected_buffers
from kvwire.testing.receiver import LayoutSpec, SubprocessReceiver, buffer_digests
from kvwire.workload.fragment import fragmented_pages

pytestmark = pytest.mark.slow

SPEC = LayoutSpec("mha", (0, 1), 256, 16384)


@pytest.fixture(scope="session")
def kvwire_backend_name() -> str:
    return "nixl"


@pytest.fixture(scope="session")
def kvwire_two_process() -> bool:
    return True


def _pages(count: int = 64, seed: int = 1) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return fragmented_pages(rng, SPEC.num_pages, count), fragmented_pages(rng, SPEC.num_pages, count)


@pytest.mark.parametrize("streams", [None, "1", 3])
def test_many_fragmented_pages_land_byte_for_byte(streams: str | int | None) -> None:
    """29 MB in 7,000-odd descriptors: one stream, or split over several (default: 2 where 2 CPUs are usable)."""
    spec = LayoutSpec("mla", tuple(range(8)), 2048, 4096)
    rng = np.random.default_rng(11)
    prefill, dst = fragmented_pages(rng, 2048, 900, mean_run=3), fragmented_pages(rng, 2048, 900, mean_run=3)
    config = BackendConfig() if streams is None else BackendConfig(options={"streams": streams})
    with ContractHarness("nixl", two_process=True, config=config).pair(spec, spec, 11) as pair:
        assert pair.send(prefill, dst) == 900 * 4096 * 8
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, dst)


def test_remote_address_outside_the_peer_layout_is_refused_before_nixl_is_called() -> None:
    with ContractHarness("nixl", two_process=True).pair(SPEC, SPEC, 3) as pair:
        transport = pair.connection.backend.transport
        calls: list[object] = []
        original_call, original_write = transport.agent.call, transport.write

        def record_call(*a: object, **k: object) -> object:
            calls.append(a)
            return original_call(*a, **k)

        def record_write(*a: object) -> None:
            calls.append(a)
            original_write(*a)

        transport.agent.call = record_call
        transport.write = record_write
        ptrs = [p + 16384 * 300 for p in pair.dst_kv_ptrs]
        one = np.array([1], np.int32)
        with pytest.raises(kvwire.InvalidTransferError, match=r"dst_kv_ptrs\[0\]"):
            pair.connection.send_kvcache(pair.receiver.endpoint, one, ptrs, one)
        assert calls == []
        assert pair.receiver.hashes() == pair.untouched_hashes()


def test_a_malformed_or_foreign_session_id_is_refused_at_add_peer() -> None:
    with kvwire.connect("nixl") as conn:
        layout = SPEC.allocate(1).layout
        for bad in ("127.0.0.1:1234", "nixl:2:agent:xyz", "nixl:1:agent:not-base64!"):
            with pytest.raises(kvwire.InvalidTransferError, match="not a kvwire-nixl endpoint"):
                conn.add_peer(bad, layout)


def test_a_hostile_endpoint_is_refused_quickly() -> None:
    layout = SPEC.allocate(1).layout
    many = [Region(4096 * (2 * i + 1), 4096, "DRAM", 0) for i in range(1 << 14)]  # the most regions allowed
    overlapping = [Region(4096, 8192, "DRAM", 0), Region(8192, 4096, "DRAM", 0)]
    with kvwire.connect("nixl") as conn:
        start = time.monotonic()
        with pytest.raises(kvwire.InvalidTransferError, match="is not in memory agent a registered"):
            conn.add_peer(encode_endpoint("a", b"metadata", many), layout)
        assert time.monotonic() - start < 2.0
        with pytest.raises(kvwire.InvalidTransferError, match="overlapping regions"):
            conn.add_peer(encode_endpoint("a", b"metadata", overlapping), layout)


def test_corrupt_nixl_metadata_is_refused_and_never_crashes() -> None:
    memory, source = SPEC.allocate(1), SPEC.allocate(2)
    with kvwire.connect("nixl") as receiver, kvwire.connect("nixl") as sender:
        receiver.register_kv_buffers(memory.layout)
        sender.register_kv_buffers(source.layout)
        endpoint = receiver.endpoint()
        info = decode_endpoint(endpoint)
        damaged = endpoint[:-12] + ("A" if endpoint[-12] != "A" else "B") + endpoint[-11:]
        with pytest.raises(kvwire.InvalidTransferError, match="not a kvwire-nixl endpoint"):
            sender.add_peer(damaged, memory.layout)  # damaged in transit: refused before NIXL reads it
        md = info.metadata
        flipped = bytes(b ^ 0x5A if i % 7 == 3 else b for i, b in enumerate(md))
        for corrupt in (b"garbage" * 10, md[: len(md) // 2], flipped):  # a peer sending bad metadata
            with pytest.raises(kvwire.InvalidTransferError, match="refused by NIXL before anything was sent"):
                sender.add_peer(encode_endpoint(info.agent, corrupt, info.regions), memory.layout)
        sender.add_peer(endpoint, memory.layout)  # NIXL rejected those whole: the peer is still reachable
        with pytest.raises(kvwire.InvalidTransferError, match=f"its NIXL metadata is agent '{info.agent}'"):
            sender.add_peer(encode_endpoint("kvwire-other", md[:-5], info.regions), memory.layout)
        one, two, ptrs = np.array([1], np.int32), np.array([2], np.int32), [b.base for b in memory.layout.buffers]
        assert sender.send_kvcache(endpoint, one, ptrs, two) == 4 * 16384  # its session was not disturbed


def test_an_endpoint_read_before_registration_is_refused_at_add_peer() -> None:
    memory = SPEC.allocate(2)
    with kvwire.connect("nixl") as receiver, kvwire.connect("nixl") as sender:
        early = receiver.endpoint()
        receiver.register_kv_buffers(memory.layout)
        with pytest.raises(kvwire.InvalidTransferError, match=r"after register_kv_buffers"):
            sender.add_peer(early, memory.layout)
        assert receiver.endpoint() != early
        sender.add_peer(receiver.endpoint(), memory.layout)


def test_a_peer_that_registers_again_is_reached_at_its_new_endpoint_only() -> None:
    first, second, source = SPEC.allocate(1), SPEC.allocate(2), SPEC.allocate(3)
    one = np.array([5], np.int32)
    with kvwire.connect("nixl") as receiver, kvwire.connect("nixl") as sender:
        sender.register_kv_buffers(source.layout)
        receiver.register_kv_buffers(first.layout)
        old = receiver.endpoint()
        sender.add_peer(old, first.layout)
        sender.send_kvcache(old, one, [b.base for b in first.layout.buffers], one)
        receiver.register_kv_buffers(second.layout)
        new = receiver.endpoint()
        sender.add_peer(new, second.layout)
        assert sender.send_kvcache(new, one, [b.base for b in second.layout.buffers], one) == 4 * 16384
        assert all((a[5] == b[5]).all() for a, b in zip(source.views, second.views))
        with pytest.raises(kvwire.InvalidTransferError, match="registered again"):
            sender.send_kvcache(old, one, [b.base for b in first.layout.buffers], one)


def test_unreachable_session_is_a_typed_error() -> None:
    with ContractHarness("nixl", two_process=True).pair(SPEC, SPEC, 4) as pair:
        pid = pair.receiver.pid  # type: ignore[attr-defined]
        pair.receiver.child.proc.kill()  # type: ignore[attr-defined]
        pair.receiver.child.proc.wait()  # type: ignore[attr-defined]
        start = time.monotonic()
        with pytest.raises(kvwire.TransferError):
            pair.send(*_pages())
        assert time.monotonic() - start < 2.0 + BackendConfig().timeout_s, pid


def test_killed_peer_errors_fast_and_another_peer_is_still_served() -> None:
    big = LayoutSpec("mha", (0, 1, 2, 3), 512, 65536)  # 8 buffers x 256 pages x 64 KiB = 128 MiB per request
    rng = np.random.default_rng(5)
    prefill, dst = fragmented_pages(rng, 512, 256, mean_run=4), fragmented_pages(rng, 512, 256, mean_run=4)
    with ContractHarness("nixl", two_process=True).pair(big, big, 5) as pair:
        second = SubprocessReceiver("nixl", big, 99)
        try:
            pair.connection.add_peer(second.endpoint, second.layout)
            outcome: dict[str, object] = {}
            started = threading.Event()

            def send() -> None:
                started.set()
                try:
                    for _ in range(200):  # keep writing until the kill lands
                        pair.send(prefill, dst)
                except kvwire.TransferError as exc:
                    outcome["error"] = exc
                outcome["done"] = time.monotonic()

            worker = threading.Thread(target=send)
            worker.start()
            started.wait()
            time.sleep(0.2)
            pair.receiver.child.proc.kill()  # type: ignore[attr-defined]
            killed = time.monotonic()
            worker.join(timeout=30)
            assert not worker.is_alive()
            assert isinstance(outcome.get("error"), kvwire.PeerUnreachableError), outcome
            assert float(outcome["done"]) - killed < 2.0  # type: ignore[arg-type]
            ptrs = [b.base for b in second.layout.buffers]
            assert pair.connection.send_kvcache(second.endpoint, prefill, ptrs, dst) == 256 * 65536 * 8
            expected = expected_buffers(
                pair.memory.views, pair.local, big.allocate(99).views, second.layout, prefill, dst
            )
            assert second.hashes() == buffer_digests(expected)
        finally:
            second.close()


def test_frozen_peer_times_out_within_the_configured_timeout_and_recovers() -> None:
    harness = ContractHarness("nixl", two_process=True, config=BackendConfig(timeout_s=3.0))
    with harness.pair(SPEC, SPEC, 6) as pair:
        prefill, dst = _pages()
        pid = pair.receiver.pid  # type: ignore[attr-defined]
        freeze(pid)  # before the first transfer: UCX's connection set-up needs the peer
        try:
            start = time.monotonic()
            with pytest.raises(kvwire.TransferTimeoutError):
                pair.send(prefill, dst)
            elapsed = time.monotonic() - start
            assert elapsed < 3.0 + 1.5, elapsed
        finally:
            os.kill(pid, signal.SIGCONT)
        pair.send(prefill, dst)  # the same agent reaches the resumed peer
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, dst)


def test_a_peer_frozen_after_first_contact_never_hangs_the_sender() -> None:
    """With UCX's cross-memory-attach transport the kernel copies into a stopped process: the write completes."""
    harness = ContractHarness("nixl", two_process=True, config=BackendConfig(timeout_s=3.0))
    with harness.pair(SPEC, SPEC, 7) as pair:
        prefill, dst = _pages(seed=7)
        pair.send(prefill[:1], dst[:1])
        pid = pair.receiver.pid  # type: ignore[attr-defined]
        freeze(pid)
        try:
            start = time.monotonic()
            with contextlib.suppress(kvwire.TransferTimeoutError):  # a transport needing the peer (TCP) times out
                pair.send(prefill, dst)
            assert time.monotonic() - start < 3.0 + 1.5
        finally:
            os.kill(pid, signal.SIGCONT)
        assert pair.receiver.hashes() == pair.expected_hashes(prefill, dst)


def test_nixl_info_logs_stay_off_stdout_unless_verbose() -> None:
    script = (
        "import kvwire, sys\n"
        "conn = kvwire.connect('nixl', kvwire.BackendConfig(verbose=sys.argv[1] == 'verbose'))\n"
        "conn.endpoint(); conn.close(); print('DONE')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "NIXL_LOG_LEVEL"}
    quiet, loud = (
        subprocess.run([sys.executable, "-c", script, mode], capture_output=True, text=True, timeout=120, env=env)
        for mode in ("quiet", "verbose")
    )
    assert (quiet.returncode, quiet.stdout) == (0, "DONE\n"), quiet.stderr[-2000:]
    assert loud.returncode == 0 and "NIXL INFO" in loud.stdout, loud.stdout[-2000:]


def test_bench_json_verifies_every_byte() -> None:
    proc = subprocess.run(
        [
            sys.executable, "-m", "kvwire", "bench", "--backend", "nixl", "--preset", "qwen2.5-7b",
            "--requests", "3", "--tokens", "1024", "--json", "--compare-raw", "--compare-uncoalesced",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert (result["verified"], result["guards_unchanged"]) == (True, True)
    assert result["bytes"] == 3 * 64 * 16384 * 28 * 2
    assert {"gbps", "raw_gbps", "ratio", "uncoalesced_gbps"} <= set(result)


def test_a_receiver_that_never_polls_keeps_at_most_its_inbox_bound_the_oldest_dropped() -> None:
    """Issue 23, deliverable 2 on NIXL: the progress thread drains NIXL into the bounded kvwire.transport.Inbox."""
    from kvwire.transport import Inbox

    memory, source = SPEC.allocate(1), SPEC.allocate(2)
    with kvwire.connect("nixl") as receiver, kvwire.connect("nixl") as sender:
        receiver.register_kv_buffers(memory.layout)
        sender.register_kv_buffers(source.layout)
        sender.add_peer(receiver.endpoint(), memory.layout)
        state = receiver.backend.transport.agent._state
        state.inbox = Inbox(limit=50)  # the default bound (65,536) is the same code with a bigger number
        for i in range(200):
            sender.send_notification(receiver.endpoint(), i.to_bytes(4, "big") * 1024)
        deadline = time.monotonic() + 30
        while state.inbox.dropped < 150 and time.monotonic() < deadline:
            time.sleep(0.01)  # nobody polls: the progress thread drains
        assert (len(state.inbox), state.inbox.dropped) == (50, 150)
        got = receiver.poll_notifications()
        assert [n.message for n in got] == [i.to_bytes(4, "big") * 1024 for i in range(150, 200)]
