"""KVLayout: construction from arrays and tensors, the wire format, and malformed input."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import kvwire
from kvwire import KVBuffer, KVLayout, LayoutError
from kvwire.layout.buffers import HeadLayout


def test_mha_from_numpy_orders_k_then_v() -> None:
    k = [np.zeros((4, 2, 8), np.float16) for _ in range(2)]
    v = [np.zeros((4, 2, 8), np.float16) for _ in range(2)]
    layout = KVLayout.mha(k, v, layers=[5, 6])
    assert [(b.layer, b.role) for b in layout.buffers] == [(5, "k"), (6, "k"), (5, "v"), (6, "v")]
    assert layout.buffers[0].base == k[0].ctypes.data
    assert layout.buffers[0].page_bytes == 2 * 8 * 2
    assert layout.attention == "mha"
    assert layout.layers == (5, 6)


def test_mla_and_memory_override() -> None:
    kv = [np.zeros((3, 576), np.uint16) for _ in range(3)]
    layout = KVLayout.mla(kv, memory=["host", "device", "device"])
    assert layout.attention == "mla"
    assert [b.memory for b in layout.buffers] == ["host", "device", "device"]
    assert layout.has_memory("device")


def test_json_round_trip_is_exact() -> None:
    layout = KVLayout((KVBuffer(4096, 64, 10, 0, "k"), KVBuffer(8192, 64, 10, 0, "v", "device")))
    text = layout.to_json()
    assert json.loads(text)["format"] == "kvwire.layout"
    assert KVLayout.from_json(text) == layout


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("not json", "layout description is not valid JSON"),
        ('{"format": "other", "version": 1, "buffers": []}', "'format' must be 'kvwire.layout'"),
        ('{"format": "kvwire.layout", "version": 2, "buffers": []}', "'version' 2 is not supported"),
        ('{"format": "kvwire.layout", "version": 1, "buffers": {}}', "'buffers' must be a list"),
        ('{"format": "kvwire.layout", "version": 1, "buffers": [{"base": 1}]}', r"buffers\[0\] has missing fields"),
        (
            '{"format": "kvwire.layout", "version": 1, "buffers": [{"base": -5, "page_bytes": 1, "num_pages": 1,'
            ' "layer": 0, "role": "kv", "memory": "host"}]}',
            r"buffers\[0\]: KVBuffer.base must be >= 1, got -5",
        ),
        (
            '{"format": "kvwire.layout", "version": 1, "buffers": [{"base": 1, "page_bytes": 1, "num_pages": 1,'
            ' "layer": 0, "role": "q", "memory": "host"}]}',
            r"KVBuffer.role must be one of \('k', 'v', 'kv'\), got 'q'",
        ),
        ('{"format": "kvwire.layout", "version": 1, "buffers": []}', "KVLayout.buffers must not be empty"),
    ],
)
def test_malformed_descriptions_are_layout_errors(data: str, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        KVLayout.from_json(data)


def test_structural_errors() -> None:
    with pytest.raises(LayoutError, match=r"buffers\[1\] overlaps buffers\[0\]"):
        KVLayout((KVBuffer(4096, 64, 10, 0, "k"), KVBuffer(4096 + 64, 64, 10, 0, "v")))
    with pytest.raises(LayoutError, match=r"buffers\[2\] overlaps buffers\[0\]"):  # a device buffer between them
        KVLayout(
            (KVBuffer(4096, 64, 10, 0, "k"), KVBuffer(4100, 8, 1, 0, "k", "device"), KVBuffer(4160, 64, 1, 0, "v"))
        )
    with pytest.raises(LayoutError, match="mixes MLA"):
        KVLayout((KVBuffer(4096, 64, 1, 0, "kv"), KVBuffer(8192, 64, 1, 0, "k")))
    with pytest.raises(LayoutError, match=r"buffers\[1\] repeats layer 0 role 'kv' memory 'host'"):
        KVLayout((KVBuffer(4096, 64, 1, 0, "kv"), KVBuffer(8192, 64, 1, 0, "kv")))
    with pytest.raises(LayoutError, match="must be C-contiguous"):
        KVLayout.mla([np.zeros((4, 4), np.uint8)[:, ::2]])
    with pytest.raises(LayoutError, match="k and v must have one array per layer each, got 2 and 1"):
        KVLayout.mha([np.zeros((1, 1))] * 2, [np.zeros((1, 1))])
    with pytest.raises(LayoutError, match=r"must be a numpy\.ndarray or torch\.Tensor, got list"):
        KVLayout.mla([[1, 2, 3]])


def test_from_torch_cpu_tensors() -> None:
    torch = pytest.importorskip("torch")
    k = [torch.zeros((6, 8, 128), dtype=torch.bfloat16) for _ in range(2)]
    v = [torch.zeros((6, 8, 128), dtype=torch.bfloat16) for _ in range(2)]
    layout = KVLayout.mha(k, v)
    assert layout.buffers[0].base == k[0].data_ptr()
    assert layout.buffers[0].page_bytes == 8 * 128 * 2
    assert layout.buffers[0].num_pages == 6
    assert {b.memory for b in layout.buffers} == {"host"}
    with pytest.raises(LayoutError, match="must be contiguous"):
        KVLayout.mla([torch.zeros((4, 4)).t()])


# -- TP fields: attn_tp_rank and heads (optional on the wire) -------------------------------

_BUFFERS = (
    '[{"base": 4096, "page_bytes": 32, "num_pages": 4, "layer": 0, "role": "k", "memory": "host"},'
    ' {"base": 8192, "page_bytes": 32, "num_pages": 4, "layer": 0, "role": "v", "memory": "host"}]'
)


def _description(extra: str) -> str:
    return '{"format": "kvwire.layout", "version": 1, "buffers": ' + _BUFFERS + extra + "}"


def test_tp_fields_round_trip_and_are_omitted_when_absent() -> None:
    heads = HeadLayout(kv_heads=2, total_kv_heads=4, head_dim=4, elem_bytes=2, tokens_per_page=2)
    k, v = np.zeros((4, 2, 2, 4), np.float16), np.zeros((4, 2, 2, 4), np.float16)
    layout = KVLayout.mha([k], [v], attn_tp_size=2, attn_tp_rank=1, heads=heads)
    data = json.loads(layout.to_json())
    assert data["attn_tp_size"] == 2 and data["attn_tp_rank"] == 1
    assert data["heads"] == {"kv_heads": 2, "total_kv_heads": 4, "head_dim": 4, "elem_bytes": 2, "tokens_per_page": 2}
    assert KVLayout.from_json(layout.to_json()) == layout
    plain = KVLayout.mha([k], [v])
    assert set(json.loads(plain.to_json())) == {"format", "version", "buffers"}  # readable by older kvwire
    mla = KVLayout.mla([np.zeros((4, 8), np.uint8)], attn_tp_size=4, attn_tp_rank=3)
    assert KVLayout.from_json(mla.to_json()) == mla


def test_an_older_description_without_tp_fields_still_parses() -> None:
    layout = KVLayout.from_json(_description(', "attn_tp_size": 2'))
    assert (layout.attn_tp_size, layout.attn_tp_rank, layout.heads) == (2, None, None)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (', "attn_tp_rank": 0', "KVLayout.attn_tp_rank needs attn_tp_size"),
        (', "attn_tp_size": 2, "attn_tp_rank": 2', "KVLayout.attn_tp_rank = 2 is out of range: attn_tp_size is 2"),
        (', "attn_tp_size": 2, "attn_tp_rank": true', "KVLayout.attn_tp_rank must be an int, got bool True"),
        (', "attn_tp_size": 2, "attn_tp_rank": 1.0', "KVLayout.attn_tp_rank must be an int, got float 1.0"),
        (', "attn_tp_size": 1, "attn_tp_rank": 0, "heads": 3', "heads must be an object"),
        (
            ', "attn_tp_size": 1, "attn_tp_rank": 0, "heads": {"kv_heads": 2}',
            "heads has missing fields ['total_kv_heads', 'head_dim', 'elem_bytes', 'tokens_per_page']",
        ),
        (
            ', "attn_tp_size": 1, "attn_tp_rank": 0, "heads": {"kv_heads": 2, "total_kv_heads": 2, "head_dim": 4,'
            ' "elem_bytes": 2, "tokens_per_page": 2, "dtype": "fp16"}',
            "heads has missing fields [] / unknown fields ['dtype']",
        ),
        (
            ', "attn_tp_size": 1, "attn_tp_rank": 0, "heads": {"kv_heads": 2, "total_kv_heads": 2, "head_dim": "4",'
            ' "elem_bytes": 2, "tokens_per_page": 2}',
            "heads: HeadLayout.head_dim must be an int, got str '4'",
        ),
        (
            ', "attn_tp_size": 1, "attn_tp_rank": 0, "heads": {"kv_heads": 2, "total_kv_heads": 2, "head_dim": 4,'
            ' "elem_bytes": 3, "tokens_per_page": 2}',
            "heads: HeadLayout.elem_bytes must be one of (1, 2, 4, 8), got 3",
        ),
        (
            ', "attn_tp_size": 1, "attn_tp_rank": 0, "heads": {"kv_heads": 2, "total_kv_heads": 2, "head_dim": 2,'
            ' "elem_bytes": 2, "tokens_per_page": 2}',
            "KVLayout.buffers[0].page_bytes = 32, but heads say kv_heads 2 x head_dim 2 x elem_bytes 2 x "
            "tokens_per_page 2 = 16",
        ),
        (
            ', "attn_tp_size": 4, "attn_tp_rank": 0, "heads": {"kv_heads": 2, "total_kv_heads": 2, "head_dim": 4,'
            ' "elem_bytes": 2, "tokens_per_page": 2}',
            "HeadLayout.kv_heads = 2, but total_kv_heads = 2 over attn_tp_size = 4 gives 1 per rank",
        ),
        (', "attn_tp_size": 1, "rank": 0', "unknown fields ['rank']"),
    ],
)
def test_malformed_tp_fields_are_layout_errors(extra: str, message: str) -> None:
    with pytest.raises(LayoutError, match="^layout description: " + re.escape(message)):
        KVLayout.from_json(_description(extra))


def test_peer_description_carries_the_tp_fields() -> None:
    from kvwire.layout.peer import PeerDescription

    heads = HeadLayout(1, 2, 4, 2, 2)
    layout = KVLayout((KVBuffer(4096, 16, 4, 0, "k"), KVBuffer(8192, 16, 4, 0, "v")), 2, 1, heads)
    parsed = PeerDescription.from_dict(json.loads(json.dumps(PeerDescription("ep", layout).to_dict())))
    assert parsed.layout == layout and parsed.layout.heads == heads and parsed.layout.attn_tp_rank == 1


def test_head_major_pages_travel_in_the_description_and_only_as_a_bool() -> None:
    from kvwire.layout.peer import PeerDescription

    heads = HeadLayout(1, 2, 4, 2, 2, head_major=True)
    layout = KVLayout((KVBuffer(4096, 16, 4, 0, "k"), KVBuffer(8192, 16, 4, 0, "v")), 2, 1, heads)
    wire = PeerDescription("ep", layout).to_dict()
    assert wire["layout"]["heads"]["head_major"] is True
    parsed = PeerDescription.from_dict(json.loads(json.dumps(wire)))
    assert parsed.layout.heads == heads and parsed.layout.heads is not None and parsed.layout.heads.head_major
    token_major = KVLayout(layout.buffers, 2, 1, HeadLayout(1, 2, 4, 2, 2))
    assert "head_major" not in PeerDescription("ep", token_major).to_dict()["layout"]["heads"]  # as before
    wire["layout"]["heads"]["head_major"] = 1
    with pytest.raises(LayoutError) as exc:
        PeerDescription.from_dict(wire)
    assert "HeadLayout.head_major must be a bool, got int" in str(exc.value)
    wire["layout"]["heads"]["head_major"] = True
    wire["layout"]["heads"]["major"] = True
    with pytest.raises(LayoutError) as exc:
        PeerDescription.from_dict(wire)
    assert "heads has missing fields [] / unknown fields ['major']" in str(exc.value)


# -- layout: a buffer may end at 2**63 - 1, not past it ----------------------------------------------------------------


def test_a_buffer_may_end_exactly_at_the_address_limit_and_not_one_byte_past() -> None:
    last = 2**63 - 1 - 64 * 4  # base + 4 pages ends at 2**63 - 1
    assert KVBuffer(last, 64, 4, 0).end == 2**63 - 1
    with pytest.raises(kvwire.LayoutError) as exc:
        KVBuffer(last + 1, 64, 4, 0)
    assert str(exc.value) == (
        f"KVBuffer.base + page_bytes * num_pages = {last + 1:#x} + 64 * 4 ends past 2**63 - 1: "
        "not an address range of this platform"
    )
