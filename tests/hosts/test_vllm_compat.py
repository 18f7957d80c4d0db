"""``kvwire.hosts.vllm`` without vLLM: the layout of vLLM's KV tensors, the settings, the wire formats, and
both sides of the connector moving blocks in one process through the ``local`` backend.

vLLM itself runs in ``test_vllm_connector.py`` (slow, in ``.venv-vllm``); here its objects are stood in for by
plain ones with the attributes the connector reads, and its KV cache by tensors allocated the way
``vllm.v1.worker.utils.allocate_kv_cache`` does (one int8 buffer, one strided view per layer).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, NamedTuple

import pytest
import torch
from ports import free_port_run

from kvwire import ConfigError, HeadLayout, InvalidTransferError, LayoutError, PeerDescription
from kvwire.hosts.vllm import ConnectorSettings, layout_from_kv_caches, parse_remote_prefill, prefill_params
from kvwire.hosts.vllm.metadata import ReadyToSend, StepMetadata
from kvwire.hosts.vllm.rank import WorkerRank
from kvwire.hosts.vllm.registration import (
    Registration,
    notification_for,
    parse_notification,
    request_of_notification,
    with_token,
)
from kvwire.hosts.vllm.scheduler import SchedulerSide
from kvwire.hosts.vllm.sending import Sender
from kvwire.hosts.vllm.settings import EngineSide
from kvwire.hosts.vllm.worker import WorkerSide

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
BLOCKS, HEADS, TOKENS, DIMS = 8, 2, 32, 128  # fp16: 16384-byte blocks


def vllm_kv_caches(num_blocks: int = BLOCKS, layers: int = 2, heads: int = HEADS) -> dict[str, torch.Tensor]:
    """What vLLM's allocate_kv_cache returns on CPU (LBHNC): views at layer_stride into one int8 buffer."""
    block = heads * TOKENS * DIMS * 2
    raw = torch.zeros(layers * num_blocks * block, dtype=torch.int8)
    return {
        f"model.layers.{i}.self_attn.attn": torch.as_strided(
            raw, (num_blocks, heads, TOKENS, DIMS * 2), (block, TOKENS * DIMS * 2, DIMS * 2, 1), i * num_blocks * block
        ).view(torch.float16)
        for i in range(layers)
    }


def test_a_vllm_kv_cache_becomes_one_whole_block_buffer_per_layer() -> None:
    caches = vllm_kv_caches()
    mapped = layout_from_kv_caches(caches)
    first = caches[LAYERS[0]].data_ptr()
    assert [(b.base - first, b.page_bytes, b.num_pages, b.layer, b.role) for b in mapped.layout.buffers] == [
        (0, 16384, 8, 0, "kv"),
        (131072, 16384, 8, 1, "kv"),
    ]
    assert mapped.layer_names == tuple(LAYERS) and (mapped.num_blocks, mapped.block_bytes) == (8, 16384)
    assert {b.memory for b in mapped.layout.buffers} == {"host"}
    assert mapped.check_block_ids([1, 7], "ids") == [1, 7]
    with pytest.raises(LayoutError, match=r"^ids\[1\] = 8 is not a block of this KV cache: ids run 1\.\.7 \(block 0 "):
        mapped.check_block_ids([1, 8], "ids")
    with pytest.raises(LayoutError, match=r"^ids\[0\] = 0 is not a block"):
        mapped.check_block_ids([0], "ids")


def test_kv_tensors_kvwire_cannot_move_as_blocks_are_refused_naming_layer_and_shape() -> None:
    name = LAYERS[0]
    cases: list[tuple[torch.Tensor, str]] = [
        (torch.zeros(2, 8, 2, 32, 128, dtype=torch.float16), "expected vLLM's [num_blocks, num_kv_heads"),
        (torch.zeros(2, 8, 32, 128, dtype=torch.float16).transpose(0, 1), "a block is not one contiguous run"),
        (torch.zeros(8, 2, 2, 32, 128, dtype=torch.float16)[:, 0], "blocks are 16384 elements apart but hold 8192"),
    ]
    for tensor, why in cases:
        shape = list(tensor.shape)
        with pytest.raises(LayoutError) as info:
            layout_from_kv_caches({name: tensor})
        assert str(info.value).startswith(f"layer '{name}' (shape {shape}, stride {list(tensor.stride())}): "), info
        assert why in str(info.value)
    mixed = {**vllm_kv_caches(), "model.layers.2.self_attn.attn": torch.zeros(4, 2, 32, 128, dtype=torch.float16)}
    with pytest.raises(
        LayoutError, match=r"has 4 blocks of 16384 bytes, but layer 'model.layers.0.self_attn.attn' has 8"
    ):
        layout_from_kv_caches(mixed)
    with pytest.raises(LayoutError, match="non-empty dict"):
        layout_from_kv_caches({})


