"""kvwire.compat.sglang: sglang's send_kvcache call shape through a kvwire Connection."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import kvwire
from kvwire import KVBuffer, KVLayout, LayoutError
from kvwire.compat.sglang import SglangSender, layout_from_kv_args, status_of

Pair = tuple[SglangSender, kvwire.Connection, np.ndarray, np.ndarray]


@pytest.fixture
def pair() -> Pair:
    rng = np.random.default_rng(0)
    src = rng.integers(0, 256, (2, 16, 128), dtype=np.uint8)  # K and V of one layer, 16 pages of 128 B
    dst = rng.integers(0, 256, (2, 32, 128), dtype=np.uint8)
    sender = kvwire.connect("local")
    receiver = kvwire.connect("local")
    local = layout_from_kv_args(
        [int(src[0].ctypes.data), int(src[1].ctypes.data)], [16 * 128] * 2, [128] * 2, [0], attention="mha",
        memory="host", attn_tp_size=1,
    )
    peer = layout_from_kv_args(
        [int(dst[0].ctypes.data), int(dst[1].ctypes.data)], [32 * 128] * 2, [128] * 2, [0], attention="mha",
        memory="host", attn_tp_size=2,
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
    with caplog.at_level(logging.ERROR, logger="kvwire.compat.sglang"):
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
    layout = layout_from_kv_args([4096, 8192, 12288, 16384], [4096] * 4, [256] * 4, [3, 4], attention="mha")
    assert layout.buffers == (
        KVBuffer(4096, 256, 16, 3, "k", "device"),
        KVBuffer(8192, 256, 16, 4, "k", "device"),
        KVBuffer(12288, 256, 16, 3, "v", "device"),
        KVBuffer(16384, 256, 16, 4, "v", "device"),
    )
    mla = layout_from_kv_args([4096], [1152 * 8], [1152], attention="mla", memory="host", attn_tp_size=4)
    assert mla == KVLayout((KVBuffer(4096, 1152, 8, 0, "kv", "host"),), 4)
    with pytest.raises(LayoutError, match=r"^kv_data_lens\[0\] = 4000 is not a multiple of kv_item_lens\[0\] = 256$"):
        layout_from_kv_args([4096, 8192], [4000, 4096], [256, 256], attention="mha")
    with pytest.raises(LayoutError, match=r"MHA layout has a K and a V buffer per layer: got 3 buffers"):
        layout_from_kv_args([1, 2, 3], [256] * 3, [256] * 3, attention="mha")
