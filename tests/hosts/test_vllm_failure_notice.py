"""The failure notice: a prefill write that fails mid-way fails the decode's request at once, not at load_timeout_s.

Both engines run in this process over the ``local`` backend; the prefill's transport is made to copy half of
a write's descriptors and then fail, as a link that drops mid-transfer does. Without vLLM (its classes run in
``test_vllm_layouts_real.py`` and ``test_vllm_connector.py``).
"""

from __future__ import annotations

import ctypes
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from ports import free_port_run

from kvwire import MAX_NOTIFICATION_BYTES, TransferError
from kvwire.backends.local import LocalTransport
from kvwire.hosts.vllm import ConnectorSettings
from kvwire.hosts.vllm.notices import FailureNotice, failure_notice_for, parse_failure_notice
from kvwire.hosts.vllm.registration import with_token
from kvwire.hosts.vllm.scheduler import SchedulerSide
from kvwire.hosts.vllm.settings import EngineSide
from kvwire.hosts.vllm.worker import WorkerSide
from kvwire.planning.plan import TransferPlan

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
LOAD_TIMEOUT_S = 30.0  # far longer than the test may take: the notice, not the timeout, must end the request


def kv_caches(heads: int = 2, blocks: int = 8) -> dict[str, torch.Tensor]:
    """vLLM's LBHNC views of one int8 buffer (fp16, 32 tokens of 2 x 64 dims per head and block)."""
    block = heads * 32 * 128
    raw = torch.zeros(len(LAYERS) * blocks * block * 2, dtype=torch.int8).view(torch.float16)
    shape, stride = (blocks, heads, 32, 128), (block, 32 * 128, 128, 1)
    return {name: torch.as_strided(raw, shape, stride, i * blocks * block) for i, name in enumerate(LAYERS)}


def _request(req_id: str, n: int, params: dict[str, Any], status: str = "RUNNING") -> Any:
    status_ns = SimpleNamespace(name=status)
    return SimpleNamespace(
        request_id=req_id, prompt_token_ids=list(range(n)), kv_transfer_params=params, status=status_ns,
        num_computed_tokens=n,
    )  # fmt: skip


