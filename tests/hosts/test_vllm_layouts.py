"""The KV layouts vLLM hands kvwire's connector, without vLLM: head-major, token-major, MLA's latent, split blocks.

The tensors are made the way vLLM 0.33.0's ``allocate_kv_cache`` makes them (one int8 buffer, one
``[num_blocks, num_kv_heads, block_size, C]`` view per layer at the layer stride, the strides of the resolved
``KVCacheLayout``: ``compute_layout_strides``), written here independently of kvwire. vLLM's own resolution
and allocation run in ``test_vllm_connector.py`` (slow, in ``.venv-vllm``). Two engines' worker and scheduler
sides move blocks in one process through the ``local`` backend, and every byte is compared.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from ports import free_port_run

from kvwire import LayoutError, PeerDescription
from kvwire.hosts.vllm import ConnectorSettings, layout_from_kv_caches
from kvwire.hosts.vllm.layout import LBNHC_ACROSS_TP
from kvwire.hosts.vllm.metadata import ReadyToSend
from kvwire.hosts.vllm.rank import WorkerRank
from kvwire.hosts.vllm.registration import Registration
from kvwire.hosts.vllm.scheduler import SchedulerSide
from kvwire.hosts.vllm.sending import Sender
from kvwire.hosts.vllm.settings import EngineSide
from kvwire.hosts.vllm.worker import WorkerSide

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
# vLLM's KVCacheLayout members as the physical order of a layer view's [B, H, N, C]
ORDERS = {"LBHNC": (0, 1, 2, 3), "LBNHC": (0, 2, 1, 3), "LHBNC": (1, 0, 2, 3)}


def kv_caches(
    layout: str, heads: int = 2, blocks: int = 8, tokens: int = 32, dims: int = 128, split: int = 1
) -> dict[str, torch.Tensor]:
    """fp16 views of one zeroed int8 buffer, as vLLM allocates them; ``split`` kernel blocks per block."""
    shape = (blocks * split, heads, tokens // split, dims)
    strides = [0] * 4
    step = 1
    for dim in reversed(ORDERS[layout]):
        strides[dim] = step
        step *= shape[dim]
    raw = torch.zeros(len(LAYERS) * step * 2, dtype=torch.int8)
    return {
        name: torch.as_strided(raw.view(torch.float16), shape, tuple(strides), i * step)
        for i, name in enumerate(LAYERS)
    }


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal (random fp16 bits hold NaNs, which torch.equal calls unequal)."""
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