def test_settings_are_read_from_kv_connector_extra_config_and_checked() -> None:
    s = ConnectorSettings.from_extra_config(
        {"backend": "nixl", "backend_options": {"streams": 1}, "side_channel_port": 6000, "lease_s": 5}
    )
    assert (s.backend, s.side_channel_port, s.lease_s, s.load_timeout_s) == ("nixl", 6000, 5.0, 30.0)
    assert dict(s.backend_config.options) == {"streams": 1} and s.backend_config.timeout_s == 10.0
    bad: list[tuple[dict[str, Any], str]] = [
        ({}, "kv_connector_extra_config['backend'] must name a kvwire backend"),
        ({"backend": "nixl", "side_channel_port": 0}, "['side_channel_port'] must be a TCP port 1..65535, got 0"),
        ({"backend": "nixl", "lease_s": 0}, "['lease_s'] must be a finite number of seconds > 0, got 0"),
        ({"backend": "nixl", "backend_options": []}, "['backend_options'] must be a dict, got list"),
        ({"backend": "nixl", "load_timeout_s": 10}, "['load_timeout_s'] = 10 must exceed kv_connector_extra_config"),
    ]  # fmt: skip
    for extra, message in bad:
        with pytest.raises(ConfigError) as info:
            ConnectorSettings.from_extra_config(extra)
        assert message in str(info.value)


def test_a_key_the_connector_does_not_read_is_logged_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    s = ConnectorSettings.from_extra_config({"backend": "nixl", "side_chanel_port": 1})
    assert s.side_channel_port == 5710
    (record,) = caplog.records
    assert record.levelname == "WARNING" and record.getMessage().startswith(
        "kvwire: kv_connector_extra_config['side_chanel_port'] is not read by kvwire's connector (did you mean "
        "'side_channel_port'?); it reads ['backend', 'backend_options', "
    )


def test_the_prefills_params_parse_back_on_the_decode_and_foreign_ones_are_refused() -> None:
    params = prefill_params("p0", "engine-p", "10.0.0.1", 5710, [3, 4, 5], 1, 70)
    remote = parse_remote_prefill(params)
    assert (remote.request_id, remote.engine_id, remote.host, remote.port) == ("p0", "engine-p", "10.0.0.1", 5710)
    assert (remote.block_ids, remote.tp_size, remote.num_tokens) == ((3, 4, 5), 1, 70)
    assert parse_remote_prefill(dict(params, remote_block_ids=[[3, 4, 5]])).block_ids == (3, 4, 5)  # NIXL's groups
    bad: list[tuple[dict[str, Any], str]] = [
        ({"kvwire": None}, "kv_transfer_params['kvwire'] = None: not written by this connector's prefill"),
        ({"remote_port": "5710"}, "kv_transfer_params['remote_port'] must be an int, got '5710'"),
        ({"remote_block_ids": []}, "kv_transfer_params['remote_block_ids'] must be a non-empty list"),
        ({"remote_block_ids": [1, -2]}, "kv_transfer_params['remote_block_ids'][1] = -2 is not a block id"),
    ]
    for change, message in bad:
        with pytest.raises(InvalidTransferError) as info:
            parse_remote_prefill(dict(params, **change))
        assert str(info.value).startswith(message)


def test_notifications_name_the_decode_request() -> None:
    assert request_of_notification(notification_for("cmpl-7")) == "cmpl-7"
    assert request_of_notification(b"someone else's") is None


def _request(req_id: str, n: int, params: dict[str, Any] | None, status: str = "RUNNING") -> Any:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(n)),
        kv_transfer_params=params,
        status=SimpleNamespace(name=status),
        num_computed_tokens=n,
    )


def _blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_unhashed_block_ids=lambda: list(ids))


def _port() -> int:
    return free_port_run(8)  # a side channel per prefill TP rank: port + rank


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _until(fn: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := fn()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
    return got


class LocalPair(NamedTuple):
    """A prefill and a decode of the connector in one process: both sides of each, the prefill's KV random."""

    p_sched: SchedulerSide
    d_sched: SchedulerSide
    p_work: WorkerSide
    d_work: WorkerSide
    p_caches: dict[str, torch.Tensor]
    d_caches: dict[str, torch.Tensor]


@contextlib.contextmanager
def local_pair(settings: ConnectorSettings) -> Iterator[LocalPair]:
    """A :class:`LocalPair` on ``settings``, its workers' KV caches registered; both workers shut down after."""
    p_sched = SchedulerSide(EngineSide(settings, 1, producer=True, consumer=False), "engine-p")
    d_sched = SchedulerSide(EngineSide(settings, 1, producer=False, consumer=True), "engine-d")
    p_caches, d_caches = vllm_kv_caches(), vllm_kv_caches()
    for t in p_caches.values():
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16))
    p_work = WorkerSide(EngineSide(settings, 1, producer=True, consumer=False), 0)
    d_work = WorkerSide(EngineSide(settings, 1, producer=False, consumer=True), 0)
    p_work.register_kv_caches(p_caches)
    d_work.register_kv_caches(d_caches)
    try:
        yield LocalPair(p_sched, d_sched, p_work, d_work, p_caches, d_caches)
    finally:
        p_work.shutdown()
        d_work.shutdown()


