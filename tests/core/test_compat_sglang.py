"""kvwire_sglang: sglang's send_kvcache call shape through a kvwire Connection."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
import pytest

import kvwire
from kvwire import KVBuffer, KVLayout, LayoutError
from kvwire_sglang import (
    KvwireManagerMixin,
    SglangSender,
    layer_ids_from_sglang,
    layout_from_kv_args,
    status_of,
)
from kvwire_sglang.manager import heads_of_kv_args

Pair = tuple[SglangSender, kvwire.Connection, np.ndarray, np.ndarray]


@pytest.fixture
def pair() -> Pair:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (2, 16, 128), dtype=np.uint8)  # K and V of one layer, 16 pages of 128 B
    dst = rng.integers(0, 256, (2, 32, 128), dtype=np.uint8)
    sender = kvwire.connect("local")
    receiver = kvwire.connect("local")
    local = layout_from_kv_args(
        [int(src[0].ctypes.data), int(src[1].ctypes.data)],
        [16 * 128] * 2,
        [128] * 2,
        [0],
        attention="mha",
        memory="host",
        attn_tp_size=1,
    )
    peer = layout_from_kv_args(
        [int(dst[0].ctypes.data), int(dst[1].ctypes.data)],
        [32 * 128] * 2,
        [128] * 2,
        [0],
        attention="mha",
        memory="host",
        attn_tp_size=2,
    )
    sender.register_kv_buffers(local)
    receiver.register_kv_buffers(peer)
    sender.add_peer(receiver.endpoint(), peer)
    return SglangSender(sender), receiver, src, dst


def test_sglang_call_shape_moves_bytes_and_returns_zero(pair: Pair) -> None:
    adapter, receiver, src, dst = pair
    before = dst.copy()
    ptrs = [int(dst[0].ctypes.data), int(dst[1].ctypes.data)]
    ret = adapter.send_kvcache(
        receiver.endpoint(),
        np.array([1, 2, 7], np.int32),
        ptrs,
        np.array([10, 11, 30], np.int32),
        None,  # type: ignore[arg-type]
        dst_layer_ids=[0],
        dst_device_kv_indices=None,
        dst_kv_item_len=128,
        dst_attn_tp_size=2,
    )
    assert ret == 0
    assert (dst[:, [10, 11, 30]] == src[:, [1, 2, 7]]).all()
    untouched = [p for p in range(32) if p not in (10, 11, 30)]
    assert (dst[:, untouched] == before[:, untouched]).all()


@pytest.mark.parametrize(
    ("kwargs", "status", "message"),
    [
        ({"dst_kv_item_len": 64}, -22, "dst_kv_item_len = 64, but the peer's layout says its target"),
        ({"dst_attn_tp_size": 4}, -22, "dst_attn_tp_size = 4, but the peer's layout records attention TP size 2"),
        ({"dst_layer_ids": [5]}, -22, "dst_layer_ids[0] = 5 is not a layer of the peer layout"),
    ],
)
def test_a_refused_send_returns_a_status_logs_it_and_moves_nothing(
    pair: Pair,
    caplog: pytest.LogCaptureFixture,
    kwargs: dict[str, object],
    status: int,
    message: str,
) -> None:
    adapter, receiver, _, dst = pair
    before = dst.copy()
    ptrs = [int(dst[0].ctypes.data), int(dst[1].ctypes.data)]
    idx = np.array([1], np.int32)
    with caplog.at_level(logging.ERROR, logger="kvwire.sglang"):
        ret = adapter.send_kvcache(receiver.endpoint(), idx, ptrs, idx, None, **kwargs)  # type: ignore[arg-type]
    assert ret == status
    (record,) = caplog.records
    assert f"kvwire send_kvcache to session {receiver.endpoint()} failed (status {status}" in record.getMessage()
    assert "InvalidTransferError: " + message in record.getMessage()
    assert (dst == before).all()


def test_status_codes_are_never_zero() -> None:
    assert status_of(kvwire.PeerUnreachableError("x")) == -102
    assert status_of(kvwire.TransferTimeoutError("x")) == -110
    assert status_of(kvwire.TransferError("x")) == -1
    assert status_of(kvwire.BackendError("x")) == -1


def test_layout_from_kv_args_follows_sglangs_buffer_order() -> None:
    layout = layout_from_kv_args(
        [4096, 8192, 12288, 16384], [4096] * 4, [256] * 4, [3, 4], attention="mha", memory="device"
    )
    assert layout.buffers == (
        KVBuffer(4096, 256, 16, 3, "k", "device"),
        KVBuffer(8192, 256, 16, 4, "k", "device"),
        KVBuffer(12288, 256, 16, 3, "v", "device"),
        KVBuffer(16384, 256, 16, 4, "v", "device"),
    )
    mla = layout_from_kv_args([4096], [1152 * 8], [1152], attention="mla", memory="host", attn_tp_size=4)
    assert mla == KVLayout((KVBuffer(4096, 1152, 8, 0, "kv", "host"),), 4)
    with pytest.raises(LayoutError, match=r"^kv_data_lens\[0\] = 4000 is not a multiple of kv_item_lens\[0\] = 256$"):
        layout_from_kv_args([4096, 8192], [4000, 4096], [256, 256], attention="mha", memory="host")
    with pytest.raises(LayoutError, match=r"MHA layout has a K and a V buffer per layer: got 3 buffers"):
        layout_from_kv_args([1, 2, 3], [256] * 3, [256] * 3, attention="mha", memory="host")


# -- pool shapes as sglang 0.5.23 builds them (disaggregation/utils.py::build_kv_layer_ids) ----------


def _pools(attention: str, layers: int, pages: int, seed: int) -> np.ndarray:
    buffers = 2 * layers if attention == "mha" else layers
    return np.random.default_rng(seed).integers(0, 256, (buffers, pages, 64), dtype=np.uint8)


def _ptrs(pools: np.ndarray) -> list[int]:
    return [int(pools[i].ctypes.data) for i in range(pools.shape[0])]


@pytest.mark.parametrize(
    ("attention", "kv_layer_ids"),
    [
        ("mha", []),  # every plain pool: sglang sends [] (positional)
        ("mla", []),
        ("mha", [7, 9, 7, 9]),  # hybrid MHA: layer_ids * 2, one id per K entry then per V entry
        ("mla", [7, 9]),  # hybrid MLA: layer_ids
    ],
    ids=["plain-mha", "plain-mla", "hybrid-mha", "hybrid-mla"],
)
def test_every_pool_shape_sglang_builds_moves_exact_bytes_with_its_own_layer_ids(
    attention: str, kv_layer_ids: list[int]
) -> None:
    src, dst = _pools(attention, 2, 8, 1), _pools(attention, 2, 16, 2)
    before = dst.copy()
    kind = "mha" if attention == "mha" else "mla"
    local = layout_from_kv_args(
        _ptrs(src),
        [8 * 64] * len(src),
        [64] * len(src),
        kv_layer_ids,
        attention=kind,
        memory="host",  # type: ignore[arg-type]
    )
    peer = layout_from_kv_args(
        _ptrs(dst),
        [16 * 64] * len(dst),
        [64] * len(dst),
        kv_layer_ids,
        attention=kind,
        memory="host",  # type: ignore[arg-type]
    )
    expected_ids = [0, 1] if not kv_layer_ids else [7, 9]
    assert [b.layer for b in local.buffers] == expected_ids * (2 if attention == "mha" else 1)
    assert {b.memory for b in local.buffers} == {"host"}
    sender, receiver = kvwire.connect("local"), kvwire.connect("local")
    sender.register_kv_buffers(local)
    receiver.register_kv_buffers(peer)
    sender.add_peer(receiver.endpoint(), peer)
    ret = SglangSender(sender).send_kvcache(
        receiver.endpoint(),
        np.array([0, 3, 5], np.int32),
        _ptrs(dst),
        np.array([15, 2, 9], np.int32),
        None,  # type: ignore[arg-type]
        dst_layer_ids=list(kv_layer_ids),  # what transfer_worker passes: the decode's registered list
        dst_kv_item_len=64,
    )
    assert ret == 0
    assert (dst[:, [15, 2, 9]] == src[:, [0, 3, 5]]).all()
    untouched = [p for p in range(16) if p not in (15, 2, 9)]
    assert (dst[:, untouched] == before[:, untouched]).all()


def test_layer_ids_from_sglang_reads_each_form_and_refuses_disagreeing_halves() -> None:
    assert layer_ids_from_sglang(None) is None
    assert layer_ids_from_sglang([]) is None
    assert layer_ids_from_sglang([7, 9, 7, 9]) == [7, 9]
    assert layer_ids_from_sglang([7, 9]) == [7, 9]
    assert layer_ids_from_sglang([5, 5]) == [5]  # one layer, K and V
    with pytest.raises(kvwire.InvalidTransferError) as exc:
        layer_ids_from_sglang([7, 9, 9, 7])
    assert str(exc.value) == (
        "dst_layer_ids = [7, 9, 9, 7] repeats layer ids but is not one id per K entry then one per V entry "
        "(sglang's layer_ids * 2): the K and V halves differ"
    )


def test_disagreeing_halves_of_dst_layer_ids_are_refused_with_a_status_and_nothing_moves(pair: Pair) -> None:
    adapter, receiver, _, dst = pair
    before = dst.copy()
    idx = np.array([1], np.int32)
    ptrs = [int(dst[0].ctypes.data), int(dst[1].ctypes.data)]
    ret = adapter.send_kvcache(receiver.endpoint(), idx, ptrs, idx, None, dst_layer_ids=[0, 1, 1, 0])  # type: ignore[arg-type]
    assert ret == -22
    assert (dst == before).all()


def test_layout_from_kv_args_names_a_bad_item_length_and_a_bad_layer_id_count() -> None:
    with pytest.raises(LayoutError) as exc:
        layout_from_kv_args([4096, 8192], [4096, 4096], [0, 256], attention="mha", memory="host")
    assert str(exc.value) == "kv_item_lens[0] = 0 must be positive (bytes per page)"
    with pytest.raises(LayoutError) as exc:
        layout_from_kv_args(
            [4096, 8192, 12288, 16384], [4096] * 4, [256] * 4, [1, 2, 3], attention="mha", memory="host"
        )
    assert str(exc.value) == (
        "kv_layer_ids has 3 entries; expected none (sglang's [] for positional layers), 2 (one per layer) "
        "or 4 (one per buffer)"
    )
    with pytest.raises(LayoutError) as exc:
        layout_from_kv_args([4096, 8192, 12288, 16384], [4096] * 4, [256] * 4, [5], attention="mha", memory="host")
    assert str(exc.value).startswith("kv_layer_ids has 1 entries; expected none")
    with pytest.raises(TypeError, match="memory"):
        layout_from_kv_args([4096], [4096], [256], attention="mla")  # type: ignore[call-arg]


# -- sglang's MHA path across attention-TP sizes (send_kvcache_slice) through kvwire's head slicing ----


class _Manager(KvwireManagerMixin):
    """The mixin's send paths on their own (sglang's manager is not needed for them)."""

    def __init__(self, connection: kvwire.Connection) -> None:
        self.kvwire_connection = connection


def _heads_args(pools: np.ndarray, kv_heads: int, total: int) -> SimpleNamespace:
    return SimpleNamespace(page_size=4, kv_head_num=kv_heads, total_kv_head_num=total, kv_item_lens=[pools.shape[2]])


def _tp_layout(pools: np.ndarray, kv_heads: int, tp: int, rank: int) -> KVLayout:
    """One MHA layer (K and V host pools) of attention-TP rank ``rank`` of ``tp``, holding ``kv_heads`` of 2 heads."""
    return layout_from_kv_args(
        _ptrs(pools),
        [pools[0].nbytes] * 2,
        [pools.shape[2]] * 2,
        [],
        attention="mha",
        memory="host",
        attn_tp_size=tp,
        attn_tp_rank=rank,
        heads=heads_of_kv_args(_heads_args(pools, kv_heads, 2)),
    )


def test_send_kvcache_slice_moves_each_decode_ranks_heads_token_by_token() -> None:
    """Prefill TP 1 holds heads 0 and 1; decode TP 2 rank r holds head r. Pages of 4 tokens x heads x 16 bytes."""
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, (2, 8, 4 * 2 * 16), dtype=np.uint8)  # K and V of one layer
    dsts = [rng.integers(0, 256, (2, 8, 4 * 1 * 16), dtype=np.uint8) for _ in range(2)]
    before = [d.copy() for d in dsts]
    local = _tp_layout(src, 2, 1, 0)
    sender = kvwire.connect("local")
    sender.register_kv_buffers(local)
    manager, receivers = _Manager(sender), []
    for rank, dst in enumerate(dsts):
        peer = _tp_layout(dst, 1, 2, rank)
        receiver = kvwire.connect("local")
        receiver.register_kv_buffers(peer)
        sender.add_peer(receiver.endpoint(), peer)
        receivers.append(receiver)
        ret = manager.send_kvcache_slice(
            receiver.endpoint(),
            np.array([1, 6], np.int32),
            _ptrs(dst),
            np.array([7, 0], np.int32),
            rank,
            2,
            dst.shape[2],
            None,
            [],  # type: ignore[arg-type]
        )
        assert ret == 0
    for rank, dst in enumerate(dsts):
        for s, d in ((1, 7), (6, 0)):
            for t in range(4):  # token t, the one head of this rank: the prefill's head `rank` of token t
                src_bytes = src[:, s, (t * 2 + rank) * 16 : (t * 2 + rank + 1) * 16]
                assert (dst[:, d, t * 16 : (t + 1) * 16] == src_bytes).all()
        untouched = [p for p in range(8) if p not in (7, 0)]
        assert (dst[:, untouched] == before[rank][:, untouched]).all()


def test_send_kvcache_slice_to_a_rank_the_decode_did_not_publish_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    src = np.zeros((2, 8, 128), np.uint8)
    dst = np.ones((2, 8, 64), np.uint8)
    sender, receiver = kvwire.connect("local"), kvwire.connect("local")
    sender.register_kv_buffers(_tp_layout(src, 2, 1, 0))
    peer = _tp_layout(dst, 1, 2, 1)
    receiver.register_kv_buffers(peer)
    sender.add_peer(receiver.endpoint(), peer)
    with caplog.at_level(logging.ERROR, logger="kvwire.sglang"):
        ret = _Manager(sender).send_kvcache_slice(
            receiver.endpoint(),
            np.array([1], np.int32),
            _ptrs(dst),
            np.array([1], np.int32),
            0,
            2,
            64,
            None,  # type: ignore[arg-type]
        )
    assert ret == -22
    assert "dst_tp_rank = 0, but the decode published attention-TP rank 1" in caplog.text
    with caplog.at_level(logging.ERROR, logger="kvwire.sglang"):  # sglang's view of the decode's TP size
        ret = _Manager(sender).send_kvcache_slice(
            receiver.endpoint(),
            np.array([1], np.int32),
            _ptrs(dst),
            np.array([1], np.int32),
            1,
            4,
            64,
            None,  # type: ignore[arg-type]
        )
    assert ret == -22
    assert "dst_attn_tp_size = 4, but the peer's layout records attention TP size 2" in caplog.text
    assert (dst == 1).all()


def test_a_pipeline_stage_numbers_its_layers_from_its_first_so_they_land_on_the_decodes_same_layers() -> None:
    """sglang's plain pools send kv_layer_ids []; stage 1 of PP 2 holds layers 2 and 3 (prefill_start_layer 2)."""
    src, dst = _pools("mha", 2, 8, 3), _pools("mha", 4, 16, 4)  # prefill stage: 2 layers; decode (PP 1): 4
    before = dst.copy()
    stage = layout_from_kv_args(_ptrs(src), [8 * 64] * 4, [64] * 4, [], attention="mha", memory="host", first_layer=2)
    decode = layout_from_kv_args(_ptrs(dst), [16 * 64] * 8, [64] * 8, [], attention="mha", memory="host")
    assert [b.layer for b in stage.buffers] == [2, 3, 2, 3]
    sender, receiver = kvwire.connect("local"), kvwire.connect("local")
    sender.register_kv_buffers(stage)
    receiver.register_kv_buffers(decode)
    sender.add_peer(receiver.endpoint(), decode)
    ids = np.array([1, 5], np.int32)
    ret = SglangSender(sender).send_kvcache(receiver.endpoint(), ids, _ptrs(dst), ids, None, dst_layer_ids=[])  # type: ignore[arg-type]
    assert ret == 0
    k2, k3, v2, v3 = 2, 3, 6, 7  # decode buffers: K0..K3 then V0..V3
    for stage_buffer, decode_buffer in zip(range(4), (k2, k3, v2, v3)):
        assert (dst[decode_buffer, [1, 5]] == src[stage_buffer, [1, 5]]).all()
    untouched = [b for b in range(8) if b not in (k2, k3, v2, v3)]
    assert (dst[untouched] == before[untouched]).all()