def randomize(caches: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in caches.values():
        t.view(torch.int16).copy_(torch.randint(-30000, 30000, t.shape, dtype=torch.int16, generator=gen))


def test_token_major_blocks_are_whole_pages_between_equal_tp_sizes_only() -> None:
    caches = kv_caches("LBNHC")
    t = caches[LAYERS[0]]
    assert t.stride() == (8192, 128, 256, 1)  # vLLM's LBNHC view of [8, 2, 32, 128] (TRANSPORT-FACTS)
    mapped = layout_from_kv_caches(caches, 2, 1, 4)
    first = t.data_ptr()
    assert [(b.base - first, b.page_bytes, b.num_pages) for b in mapped.layout.buffers] == [
        (0, 16384, 8),
        (131072, 16384, 8),
    ]
    assert (mapped.order, mapped.tp_refusal) == ("token-major", LBNHC_ACROSS_TP)
    assert (mapped.layout.attn_tp_size, mapped.layout.attn_tp_rank, mapped.layout.heads) == (None, None, None)
    head_major = layout_from_kv_caches(kv_caches("LBHNC"), 2, 1, 4)
    assert (head_major.order, head_major.tp_refusal, head_major.layout.attn_tp_rank) == ("head-major", None, 1)


def test_a_layout_with_heads_outside_the_blocks_is_refused_naming_layer_shape_and_strides() -> None:
    caches = kv_caches("LHBNC")
    with pytest.raises(LayoutError) as info:
        layout_from_kv_caches(caches)
    assert str(info.value) == (
        f"layer '{LAYERS[0]}' (shape [8, 2, 32, 128], stride [4096, 32768, 128, 1]): a block is not one "
        "contiguous run: the strides of its [heads, tokens, dims] are [32768, 128, 1], and one run has "
        "[4096, 128, 1] (head-major, vLLM's LBHNC) or [128, 256, 1] (token-major, LBNHC); kvwire moves a block "
        "as one page, so a layout that puts the heads outside the blocks (LHBNC) is not supported: use LBHNC, "
        "which KvwireConnector asks vLLM for"
    )


def test_an_mla_latent_cache_is_one_page_per_block_and_records_its_tp_rank() -> None:
    latent = kv_caches("LBNHC", heads=1, tokens=64, dims=40)  # vLLM 0.33.0's MLA view: [B, 1, N, latent]
    mapped = layout_from_kv_caches(latent, 4, 3, 128, mla=True)  # MLA models report their attention heads
    assert (mapped.order, mapped.tp_refusal, mapped.block_bytes) == ("latent", None, 5120)
    assert (mapped.layout.attention, mapped.layout.attn_tp_size, mapped.layout.attn_tp_rank) == ("mla", 4, 3)
    three_d = {name: t[:, 0] for name, t in latent.items()}  # [num_blocks, block_size, latent]
    assert layout_from_kv_caches(three_d).order == "latent"
    with pytest.raises(LayoutError) as info:
        layout_from_kv_caches(kv_caches("LBHNC"), mla=True)
    assert str(info.value).endswith(
        "an MLA latent cache holds one latent vector per token (num_kv_heads 1), this one 2 heads; kvwire moves "
        "MLA's latent cache only"
    )


def test_blocks_split_into_kernel_blocks_move_as_one_page_and_head_major_ones_not_across_tp() -> None:
    split = kv_caches("LBHNC", heads=4, split=4)  # 8 blocks of 32 tokens as 32 kernel blocks of 8
    mapped = layout_from_kv_caches(split, 2, 0, 8, num_blocks=8)
    assert (mapped.num_blocks, mapped.block_bytes) == (8, 32768)
    assert mapped.layout.buffers[0].base == split[LAYERS[0]].data_ptr() and mapped.layout.heads is None
    assert mapped.tp_refusal is not None and mapped.tp_refusal.startswith(
        "vLLM splits each of its blocks into 4 kernel blocks (the attention backend's kernel block size is "
    )
    latent = layout_from_kv_caches(kv_caches("LBNHC", heads=1, split=4), 2, 0, mla=True, num_blocks=8)
    assert (latent.num_blocks, latent.block_bytes, latent.tp_refusal) == (8, 8192, None)
    with pytest.raises(LayoutError, match=r"32 blocks in the tensor, but vLLM's KV cache has 6 "):
        layout_from_kv_caches(split, num_blocks=6)


# -- two engines in one process (local backend) ------------------------------------------------------------------


def _request(req_id: str, n: int, params: dict[str, Any] | None, status: str = "RUNNING") -> Any:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(n)),
        kv_transfer_params=params,
        status=SimpleNamespace(name=status),
        num_computed_tokens=n,
    )