def test_both_sides_move_blocks_in_one_process_through_the_local_backend() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port(), "lease_s": 60})
    with local_pair(settings) as (p_sched, d_sched, p_work, d_work, p_caches, d_caches):
        # prefill: the request finishes holding blocks 1, 2, 3; the decode's own blocks are 6, 4, 5
        prefill = _request("p0", 70, {"do_remote_decode": True}, status="FINISHED_LENGTH_CAPPED")
        delay, params = p_sched.request_finished(prefill, [1, 2, 3])
        assert delay is True and params is not None and p_sched.has_pending_push_work()
        p_work.start(p_sched.build_connector_meta(None))
        decode = _request("d0", 70, dict(params))
        assert d_sched.get_num_new_matched_tokens(decode, 0) == (70, True)
        d_sched.update_state_after_alloc(decode, _blocks([6, 4, 5]), 70)
        assert decode.kv_transfer_params["do_remote_prefill"] is False  # registered once
        d_sched.update_state_after_alloc(decode, _blocks([6, 4, 5]), 0)
        meta = d_sched.build_connector_meta(None)
        assert [r.block_ids for r in meta.to_receive] == [(6, 4, 5)]
        d_work.start(meta)
        recving = _until(lambda: d_work.get_finished()[1])
        assert recving == {"d0"} and d_work.load_errors() == set()
        for name in LAYERS:
            assert torch.equal(d_caches[name][[6, 4, 5]].view(torch.int16), p_caches[name][[1, 2, 3]].view(torch.int16))
            assert not d_caches[name][[1, 2, 3, 7]].any()  # nothing else written
        sending = _until(lambda: p_work.get_finished()[0])
        assert sending == {"p0"}
        p_sched.update_connector_output(SimpleNamespace(finished_sending=sending))
        assert not p_sched.has_pending_push_work()


def test_a_refused_registration_reports_the_decodes_blocks_as_load_errors_and_nothing_moves() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port()})
    p_caches, d_caches = vllm_kv_caches(), vllm_kv_caches()
    for t in p_caches.values():
        t.fill_(1.0)
    p_work = WorkerSide(EngineSide(settings, 1, producer=True, consumer=False), 0)
    d_work = WorkerSide(EngineSide(settings, 1, producer=False, consumer=True), 0)
    p_work.register_kv_caches(p_caches)
    d_work.register_kv_caches(d_caches)
    try:
        p_work.start(StepMetadata(to_send=(ReadyToSend("p0", (1, 2)),)))
        params = prefill_params("p0", "e", "127.0.0.1", settings.side_channel_port, [1, 3], 1, 40)  # 3: not p0's
        d_sched = SchedulerSide(EngineSide(settings, 1, producer=False, consumer=True), "engine-d")
        decode = _request("d0", 40, params)
        assert d_sched.get_num_new_matched_tokens(decode, 0) == (40, True)
        d_sched.update_state_after_alloc(decode, _blocks([5, 6]), 40)
        d_work.start(d_sched.build_connector_meta(None))
        recving = _until(lambda: d_work.get_finished()[1])
        assert recving == {"d0"} and d_work.load_errors() == {5, 6}
        assert d_work.receiver is not None
        assert d_work.receiver.failures == {
            "d0": "the prefill did not take the registration: the prefill's kvwire side channel failed: "
            "prefill_block_ids [1, 3] are not the blocks request 'p0' holds ([1, 2], or their tail); nothing was sent"
        }
        assert all(not t.any() for t in d_caches.values())
    finally:
        p_work.shutdown()
        d_work.shutdown()


def test_blocks_nobody_asks_for_are_released_at_the_lease_end() -> None:
    clock = Clock()
    caches = vllm_kv_caches()
    sender = Sender(WorkerRank(SimpleNamespace(), layout_from_kv_caches(caches), 0, 1, clock), lease_s=30)  # type: ignore[arg-type]
    sender.mark_ready(ReadyToSend("p0", (1, 2)))
    clock.now += 29.9
    assert sender.finished() == set()
    clock.now += 0.2
    assert sender.finished() == {"p0"}
    assert sender.finished() == set()


def test_a_decode_whose_blocks_never_come_fails_them_at_load_timeout() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"backend": "local", "side_channel_port": _port(), "load_timeout_s": 1.5, "transfer_timeout_s": 0.2}
    )
    d_work = WorkerSide(EngineSide(settings, 1, producer=False, consumer=True), 0)
    d_work.register_kv_caches(vllm_kv_caches())
    p_work = WorkerSide(EngineSide(settings, 1, producer=True, consumer=False), 0)
    p_work.register_kv_caches(vllm_kv_caches())  # listening, but its scheduler never says p0 finished
    try:
        params = prefill_params("p0", "e", "127.0.0.1", settings.side_channel_port, [1, 2], 1, 40)
        d_sched = SchedulerSide(EngineSide(settings, 1, producer=False, consumer=True), "engine-d")
        decode = _request("d0", 40, params)
        d_sched.get_num_new_matched_tokens(decode, 0)
        d_sched.update_state_after_alloc(decode, _blocks([3, 4]), 40)
        t0 = time.monotonic()
        d_work.start(d_sched.build_connector_meta(None))
        recving = _until(lambda: d_work.get_finished()[1])
        assert 1.5 <= time.monotonic() - t0 < 5
        assert recving == {"d0"} and d_work.load_errors() == {3, 4}
        assert d_work.receiver is not None
        assert d_work.receiver.failures == {"d0": "its blocks did not arrive within load_timeout_s = 1.5 s"}
    finally:
        p_work.shutdown()
        d_work.shutdown()


def test_an_infinite_lease_is_refused_naming_its_key() -> None:
    with pytest.raises(ConfigError) as exc:
        ConnectorSettings.from_extra_config({"backend": "local", "lease_s": float("inf")})
    assert "lease_s" in str(exc.value) and str(exc.value).endswith("must be a finite number of seconds > 0, got inf")


