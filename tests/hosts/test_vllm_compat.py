"""``kvwire.compat.vllm`` without vLLM: the layout of vLLM's KV tensors, the settings, the wire formats, and
both sides of the connector moving blocks in one process through the ``local`` backend.

vLLM itself runs in ``test_vllm_connector.py`` (slow, in ``.venv-vllm``); here its objects are stood in for by
plain ones with the attributes the connector reads, and its KV cache by tensors allocated the way
``vllm.v1.worker.utils.allocate_kv_cache`` does (one int8 buffer, one strided view per layer).
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvwire import ConfigError, InvalidTransferError, LayoutError
from kvwire.compat.vllm import ConnectorSettings, layout_from_kv_caches, parse_remote_prefill, prefill_params
from kvwire.compat.vllm.metadata import ReadyToSend, StepMetadata
from kvwire.compat.vllm.rank import WorkerRank
from kvwire.compat.vllm.registration import Registration, notification_for, request_of_notification
from kvwire.compat.vllm.scheduler import SchedulerSide
from kvwire.compat.vllm.sending import Sender
from kvwire.compat.vllm.worker import WorkerSide

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
BLOCKS, HEADS, TOKENS, DIMS = 8, 2, 32, 128  # fp16: 16384-byte blocks


def vllm_kv_caches(num_blocks: int = BLOCKS, layers: int = 2) -> dict[str, torch.Tensor]:
    """What vLLM's allocate_kv_cache returns on CPU (LBHNC): views at layer_stride into one int8 buffer."""
    block = HEADS * TOKENS * DIMS * 2
    raw = torch.zeros(layers * num_blocks * block, dtype=torch.int8)
    return {
        f"model.layers.{i}.self_attn.attn": torch.as_strided(
            raw, (num_blocks, HEADS, TOKENS, DIMS * 2), (block, TOKENS * DIMS * 2, DIMS * 2, 1), i * num_blocks * block
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
        (torch.zeros(8, 32, 2, 128, dtype=torch.float16).transpose(1, 2), "a block is not one contiguous run"),
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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def test_both_sides_move_blocks_in_one_process_through_the_local_backend() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port(), "lease_s": 60})
    p_sched = SchedulerSide(settings, "engine-p", 1, producer=True, consumer=False)
    d_sched = SchedulerSide(settings, "engine-d", 1, producer=False, consumer=True)
    p_caches, d_caches = vllm_kv_caches(), vllm_kv_caches()
    for t in p_caches.values():
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16))
    p_work = WorkerSide(settings, 0, 1, producer=True, consumer=False)
    d_work = WorkerSide(settings, 0, 1, producer=False, consumer=True)
    p_work.register_kv_caches(p_caches)
    d_work.register_kv_caches(d_caches)
    try:
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
    finally:
        p_work.shutdown()
        d_work.shutdown()


def test_a_refused_registration_reports_the_decodes_blocks_as_load_errors_and_nothing_moves() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port()})
    p_caches, d_caches = vllm_kv_caches(), vllm_kv_caches()
    for t in p_caches.values():
        t.fill_(1.0)
    p_work = WorkerSide(settings, 0, 1, producer=True, consumer=False)
    d_work = WorkerSide(settings, 0, 1, producer=False, consumer=True)
    p_work.register_kv_caches(p_caches)
    d_work.register_kv_caches(d_caches)
    try:
        p_work.start(StepMetadata(to_send=(ReadyToSend("p0", (1, 2)),)))
        params = prefill_params("p0", "e", "127.0.0.1", settings.side_channel_port, [1, 3], 1, 40)  # 3: not p0's
        d_sched = SchedulerSide(settings, "engine-d", 1, producer=False, consumer=True)
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
    d_work = WorkerSide(settings, 0, 1, producer=False, consumer=True)
    d_work.register_kv_caches(vllm_kv_caches())
    p_work = WorkerSide(settings, 0, 1, producer=True, consumer=False)
    p_work.register_kv_caches(vllm_kv_caches())  # listening, but its scheduler never says p0 finished
    try:
        params = prefill_params("p0", "e", "127.0.0.1", settings.side_channel_port, [1, 2], 1, 40)
        d_sched = SchedulerSide(settings, "engine-d", 1, producer=False, consumer=True)
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


def test_the_connector_class_says_vllm_is_missing_where_it_is() -> None:
    import importlib.util

    import kvwire.compat.vllm

    spec = importlib.util.find_spec("vllm")
    if spec is not None and spec.origin is not None:  # not a namespace package (tests/hosts/vllm on sys.path)
        pytest.skip("vLLM is installed here")
    with pytest.raises(ModuleNotFoundError) as info:
        _ = kvwire.compat.vllm.KvwireConnector
    assert str(info.value) == (
        "kvwire.compat.vllm.KvwireConnector subclasses vLLM's KVConnectorBase_V1, and 'vllm' is not installed here: "
        "install vLLM in this environment (the rest of kvwire.compat.vllm works without it)"
    )
