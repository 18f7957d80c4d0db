"""KVLayout: construction from arrays and tensors, the wire format, and malformed input."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvwire import KVBuffer, KVLayout, LayoutError


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