def test_a_registration_is_parsed_strictly() -> None:
    caches = vllm_kv_caches()
    mapped = layout_from_kv_caches(caches)
    from kvwire import PeerDescription

    reg = Registration("p0", "d0", (1, 2), (3, 4), tuple(LAYERS), 0, 1, 9.5, PeerDescription("ep", mapped.layout))
    assert Registration.from_dict(reg.to_dict()) == reg
    bad: list[tuple[dict[str, Any], str]] = [
        ({"version": 2}, "registration: version 2 is not supported (this kvwire reads 1)"),
        ({"decode_block_ids": [3]}, "registration: 2 prefill_block_ids but 1 decode_block_ids"),
        ({"extra": 1}, "registration: unknown fields ['extra']"),
        ({"tp_size": 0}, "registration: 'tp_size' must be an int >= 1, got 0"),
        ({"valid_for_s": float("inf")}, "registration: 'valid_for_s' must be a number of seconds > 0, got inf"),
        ({"prefill_block_ids": [1, "2"]}, "registration: prefill_block_ids[1] = '2' must be an int block id"),
        (
            {"prefill_block_ids": [], "decode_block_ids": []},
            "registration: 'prefill_block_ids' must be a non-empty list of block ids, got []",
        ),
    ]
    for change, message in bad:
        with pytest.raises(InvalidTransferError) as info:
            Registration.from_dict({**reg.to_dict(), **change})
        assert str(info.value).startswith(message)


def test_a_write_that_could_outlast_the_decodes_wait_is_not_started() -> None:
    """The decode frees its blocks when it stops waiting: a write that might end later would hit reused blocks."""
    from kvwire import PeerDescription

    clock = Clock()
    mapped = layout_from_kv_caches(vllm_kv_caches())
    connection = SimpleNamespace(config=SimpleNamespace(timeout_s=10.0))
    sender = Sender(WorkerRank(connection, mapped, 0, 1, clock), lease_s=30)  # type: ignore[arg-type]
    sender.mark_ready(ReadyToSend("p0", (1, 2)))
    reg = Registration("p0", "d0", (1, 2), (3, 4), tuple(LAYERS), 0, 1, 10.5, PeerDescription("ep", mapped.layout))
    assert sender.handle(reg.to_dict()) == {
        "error": "request 'p0': the decode stops waiting in 10.50 s, before a write could be sure to end "
        "(transfer_timeout_s = 10 s); not started (raise load_timeout_s on the decode above transfer_timeout_s)"
    }


def _held_sender(clock: Clock) -> tuple[Sender, list[Future[int]], Any]:
    """A prefill worker's Sender whose writes stay in flight until the test completes their futures."""
    writes: list[Future[int]] = []

    def submit(endpoint: str, src: Any, ptrs: Any, dst: Any, notification: bytes) -> Future[int]:
        writes.append(Future())
        return writes[-1]

    connection = SimpleNamespace(
        config=SimpleNamespace(timeout_s=10.0), add_peer=lambda endpoint, layout: None, submit_kvcache=submit
    )
    mapped = layout_from_kv_caches(vllm_kv_caches())
    sender = Sender(WorkerRank(connection, mapped, 0, 1, clock), lease_s=30)  # type: ignore[arg-type]
    return sender, writes, mapped


def test_a_decode_block_id_equal_to_the_block_count_is_refused_by_the_sender() -> None:
    from kvwire import PeerDescription

    sender, writes, mapped = _held_sender(Clock())
    blocks = mapped.layout.buffers[0].num_pages
    sender.mark_ready(ReadyToSend("p0", (1, 2)))
    reg = Registration("p0", "d0", (1, 2), (3, blocks), tuple(LAYERS), 0, 1, 60.0, PeerDescription("ep", mapped.layout))
    assert sender.handle(reg.to_dict()) == {
        "error": f"decode_block_ids[1] = {blocks} is not a block of the decode's KV cache: ids run "
        f"1..{blocks - 1} (block 0 is vLLM's null block); nothing was sent"
    }
    assert writes == []


def test_the_lease_never_frees_blocks_a_write_still_reads() -> None:
    """A write still in flight when the lease ends: vLLM is told the request is finished only once it ends."""
    from kvwire import PeerDescription

    clock = Clock()
    sender, writes, mapped = _held_sender(clock)
    sender.mark_ready(ReadyToSend("p0", (1, 2)))
    reg = Registration("p0", "d0", (1, 2), (3, 4), tuple(LAYERS), 0, 1, 60.0, PeerDescription("ep", mapped.layout))
    assert sender.handle(reg.to_dict()) == {"accepted": "p0"}
    (write,) = writes
    clock.now += 31  # past lease_s = 30
    assert sender.finished() == set()  # the transport still reads blocks 1 and 2
    write.set_result(2 * mapped.layout.buffers[0].page_bytes)
    assert sender.finished() == {"p0"}


def test_a_decode_rank_registers_at_its_own_rank_port_with_a_prefill_of_the_same_tp_size() -> None:
    """Rank to rank between equal TP sizes: decode rank 1 of 2 asks prefill rank 1, at side_channel_port + 1."""
    import kvwire
    from kvwire.hosts.vllm.metadata import ToReceive
    from kvwire.hosts.vllm.params import RemotePrefill
    from kvwire.hosts.vllm.receiving import Receiver

    sent: list[tuple[str, int]] = []
    client = SimpleNamespace(send=lambda host, port, message, reply: sent.append((host, port)))
    caches = vllm_kv_caches(heads=2)
    with kvwire.connect("local") as connection:
        mapped = layout_from_kv_caches(caches, 2, 1, 4)
        connection.register_kv_buffers(mapped.layout)
        receiver = Receiver(WorkerRank(connection, mapped, 1, 2, Clock()), client, 30.0)  # type: ignore[arg-type]
        try:
            remote = RemotePrefill("p0", "engine-p", "10.0.0.1", 5000, (1, 2), 2, 40)
            receiver.start(ToReceive("d0", (3, 4), remote))
        finally:
            receiver.close()
    assert sent == [("10.0.0.1", 5001)]