def _until(fn: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := fn()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
    return got


@pytest.fixture
def half_then_fail(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """The transport of the endpoint named in the returned dict copies half a write's descriptors, then fails."""
    broken: dict[str, Any] = {"endpoint": None, "copied": 0, "of": 0}
    write = LocalTransport.write

    def failing(self: LocalTransport, session_id: str, plan: TransferPlan) -> None:
        if self.endpoint != broken["endpoint"]:
            write(self, session_id, plan)
            return
        triples = list(zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True))
        half = len(triples) // 2
        for src, dst, length in triples[:half]:
            ctypes.memmove(dst, src, length)
        broken.update(copied=half, of=len(triples))
        raise TransferError(f"the link dropped after {half} of {len(triples)} descriptors", peer=session_id)

    monkeypatch.setattr(LocalTransport, "write", failing)
    return broken


@pytest.mark.parametrize("p_tp", [1, 2], ids=["equal-tp", "across-tp-2to1"])
def test_a_write_that_fails_midway_fails_the_decodes_request_at_once(p_tp: int, half_then_fail: dict[str, Any]) -> None:
    settings = ConnectorSettings.from_extra_config(
        {"backend": "local", "side_channel_port": free_port_run(2), "load_timeout_s": LOAD_TIMEOUT_S}
    )
    p_engine = EngineSide(settings, p_tp, producer=True, consumer=False, total_kv_heads=2)
    d_engine = EngineSide(settings, 1, producer=False, consumer=True, total_kv_heads=2)
    p_caches = [kv_caches(heads=2 // p_tp) for _ in range(p_tp)]
    d_caches = kv_caches()
    gen = torch.Generator().manual_seed(7)
    for caches in p_caches:
        for t in caches.values():
            t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16, generator=gen))
    p_work = [WorkerSide(p_engine, r) for r in range(p_tp)]
    d_work = WorkerSide(d_engine, 0)
    try:
        for work, caches in zip(p_work, p_caches, strict=True):
            work.register_kv_caches(caches)
        d_work.register_kv_caches(d_caches)
        assert p_work[-1].connection is not None
        half_then_fail["endpoint"] = p_work[-1].connection.endpoint()  # the last prefill rank's link drops
        p_sched = SchedulerSide(p_engine, "engine-p")
        _, params = p_sched.request_finished(
            _request("p0", 90, {"do_remote_decode": True}, "FINISHED_STOPPED"), [1, 2, 3]
        )
        assert params is not None
        p_meta = p_sched.build_connector_meta(None)
        for work in p_work:
            work.start(p_meta)
        d_sched = SchedulerSide(d_engine, "engine-d")
        decode = _request("d0", 90, dict(params))
        assert d_sched.get_num_new_matched_tokens(decode, 0) == (90, True)
        d_sched.update_state_after_alloc(decode, SimpleNamespace(get_unhashed_block_ids=lambda: [6, 4, 5]), 90)
        t0 = time.monotonic()
        d_work.start(d_sched.build_connector_meta(None))
        assert _until(lambda: d_work.get_finished()[1]) == {"d0"}
        assert time.monotonic() - t0 < 5 < LOAD_TIMEOUT_S  # the notice, not load_timeout_s
        assert d_work.load_errors() == {4, 5, 6}
        assert half_then_fail["copied"] >= 1 and half_then_fail["copied"] < half_then_fail["of"]  # mid-way
        who = "the prefill" if p_tp == 1 else "prefill rank 1"
        assert d_work.receiver is not None and d_work.receiver.failures == {
            "d0": f"{who} failed writing its blocks: the write failed: the link dropped after "
            f"{half_then_fail['copied']} of {half_then_fail['of']} descriptors"
        }
        for work in p_work:  # the prefill frees its blocks: the write ended, failed or not
            assert _until(lambda w=work: w.get_finished()[0]) == {"p0"}
        failed, loads = p_work[-1].drain_stats(), d_work.drain_stats()  # what vLLM's metrics get
        assert failed is not None and failed["num_failed_transfers"] == [1] and failed["transfer_duration"] == []
        assert loads is not None and loads["num_failed_loads"] == [1]
    finally:
        for work in [*p_work, d_work]:
            work.shutdown()


def test_a_failure_notice_is_bounded_and_parsed_strictly() -> None:
    notice = failure_notice_for("cmpl-7", 3, "the write failed: " + "x" * 10_000)
    assert len(notice) <= MAX_NOTIFICATION_BYTES
    parsed = parse_failure_notice(notice)
    assert parsed is not None and (parsed.request_id, parsed.prefill_rank) == ("cmpl-7", 3)
    assert parsed.reason.startswith("the write failed: xxx") and parsed.reason.endswith(" [cut]")
    assert parse_failure_notice(failure_notice_for("a:b\n", None, 'why "quoted"')) == FailureNotice(
        "a:b\n", None, 'why "quoted"'
    )
    prefix = b"kvwire.vllm.failed:"
    for bad in (
        b"kvwire.vllm:cmpl-7",  # an arrival notification
        prefix + b"not json",
        prefix + b"\xff",
        prefix + b'["cmpl-7", 0, "why"]',
        prefix + b'{"request": "", "rank": 0, "reason": "why"}',
        prefix + b'{"request": "r", "rank": -1, "reason": "why"}',
        prefix + b'{"request": "r", "rank": true, "reason": "why"}',
        prefix + b'{"request": "r", "rank": 0, "reason": 5}',
        prefix + b'{"request": "r", "rank": 0, "reason": "why", "more": 1}',
        prefix + b'{"request": "r", "rank": 0, "reason": "' + b"x" * MAX_NOTIFICATION_BYTES + b'"}',
    ):
        assert parse_failure_notice(bad) is None, bad


def test_only_a_notice_from_one_of_the_requests_senders_fails_it() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": free_port_run(1)})
    p_engine = EngineSide(settings, 1, producer=True, consumer=False, total_kv_heads=2)
    d_engine = EngineSide(settings, 1, producer=False, consumer=True, total_kv_heads=2)
    p_work, d_work = WorkerSide(p_engine, 0), WorkerSide(d_engine, 0)
    try:
        p_work.register_kv_caches(kv_caches())
        d_work.register_kv_caches(kv_caches())
        assert p_work.sender is not None and d_work.receiver is not None
        params = SchedulerSide(p_engine, "engine-p").request_finished(
            _request("p0", 40, {"do_remote_decode": True}, "FINISHED_STOPPED"), [1, 2]
        )[1]
        assert params is not None
        d_sched = SchedulerSide(d_engine, "engine-d")
        decode = _request("d0", 40, dict(params))
        d_sched.get_num_new_matched_tokens(decode, 0)
        d_sched.update_state_after_alloc(decode, SimpleNamespace(get_unhashed_block_ids=lambda: [5, 6]), 40)
        d_work.start(d_sched.build_connector_meta(None))  # the prefill queues it: its scheduler never says p0 is ready
        _until(lambda: "p0" in p_work.sender._waiting)  # type: ignore[union-attr]
        receiver = d_work.receiver

        token = receiver._pending["d0"].token  # d0's prefill tags its messages with it (issue 37: spoofed arrivals)

        def arrive(message: bytes) -> None:
            tagged = with_token(token, message)
            receiver._on_arrival(SimpleNamespace(notification=SimpleNamespace(message=tagged)))  # type: ignore[arg-type]

        arrive(failure_notice_for("d0", 1, "not a sender of d0: equal TP sizes have one, unranked"))
        arrive(failure_notice_for("d1", None, "not a request of this decode"))
        assert d_work.get_finished() == (None, None) and receiver.pending == 1
        arrive(failure_notice_for("d0", None, "the write failed: boom"))
        assert d_work.get_finished() == (None, {"d0"}) and d_work.load_errors() == {5, 6}
        assert receiver.failures == {"d0": "the prefill failed writing its blocks: the write failed: boom"}
    finally:
        p_work.shutdown()
        d_work.shutdown()