# -- sglang's blacklist: a refusal of the caller's input is not a dead peer ---------------------------------------


def test_a_refused_send_leaves_the_session_out_of_sglangs_blacklist_and_a_failed_one_puts_it_in(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    """sglang adds the session to failed_sessions after any non-zero status; kvwire's set keeps a refusal out."""
    import threading

    from kvwire_sglang.send import FailedSessions

    adapter, receiver, _, dst = pair
    session, ptrs = receiver.endpoint(), [int(dst[0].ctypes.data), int(dst[1].ctypes.data)]
    blacklist = FailedSessions()
    bad = np.array([40], np.int32)  # past the decode's 32 pages: refused before any byte moves
    assert adapter.send_kvcache(session, bad[:1] * 0, ptrs, bad, None) == -22  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="kvwire.sglang"):
        blacklist.add(session)  # what sglang's transfer_worker does next, on the same thread
    assert session not in blacklist
    assert caplog.records[-1].getMessage() == (
        f"kvwire: decode session {session} stays in service: kvwire refused the send for its input (status -22); "
        "only that request fails"
    )
    blacklist.add(session)  # no refusal noted any more: sglang's own reasons still blacklist
    assert session in blacklist
    blacklist.discard(session)
    receiver.close()  # a dead peer: the send fails (not a refusal) and the session is blacklisted
    idx = np.array([1], np.int32)
    assert adapter.send_kvcache(session, idx, ptrs, idx, None) not in (0, -22)  # type: ignore[arg-type]
    blacklist.add(session)
    assert session in blacklist
    # the note is per transfer thread: a refusal on one thread does not spare a failure on another
    blacklist.discard(session)
    assert adapter.send_kvcache(session, bad[:1] * 0, ptrs, bad, None) == -22  # type: ignore[arg-type]
    other = threading.Thread(target=blacklist.add, args=(session,))
    other.start()
    other.join()
    assert session in blacklist


def test_the_manager_keeps_sglangs_failed_sessions_as_a_refusal_aware_set() -> None:
    from kvwire_sglang.send import FailedSessions

    class Manager(KvwireManagerMixin):
        def __init__(self) -> None:
            self.failed_sessions = {"old"}  # as sglang's constructor assigns it

    manager = Manager()
    assert type(manager.failed_sessions) is FailedSessions and manager.failed_sessions == {"old"}