def test_the_connector_class_says_vllm_is_missing_where_it_is() -> None:
    import importlib.util

    import kvwire.hosts.vllm

    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:  # not a namespace package (tests/hosts/vllm on sys.path)
        pytest.skip("vLLM is installed here")
    with pytest.raises(ModuleNotFoundError) as info:
        _ = kvwire.hosts.vllm.KvwireConnector
    assert str(info.value) == (
        "kvwire.hosts.vllm.KvwireConnector subclasses vLLM's KVConnectorBase_V1, and 'vllm' is not installed here: "
        "install vLLM in this environment (the rest of kvwire.hosts.vllm works without it)"
    )


# -- across TP sizes ---------------------------------------------------------------------------------------------
# The oracles below are the test's own: which global KV heads a vLLM rank holds, and which prefill ranks a decode
# rank receives from (vLLM's NIXL connector's and sglang's routing), written independently of kvwire's planner.


def held_heads(tp: int, rank: int, total: int) -> range:
    """vLLM's split: total // tp heads a rank, or (fewer heads than ranks) one head replicated on tp // total ranks."""
    if total >= tp:
        return range(rank * (total // tp), (rank + 1) * (total // tp))
    return range(rank * total // tp, rank * total // tp + 1)


def routed_senders(p_tp: int, d_tp: int, d: int) -> list[int]:
    if p_tp <= d_tp:
        return [d * p_tp // d_tp]
    return list(range(d * (p_tp // d_tp), (d + 1) * (p_tp // d_tp)))


def _randomize(caches: dict[str, torch.Tensor]) -> None:
    for t in caches.values():
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16))


def test_a_layout_with_the_models_kv_heads_records_its_tp_rank_and_head_major_blocks() -> None:
    mapped = layout_from_kv_caches(vllm_kv_caches(), 2, 1, 4)
    assert (mapped.layout.attn_tp_size, mapped.layout.attn_tp_rank) == (2, 1)
    assert mapped.layout.heads == HeadLayout(2, 4, 128, 2, 32, head_major=True)
    assert mapped.layout.attention == "mha" and mapped.block_bytes == 16384
    assert layout_from_kv_caches(vllm_kv_caches()).layout.heads is None  # no total: same TP sizes only, as before
    name = LAYERS[0]
    for tp, total, why in (
        (2, 3, "HeadLayout.total_kv_heads = 3 is not divisible by attn_tp_size = 2 (nor divides it)"),
        (2, 8, "HeadLayout.kv_heads = 2, but total_kv_heads = 8 over attn_tp_size = 2 gives 4 per rank"),
    ):
        with pytest.raises(LayoutError) as info:
            layout_from_kv_caches(vllm_kv_caches(), tp, 0, total)
        assert str(info.value) == (
            f"layer '{name}' (shape [8, 2, 32, 128]): its blocks cannot be sliced by KV head for TP rank 0 of {tp} "
            f"with the model's {total} KV heads: {why}"
        )


def test_notifications_across_tp_sizes_name_the_prefill_rank_and_are_parsed_strictly() -> None:
    assert notification_for("cmpl-7", 3) == b"kvwire.vllm.rank:3:cmpl-7"
    assert parse_notification(notification_for("a:b", 12)) == ("a:b", 12)
    assert parse_notification(notification_for("cmpl-7")) == ("cmpl-7", None)
    assert request_of_notification(notification_for("cmpl-7", 0)) is None  # not the one-sender form
    for bad in (b"kvwire.vllm.rank:", b"kvwire.vllm.rank:1", b"kvwire.vllm.rank:1:", b"kvwire.vllm.rank:-1:r",
                b"kvwire.vllm.rank:01:r", b"kvwire.vllm.rank:x:r", b"kvwire.vllm.rank: 1:r", b"kvwire.vllm.rank:1:\xff",
                b"kvwire.vllm.rank:1234567890:r"):  # fmt: skip
        assert parse_notification(bad) is None, bad


def _queued(work: WorkerSide, count: int) -> Any:
    """True once the prefill worker queued ``count`` decode ranks' registrations for p0."""
    sender = work.sender
    assert sender is not None
    return lambda: len(sender._waiting.get("p0", {})) == count


@pytest.mark.parametrize(
    ("p_tp", "d_tp", "total"),
    [(1, 2, 4), (2, 1, 4), (2, 4, 4), (4, 1, 2), (1, 4, 2), (2, 4, 2)],
    ids=["1to2", "2to1", "2to4", "4to1-gqa-2-heads", "1to4-gqa-2-heads", "2to4-gqa-2-heads"],
)
def test_blocks_move_head_by_head_across_tp_sizes(p_tp: int, d_tp: int, total: int) -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port(), "lease_s": 60})
    p_sched = SchedulerSide(EngineSide(settings, p_tp, producer=True, consumer=False, total_kv_heads=total), "engine-p")
    d_sched = SchedulerSide(EngineSide(settings, d_tp, producer=False, consumer=True, total_kv_heads=total), "engine-d")
    p_caches = [vllm_kv_caches(heads=max(1, total // p_tp)) for _ in range(p_tp)]
    d_caches = [vllm_kv_caches(heads=max(1, total // d_tp)) for _ in range(d_tp)]
    for caches in p_caches:
        _randomize(caches)  # every rank different, replicas of a head too: the bytes say which rank wrote them
    p_work = [
        WorkerSide(EngineSide(settings, p_tp, producer=True, consumer=False, total_kv_heads=total), r)
        for r in range(p_tp)
    ]
    d_work = [
        WorkerSide(EngineSide(settings, d_tp, producer=False, consumer=True, total_kv_heads=total), r)
        for r in range(d_tp)
    ]
    try:
        for work, caches in [*zip(p_work, p_caches, strict=True), *zip(d_work, d_caches, strict=True)]:
            work.register_kv_caches(caches)
        prefill = _request("p0", 70, {"do_remote_decode": True}, status="FINISHED_LENGTH_CAPPED")
        _, params = p_sched.request_finished(prefill, [1, 2, 3])
        assert params is not None and params["tp_size"] == p_tp
        p_meta = p_sched.build_connector_meta(None)
        decode = _request("d0", 70, dict(params))
        assert d_sched.get_num_new_matched_tokens(decode, 0) == (70, True)
        d_sched.update_state_after_alloc(decode, _blocks([6, 4, 5]), 70)
        d_meta = d_sched.build_connector_meta(None)  # every decode rank gets the step's metadata
        for work in d_work:  # the decode registers first: each prefill rank queues its decode ranks' registrations
            work.start(d_meta)
        for r, work in enumerate(p_work):
            routed = [d for d in range(d_tp) if r in routed_senders(p_tp, d_tp, d)]
            _until(_queued(work, len(routed)))
        for work in p_work:
            work.start(p_meta)
        for work in d_work:
            assert _until(lambda w=work: w.get_finished()[1]) == {"d0"} and work.load_errors() == set()
        for d, caches in enumerate(d_caches):
            for name in LAYERS:
                got = caches[name].view(torch.int16)
                for p_block, d_block in ((1, 6), (2, 4), (3, 5)):
                    for j, head in enumerate(held_heads(d_tp, d, total)):
                        writer = min(s for s in routed_senders(p_tp, d_tp, d) if head in held_heads(p_tp, s, total))
                        local = head - held_heads(p_tp, writer, total).start
                        want = p_caches[writer][name].view(torch.int16)[p_block, local]
                        assert torch.equal(got[d_block, j], want), (d, name, d_block, head, writer)
                assert not got[[1, 2, 3, 7]].any()  # nothing else written
        for work in p_work:
            assert _until(lambda w=work: w.get_finished()[0]) == {"p0"}
    finally:
        for work in [*p_work, *d_work]:
            work.shutdown()


def _registration(p0_blocks: tuple[int, ...], d_tp: int, d: int, total: int | None) -> Registration:
    peer = layout_from_kv_caches(vllm_kv_caches(heads=max(1, (total or 4) // d_tp)), d_tp, d, total)
    return Registration("p0", "d0", p0_blocks, (3, 4), tuple(LAYERS), d, d_tp, 30.0, PeerDescription("ep", peer.layout))


def test_a_prefill_rank_takes_only_the_decode_ranks_routed_to_it() -> None:
    def sender(p_tp: int, p: int, total: int | None = 4) -> Sender:
        mapped = layout_from_kv_caches(vllm_kv_caches(heads=max(1, 4 // p_tp)), p_tp, p, total)
        connection = SimpleNamespace(config=SimpleNamespace(timeout_s=10.0))
        return Sender(WorkerRank(connection, mapped, p, p_tp, Clock()), lease_s=30)  # type: ignore[arg-type]

    start = "registration for 'p0': the decode is TP rank"
    refused = [
        (sender(2, 1), _registration((1, 2), 4, 0, 4), f"{start} 0 of 4, this prefill worker rank 1 of 2: decode "
         "rank 0 receives from prefill rank 0, not from this one; register with the prefill ranks routed to it "
         "(nothing was sent)"),
        (sender(4, 2), _registration((1, 2), 2, 0, 4), f"{start} 0 of 2, this prefill worker rank 2 of 4: decode "
         "rank 0 receives from prefill ranks 0..1, not from this one; register with the prefill ranks routed to it "
         "(nothing was sent)"),
        (sender(2, 0), _registration((1, 2), 1, 0, None), f"{start} 0 of 1, this prefill worker rank 0 of 2: "
         "different TP sizes need both KV caches described by KV head, and the decode's is not (its connector was "
         "not given the model's total KV heads: vllm_config.model_config)"),
        (sender(2, 0), _registration((1, 2), 2, 1, 4), f"{start} 1 of 2, this prefill worker rank 0 of 2: kvwire's "
         "vLLM connector moves whole blocks between equal TP sizes, rank to rank"),
        (sender(2, 0), _registration((1, 9), 4, 1, 4), "prefill_block_ids[1] = 9 is not a block of this KV cache: "
         "ids run 1..7 (block 0 is vLLM's null block)"),
    ]  # fmt: skip
    for s, reg, message in refused:
        assert s.handle(reg.to_dict()) == {"error": message}
    routed = sender(2, 1)
    for d in (2, 3):  # decode ranks 2 and 3 of 4 receive from prefill rank 1 of 2: queued until p0 is ready
        assert routed.handle(_registration((1, 2), 4, d, 4).to_dict()) == {"queued": "p0"}
    assert sender(4, 3).handle(_registration((1, 2), 2, 1, 4).to_dict()) == {"queued": "p0"}
    owned = sender(2, 1)
    owned.mark_ready(ReadyToSend("p0", (1, 5)))
    assert owned.handle(_registration((1, 2), 4, 2, 4).to_dict()) == {
        "error": "prefill_block_ids [1, 2] are not the blocks request 'p0' holds ([1, 5], or their tail); nothing "
        "was sent"
    }


def _two_to_one(
    settings: ConnectorSettings, ranks: tuple[int, ...]
) -> tuple[list[WorkerSide], WorkerSide, dict[str, Any]]:
    """Prefill TP 2 (only ``ranks`` running), decode TP 1, 4 KV heads: p0 holds blocks 1, 2; params for d0."""
    p_work = [WorkerSide(EngineSide(settings, 2, producer=True, consumer=False, total_kv_heads=4), r) for r in ranks]
    for work in p_work:
        work.register_kv_caches(vllm_kv_caches())
    d_work = WorkerSide(EngineSide(settings, 1, producer=False, consumer=True, total_kv_heads=4), 0)
    d_work.register_kv_caches(vllm_kv_caches(heads=4))
    return p_work, d_work, prefill_params("p0", "e", "127.0.0.1", settings.side_channel_port, [1, 2], 2, 40)


def _decode(settings: ConnectorSettings, d_work: WorkerSide, params: dict[str, Any]) -> set[str]:
    d_sched = SchedulerSide(EngineSide(settings, 1, producer=False, consumer=True, total_kv_heads=4), "engine-d")
    decode = _request("d0", 40, params)
    assert d_sched.get_num_new_matched_tokens(decode, 0) == (40, True)
    d_sched.update_state_after_alloc(decode, _blocks([5, 6]), 40)
    d_work.start(d_sched.build_connector_meta(None))
    return set(_until(lambda: d_work.get_finished()[1]))


def test_one_sender_refusing_fails_the_whole_request_across_tp_sizes() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port()})
    p_work, d_work, params = _two_to_one(settings, (0, 1))
    try:
        p_work[0].start(StepMetadata(to_send=(ReadyToSend("p0", (1, 2)),)))
        p_work[1].start(StepMetadata(to_send=(ReadyToSend("p0", (1, 3)),)))  # rank 1 holds other blocks: refuses
        assert _decode(settings, d_work, params) == {"d0"} and d_work.load_errors() == {5, 6}
        assert d_work.receiver is not None and d_work.receiver.failures == {
            "d0": "prefill rank 1 (of 2) did not take the registration: the prefill's kvwire side channel failed: "
            "prefill_block_ids [1, 2] are not the blocks request 'p0' holds ([1, 3], or their tail); nothing was sent"
        }
    finally:
        for work in [*p_work, d_work]:
            work.shutdown()


def test_one_sender_unreachable_fails_the_whole_request_across_tp_sizes() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port()})
    p_work, d_work, params = _two_to_one(settings, (0,))  # prefill rank 1 is not running
    try:
        p_work[0].start(StepMetadata(to_send=(ReadyToSend("p0", (1, 2)),)))
        assert _decode(settings, d_work, params) == {"d0"} and d_work.load_errors() == {5, 6}
        assert d_work.receiver is not None
        assert d_work.receiver.failures["d0"].startswith("prefill rank 1 (of 2) did not take the registration: ")
        assert _until(lambda: p_work[0].get_finished()[0]) == {"p0"}  # rank 0 wrote; vLLM frees its blocks
    finally:
        for work in [*p_work, d_work]:
            work.shutdown()


def test_one_sender_silent_fails_the_whole_request_at_load_timeout_across_tp_sizes() -> None:
    settings = ConnectorSettings.from_extra_config(
        {"backend": "local", "side_channel_port": _port(), "load_timeout_s": 1.5, "transfer_timeout_s": 0.2}
    )
    p_work, d_work, params = _two_to_one(settings, (0, 1))
    try:
        p_work[0].start(StepMetadata(to_send=(ReadyToSend("p0", (1, 2)),)))  # rank 1's scheduler never says so
        t0 = time.monotonic()
        assert _decode(settings, d_work, params) == {"d0"} and d_work.load_errors() == {5, 6}
        assert 1.5 <= time.monotonic() - t0 < 5
        assert d_work.receiver is not None and d_work.receiver.failures == {
            "d0": "its blocks did not arrive within load_timeout_s = 1.5 s (from prefill ranks [1])"
        }
    finally:
        for work in [*p_work, d_work]:
            work.shutdown()


def test_a_decode_takes_a_prefill_of_another_tp_size_only_when_it_can_be_sliced(
    caplog: pytest.LogCaptureFixture,
) -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "nixl"})
    for tp_size, total, prefill_tp, why in (
        (2, None, 1, "kvwire's vLLM connector moves blocks across TP sizes only when it knows the model's total KV "
         "heads (vllm_config.model_config)"),
        (2, 6, 3, "across TP sizes the larger must be a multiple of the smaller"),
        (2, 6, 4, "the model's 6 KV heads do not split over the prefill's 4 ranks"),
    ):  # fmt: skip
        caplog.clear()
        d_sched = SchedulerSide(
            EngineSide(settings, tp_size, producer=False, consumer=True, total_kv_heads=total), "engine-d"
        )
        params = prefill_params("p0", "e", "127.0.0.1", 5710, [1, 2], prefill_tp, 40)
        assert d_sched.get_num_new_matched_tokens(_request("d0", 40, params), 0) == (0, False)
        assert params["do_remote_prefill"] is False
        assert [r.getMessage() for r in caplog.records] == [
            f"kvwire: request d0: the prefill runs tensor_parallel_size={prefill_tp}, this decode {tp_size}; {why}; "
            "computing its prompt here"
        ]
    d_sched = SchedulerSide(EngineSide(settings, 2, producer=False, consumer=True, total_kv_heads=2), "engine-d")
    params = prefill_params("p0", "e", "127.0.0.1", 5710, [1, 2], 4, 40)
    assert d_sched.get_num_new_matched_tokens(_request("d0", 40, params), 0) == (40, True)


def test_a_prefill_rank_frees_its_blocks_once_every_decode_rank_routed_to_it_is_written() -> None:
    from concurrent.futures import Future

    writes: list[tuple[str, list[int], list[int], bytes]] = []

    def submit(endpoint: str, src: Any, ptrs: Any, dst: Any, notification: bytes) -> Future[int]:
        writes.append((endpoint, src.tolist(), dst.tolist(), notification))
        done: Future[int] = Future()
        done.set_result(1)
        return done

    clock = Clock()
    connection = SimpleNamespace(
        config=SimpleNamespace(timeout_s=10.0), add_peer=lambda endpoint, layout: None, submit_kvcache=submit
    )
    mapped = layout_from_kv_caches(vllm_kv_caches(heads=4), 1, 0, 4)
    sender = Sender(WorkerRank(connection, mapped, 0, 1, clock), lease_s=30)  # type: ignore[arg-type]
    sender.mark_ready(ReadyToSend("p0", (1, 2)))
    assert sender.handle(_registration((1, 2), 2, 1, 4).to_dict()) == {"accepted": "p0"}
    assert sender.handle(_registration((1, 2), 2, 1, 4).to_dict()) == {
        "error": "request 'p0': its blocks were already sent to decode rank 1"
    }
    assert sender.finished() == set()  # decode rank 0 of 2 is routed here too and has not registered
    assert sender.handle(_registration((1, 2), 2, 0, 4).to_dict()) == {"accepted": "p0"}
    assert sender.finished() == {"p0"}
    assert [(w[1], w[2], w[3]) for w in writes] == [
        ([1, 2], [3, 4], b"kvwire.vllm.rank:0:d0"),
        ([1, 2], [3, 4], b"kvwire.vllm.rank:0:d0"),
    ]
    sender.mark_ready(ReadyToSend("p1", (1, 2)))  # only one decode rank asks: freed at the lease's end
    assert sender.handle(_registration((1, 2), 2, 0, 4).to_dict() | {"prefill_request_id": "p1"}) == {"accepted": "p1"}
    assert sender.finished() == set()
    clock.now += 30
    assert sender.finished() == {"p1"}


def test_a_request_across_tp_sizes_is_done_only_when_every_sender_arrived() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port()})
    p_work, d_work, params = _two_to_one(settings, (0, 1))
    try:
        p_work[0].start(StepMetadata(to_send=(ReadyToSend("p0", (1, 2)),)))  # rank 1 is not ready yet
        d_sched = SchedulerSide(EngineSide(settings, 1, producer=False, consumer=True, total_kv_heads=4), "engine-d")
        decode = _request("d0", 40, params)
        assert d_sched.get_num_new_matched_tokens(decode, 0) == (40, True)
        d_sched.update_state_after_alloc(decode, _blocks([5, 6]), 40)
        d_work.start(d_sched.build_connector_meta(None))
        assert _until(lambda: p_work[0].get_finished()[0]) == {"p0"}  # rank 0's write ended
        time.sleep(0.3)  # its notification has arrived by now
        assert d_work.get_finished() == (None, None)  # rank 1's has not
        p_work[1].start(StepMetadata(to_send=(ReadyToSend("p0", (1, 2)),)))
        assert _until(lambda: d_work.get_finished()[1]) == {"d0"} and d_work.load_errors() == set()
    finally:
        for work in [*p_work, d_work]:
            work.shutdown()


def test_only_the_routed_senders_notifications_complete_a_request_across_tp_sizes() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port()})
    p_work, d_work, params = _two_to_one(settings, (0, 1))  # both listening, neither ready: nothing is written
    try:
        d_sched = SchedulerSide(EngineSide(settings, 1, producer=False, consumer=True, total_kv_heads=4), "engine-d")
        decode = _request("d0", 40, params)
        assert d_sched.get_num_new_matched_tokens(decode, 0) == (40, True)
        d_sched.update_state_after_alloc(decode, _blocks([5, 6]), 40)
        d_work.start(d_sched.build_connector_meta(None))
        _until(_queued(p_work[0], 1))
        _until(_queued(p_work[1], 1))
        receiver = d_work.receiver
        assert receiver is not None

        token = receiver._pending["d0"].token  # d0's prefill tags its messages with it (issue 37: spoofed arrivals)

        def arrive(message: bytes) -> None:
            tagged = with_token(token, message)
            receiver._on_arrival(SimpleNamespace(notification=SimpleNamespace(message=tagged)))  # type: ignore[arg-type]

        for stray in (notification_for("d0"), notification_for("d0", 2), notification_for("d1", 1), b"other"):
            arrive(stray)
        arrive(notification_for("d0", 0))
        assert d_work.get_finished() == (None, None)
        arrive(notification_for("d0", 1))
        assert d_work.get_finished() == (None, {"d0"}) and d_work.load_errors() == set()
    finally:
        for work in [*p_work, d_work]:
            work.shutdown()