def _until(fn: Any, timeout_s: float = 10.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while not (got := fn()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)
    return got


class Engines:
    """A prefill of TP size ``p_tp`` and a decode of ``d_tp``, each rank with its own caches and worker side."""

    def __init__(self, p_caches: list[dict[str, torch.Tensor]], d_caches: list[dict[str, torch.Tensor]], **kw: Any):
        self.settings = ConnectorSettings.from_extra_config(
            {"backend": "local", "side_channel_port": free_port_run(8), "lease_s": 60}
        )
        self.p_caches, self.d_caches = p_caches, d_caches
        p_tp, d_tp = len(p_caches), len(d_caches)
        self.p_engine = EngineSide(self.settings, p_tp, producer=True, consumer=False, **kw)
        self.d_engine = EngineSide(self.settings, d_tp, producer=False, consumer=True, **kw)
        self.p_work = [WorkerSide(self.p_engine, r) for r in range(p_tp)]
        self.d_work = [WorkerSide(self.d_engine, r) for r in range(d_tp)]

    def __enter__(self) -> Engines:
        for work, caches in [*zip(self.p_work, self.p_caches), *zip(self.d_work, self.d_caches)]:
            work.register_kv_caches(caches)
        return self

    def __exit__(self, *exc: object) -> None:
        for work in [*self.p_work, *self.d_work]:
            work.shutdown()

    def move(self, prefill_blocks: list[int], decode_blocks: list[int]) -> None:
        """p0 finishes on the prefill holding ``prefill_blocks``; d0 takes them into ``decode_blocks``."""
        p_sched = SchedulerSide(self.p_engine, "engine-p")
        d_sched = SchedulerSide(self.d_engine, "engine-d")
        n = 32 * len(prefill_blocks) - 5
        _, params = p_sched.request_finished(
            _request("p0", n, {"do_remote_decode": True}, "FINISHED_STOPPED"), prefill_blocks
        )
        assert params is not None
        p_meta = p_sched.build_connector_meta(None)
        for work in self.p_work:
            work.start(p_meta)
        decode = _request("d0", n, dict(params))
        assert d_sched.get_num_new_matched_tokens(decode, 0) == (n, True)
        d_sched.update_state_after_alloc(decode, SimpleNamespace(get_unhashed_block_ids=lambda: decode_blocks), n)
        d_meta = d_sched.build_connector_meta(None)
        for work in self.d_work:
            work.start(d_meta)

    def received(self, rank: int) -> tuple[set[str], set[int], dict[str, str]]:
        work = self.d_work[rank]
        got = _until(lambda: work.get_finished()[1])
        assert work.receiver is not None
        return got, work.load_errors(), dict(work.receiver.failures)


def test_token_major_blocks_move_whole_between_equal_tp_sizes() -> None:
    p_caches, d_caches = kv_caches("LBNHC"), kv_caches("LBNHC")
    randomize(p_caches, 1)
    with Engines([p_caches], [d_caches], total_kv_heads=2) as engines:
        engines.move([1, 2, 3], [6, 4, 5])
        assert engines.received(0) == ({"d0"}, set(), {})
    for name in LAYERS:
        assert same(d_caches[name][[6, 4, 5]], p_caches[name][[1, 2, 3]])
        assert not d_caches[name][[0, 1, 2, 3, 7]].view(torch.int16).any()  # nothing else written


@pytest.mark.parametrize(("p_tp", "d_tp"), [(1, 2), (2, 1), (2, 4), (4, 2)])
def test_an_mla_latent_moves_across_tp_sizes_each_decode_rank_from_one_prefill_rank(p_tp: int, d_tp: int) -> None:
    p_caches = [kv_caches("LBNHC", heads=1, tokens=64, dims=40) for _ in range(p_tp)]
    d_caches = [kv_caches("LBNHC", heads=1, tokens=64, dims=40) for _ in range(d_tp)]
    for r, caches in enumerate(p_caches):
        randomize(caches, 10 + r)  # replicas differ here, so the bytes say which prefill rank wrote them
    with Engines(p_caches, d_caches, total_kv_heads=4, mla=True) as engines:
        engines.move([1, 2], [5, 3])
        for d in range(d_tp):
            assert engines.received(d) == ({"d0"}, set(), {})
    for d, caches in enumerate(d_caches):
        writer = d * p_tp // d_tp  # vLLM's NIXL connector and sglang: the first of the decode rank's senders
        for name in LAYERS:
            assert same(caches[name][[5, 3]], p_caches[writer][name][[1, 2]]), (d, name)
            assert not caches[name][[0, 1, 2, 4, 6, 7]].view(torch.int16).any()


def test_blocks_split_into_kernel_blocks_move_whole() -> None:
    p_caches, d_caches = kv_caches("LBNHC", heads=1, split=4), kv_caches("LBNHC", heads=1, split=4)
    randomize(p_caches, 3)
    engines = Engines([p_caches], [d_caches], mla=True)
    for work in [*engines.p_work, *engines.d_work]:
        work.num_blocks = 8  # vLLM's kv_cache_config.num_blocks: 8 blocks, 32 kernel blocks in the tensor
    with engines:
        engines.move([1, 2], [7, 3])
        assert engines.received(0) == ({"d0"}, set(), {})
    for name in LAYERS:
        for p_block, d_block in ((1, 7), (2, 3)):
            want = p_caches[name][4 * p_block : 4 * p_block + 4]
            assert same(d_caches[name][4 * d_block : 4 * d_block + 4], want)


def test_a_token_major_decode_refuses_a_prefill_of_another_tp_size_before_registering() -> None:
    with Engines([kv_caches("LBHNC", heads=1) for _ in range(2)], [kv_caches("LBNHC")], total_kv_heads=2) as engines:
        engines.move([1, 2], [5, 6])
        got, errors, failures = engines.received(0)
    assert (got, errors) == ({"d0"}, {5, 6})
    assert failures == {
        "d0": "refused before anything moved: request 'd0': the prefill runs TP size 2, this decode 1, and this "
        f"decode's KV cache cannot move across TP sizes: {LBNHC_ACROSS_TP}"
    }


def _sender(caches: dict[str, torch.Tensor], tp: int, rank: int, total: int) -> Sender:
    mapped = layout_from_kv_caches(caches, tp, rank, total)
    connection = SimpleNamespace(config=SimpleNamespace(timeout_s=10.0))
    return Sender(WorkerRank(connection, mapped, rank, tp), lease_s=30)  # type: ignore[arg-type]


def _registration(caches: dict[str, torch.Tensor], tp: int, rank: int, total: int) -> dict[str, Any]:
    mapped = layout_from_kv_caches(caches, tp, rank, total)
    peer = PeerDescription("ep", mapped.layout)
    return Registration("p0", "d0", (1, 2), (3, 4), tuple(LAYERS), rank, tp, 30.0, peer, mapped.order).to_dict()


def test_a_prefill_refuses_blocks_of_another_order_or_token_major_ones_across_tp_sizes() -> None:
    start = "registration for 'p0': the decode"
    head_major, token_major = kv_caches("LBHNC"), kv_caches("LBNHC")
    assert _sender(head_major, 1, 0, 2).handle(_registration(token_major, 1, 0, 2)) == {
        "error": f"{start}'s blocks are token-major (LBNHC), this prefill's head-major (LBHNC): a whole block "
        "would land with its bytes in another order; run both sides with the same KV-cache layout and attention "
        "kind (nothing was sent)"
    }
    assert _sender(token_major, 1, 0, 2).handle(_registration(token_major, 2, 0, 2)) == {
        "error": f"{start} is TP rank 0 of 2, this prefill worker rank 0 of 1: this prefill's KV cache cannot "
        f"move across TP sizes: {LBNHC_ACROSS_TP}"
    }
    old = _registration(head_major, 1, 0, 2)
    del old["block_order"]  # an earlier decode: head-major blocks, the only ones it had
    assert _sender(head_major, 1, 0, 2).handle(old) == {"queued": "p0"}


def test_a_ready_request_is_not_written_to_a_decode_whose_blocks_differ_in_order() -> None:
    """The order is checked before the prefill's blocks are looked up: nothing is submitted."""
    sender = _sender(kv_caches("LBHNC"), 1, 0, 2)
    sender.mark_ready(ReadyToSend("p0", (1, 2)))
    reply = sender.handle(_registration(kv_caches("LBNHC"), 1, 0, 2))
    assert reply["error"].startswith("registration for 'p0': the decode's blocks are token-major (LBNHC)")
    assert sender.finished() == set() and list(sender.failures) == [reply["error"]]


def test_a_registrations_block_order_is_one_kvwire_knows() -> None:
    from kvwire import InvalidTransferError

    registration = _registration(kv_caches("LBNHC"), 1, 0, 2)
    assert Registration.from_dict(registration).block_order == "token-major"
    for bad in ("diagonal", 3, None):
        with pytest.raises(InvalidTransferError) as info:
            Registration.from_dict({**registration, "block_order": bad})
        assert str(info.value) == (
            f"registration: 'block_order' must be one of ['head-major', 'latent', 'token-major'], got {bad!r}"
        )


def test_an_mla_decode_takes_a_prefill_of_any_tp_size_that_divides_whatever_the_heads() -> None:
    settings = ConnectorSettings.from_extra_config({"backend": "local"})
    params = {"do_remote_prefill": True, "kvwire": 1, "remote_request_id": "p0", "remote_engine_id": "e"}
    params |= {"remote_host": "127.0.0.1", "remote_port": 5710, "remote_block_ids": [1, 2], "tp_size": 4}
    params |= {"remote_num_tokens": 40}
    for mla, want in ((True, (40, True)), (False, (0, False))):  # 6 heads do not split over 4 ranks: MHA only
        engine = EngineSide(settings, 2, producer=False, consumer=True, total_kv_heads=6, mla=mla)
        assert SchedulerSide(engine, "engine-d").get_num_new_matched_tokens(_request("d0", 40, dict(params)), 0) == want
