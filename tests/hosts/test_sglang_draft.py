"""kvwire_sglang with draft-model KV (speculative decoding) and HiSparse split decodes, in process.

sglang 0.5.23 appends the draft pool's KV buffers after the target's (``KVArgs.num_draft_entries``), and
a HiSparse decode registers its target KV from its host pool and the draft's from the device. These tests
pin the labels kvwire gives each buffer (layer, role, memory), the exact errors for what it refuses, and the
bytes moved between two in-process connections (the ``local`` backend). The same shapes through sglang's
own processes are in ``test_sglang_real.py``.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire import BackendConfig, HeadLayout, KVLayout, LayoutError
from kvwire.backends.local import LocalBackend
from kvwire_sglang import KvwireManagerMixin, SglangSender, layout_from_kv_args
from kvwire_sglang.manager import default_backend

PAGE = 64  # bytes per page in these pools


def _labels(layout: KVLayout) -> list[tuple[int, str, str]]:
    return [(b.layer, b.role, b.memory) for b in layout.buffers]


def _args(n: int, pages: int = 8, base: int = 1 << 20) -> tuple[list[int], list[int], list[int]]:
    """kv_data_ptrs, kv_data_lens, kv_item_lens of ``n`` buffers of ``pages`` pages (addresses only)."""
    return [base + i * pages * PAGE for i in range(n)], [pages * PAGE] * n, [PAGE] * n


# -- labels ------------------------------------------------------------------------------------------


def test_plain_mha_draft_buffers_become_layers_after_the_targets_k_then_v() -> None:
    """[K0 K1 V0 V1 | Kd0 Kd1 Vd0 Vd1], kv_layer_ids [] (positional): the draft's layers are 2 and 3."""
    layout = layout_from_kv_args(*_args(8), [], attention="mha", memory="device", num_draft_entries=4)
    assert _labels(layout) == [
        (0, "k", "device"),
        (1, "k", "device"),
        (0, "v", "device"),
        (1, "v", "device"),
        (2, "k", "device"),
        (3, "k", "device"),
        (2, "v", "device"),
        (3, "v", "device"),
    ]


def test_plain_mla_draft_buffers_follow_the_targets_and_a_stage_can_start_them_where_told() -> None:
    layout = layout_from_kv_args(*_args(3), None, attention="mla", memory="host", num_draft_entries=1)
    assert _labels(layout) == [(0, "kv", "host"), (1, "kv", "host"), (2, "kv", "host")]
    banded = layout_from_kv_args(
        *_args(3), [], attention="mla", memory="host", num_draft_entries=1, first_layer=4, draft_first_layer=61
    )
    assert _labels(banded) == [(4, "kv", "host"), (5, "kv", "host"), (61, "kv", "host")]


def test_positional_draft_layers_follow_a_pipeline_stages_first_layer() -> None:
    """A stage starting at layer 4 with 2 target layers and 1 draft (positional ids, no draft_first_layer): 6."""
    layout = layout_from_kv_args(*_args(3), [], attention="mla", memory="host", num_draft_entries=1, first_layer=4)
    assert _labels(layout) == [(4, "kv", "host"), (5, "kv", "host"), (6, "kv", "host")]


def test_hybrid_pools_keep_sglangs_draft_band() -> None:
    """build_kv_layer_ids: target ids (x2 for MHA), then the draft's remapped to num_hidden_layers (6) + i."""
    mha = layout_from_kv_args(*_args(8), [3, 5, 3, 5, 6, 7, 6, 7], attention="mha", memory="host", num_draft_entries=4)
    assert [(b.layer, b.role) for b in mha.buffers] == [
        (3, "k"),
        (5, "k"),
        (3, "v"),
        (5, "v"),
        (6, "k"),
        (7, "k"),
        (6, "v"),
        (7, "v"),
    ]
    mla = layout_from_kv_args(*_args(3), [3, 5, 6], attention="mla", memory="host", num_draft_entries=1)
    assert [(b.layer, b.role) for b in mla.buffers] == [(3, "kv"), (5, "kv"), (6, "kv")]


def test_a_memory_kind_per_buffer_makes_a_split_destination() -> None:
    kinds: list[Any] = ["host"] * 4 + ["device"] * 2
    layout = layout_from_kv_args(*_args(6), [], attention="mha", memory=kinds, num_draft_entries=2)
    assert _labels(layout)[3:] == [(1, "v", "host"), (2, "k", "device"), (2, "v", "device")]
    assert layout.is_split


@pytest.mark.parametrize(
    ("n", "ids", "attention", "drafts", "kinds", "message"),
    [
        (
            7,
            [],
            "mha",
            3,
            None,
            "an MHA layout has a K and a V buffer per layer: the draft model has 3 buffers (odd); "
            "kv_data_ptrs has 7, num_draft_entries = 3",
        ),
        (
            4,
            [],
            "mha",
            4,
            None,
            "num_draft_entries = 4 must be an int in [0, 4): the draft model's buffers come after at least one "
            "of the target's (kv_data_ptrs has 4)",
        ),
        (
            6,
            [3, 5, 6],
            "mha",
            2,
            None,
            "kv_layer_ids has 3 entries; with num_draft_entries = 2 expected none (sglang's [] for positional "
            "layers) or 6 (one per buffer, the draft's in sglang's band after the target's)",
        ),
        (
            4,
            [3, 5, 5, 7],
            "mla",
            2,
            None,
            "the draft model's layers [5] are also target layers: sglang numbers the draft's layers in a band "
            "above the target's (num_hidden_layers + i); give kv_layer_ids as sglang builds them",
        ),
        (
            4,
            [3, 5, 6, 6],
            "mla",
            2,
            None,
            "kv_layer_ids gives the draft model's 2 buffers 1 layers ([6, 6]); expected 2, one id per buffer",
        ),
        (
            4,
            [],
            "mla",
            1,
            ["host"] * 3,
            "memory: expected 4 memory kinds (one per buffer), got 3",
        ),
    ],
    ids=["odd-mha-draft", "all-draft", "per-layer-ids-with-draft", "colliding-band", "mha-draft-on-mla", "kinds"],
)
def test_draft_layouts_kvwire_cannot_label_are_refused_naming_the_argument(
    n: int, ids: list[int], attention: Any, drafts: int, kinds: Any, message: str
) -> None:
    with pytest.raises(LayoutError) as exc:
        layout_from_kv_args(*_args(n), ids, attention=attention, memory=kinds or "host", num_draft_entries=drafts)
    assert str(exc.value) == message


# -- the manager's view of sglang's KVArgs and ServerArgs --------------------------------------------------


class _Manager(KvwireManagerMixin):
    """The mixin's layout and send paths on their own, with the attributes sglang's manager sets."""

    def __init__(self, kv_args: Any, server_args: Any, *, mla: bool = False, pp_size: int = 1) -> None:
        self.kv_args = kv_args
        self.server_args = server_args
        self.is_mla_backend = mla
        self.attn_tp_size, self.attn_tp_rank, self.pp_size = 1, 0, pp_size


def _kv_args(n: int, drafts: int, ids: list[int] | None = None, **more: Any) -> SimpleNamespace:
    ptrs, lens, items = _args(n)
    return SimpleNamespace(
        kv_data_ptrs=ptrs,
        kv_data_lens=lens,
        kv_item_lens=items,
        kv_layer_ids=ids or [],
        num_draft_entries=drafts,
        prefill_start_layer=0,
        **more,
    )


def _server(mode: str, device: str = "cuda", hisparse: bool = False) -> SimpleNamespace:
    return SimpleNamespace(disaggregation_mode=mode, device=device, enable_hisparse=hisparse)


def test_a_hisparse_decode_labels_its_target_host_and_its_draft_device_as_sglang_registers_them() -> None:
    """decode.py: the target's buffers from hisparse_coordinator.mem_pool_host, the draft's from the device pool."""
    manager = _Manager(_kv_args(3, 1, mla_compression_ratios=None), _server("decode", hisparse=True), mla=True)
    layout = manager.kvwire_local_layout()
    assert _labels(layout) == [(0, "kv", "host"), (1, "kv", "host"), (2, "kv", "device")]
    assert layout.is_split


@pytest.mark.parametrize(
    ("server", "kind"),
    [
        (_server("decode", "cuda", hisparse=False), "device"),
        (_server("prefill", "cuda", hisparse=True), "device"),  # HiSparse changes only the decode's registration
        (_server("decode", "cpu", hisparse=False), "host"),
    ],
    ids=["gpu-decode", "gpu-prefill-with-hisparse-flag", "cpu-decode"],
)
def test_every_other_rank_has_one_memory_kind(server: SimpleNamespace, kind: str) -> None:
    layout = _Manager(_kv_args(6, 2), server).kvwire_local_layout()
    assert {b.memory for b in layout.buffers} == {kind} and not layout.is_split
    assert [(b.layer, b.role) for b in layout.buffers] == [(0, "k"), (1, "k"), (0, "v"), (1, "v"), (2, "k"), (2, "v")]


def test_a_hisparse_deepseek_v4_decode_is_refused() -> None:
    manager = _Manager(_kv_args(3, 0, mla_compression_ratios=[4, 128, 4]), _server("decode", hisparse=True), mla=True)
    with pytest.raises(LayoutError) as exc:
        manager.kvwire_local_layout()
    assert str(exc.value) == (
        "kvwire-sglang does not describe a HiSparse decode of DeepSeek-V4 (kv_args.mla_compression_ratios is set: "
        "compressed pools, partly in host memory); run without SGLANG_PLUGINS=kvwire for this deployment"
    )


def test_a_pipeline_stage_with_positional_draft_kv_is_refused() -> None:
    manager = _Manager(_kv_args(6, 2), _server("prefill"), pp_size=2)
    with pytest.raises(LayoutError) as exc:
        manager.kvwire_local_layout()
    assert str(exc.value) == (
        "kv_args has 2 draft-model KV entries, positional layers (kv_layer_ids []) and a pipeline of 2 stages: "
        "a stage cannot number the draft's layers after the model's (sglang pairs these by position and mixes "
        "them up too); run the prefill with pp_size 1, or without SGLANG_PLUGINS=kvwire for this deployment"
    )
    # with sglang's layer ids (a hybrid pool) a stage knows its layers and the band: accepted
    staged = _Manager(_kv_args(4, 2, [5, 5, 6, 6]), _server("prefill"), pp_size=2).kvwire_local_layout()
    assert [(b.layer, b.role) for b in staged.buffers] == [(5, "k"), (5, "v"), (6, "k"), (6, "v")]


def test_an_mha_layout_records_its_heads_unless_the_drafts_pages_differ_from_the_targets() -> None:
    """Heads let kvwire slice across attention-TP sizes; a draft of another head shape has pages they do not fit."""
    heads: dict[str, Any] = {"kv_head_num": 2, "total_kv_head_num": 2, "page_size": 4}
    same = _Manager(_kv_args(6, 2, **heads), _server("prefill")).kvwire_local_layout()
    assert same.heads == HeadLayout(2, 2, 8, 1, 4)  # 64-byte pages of 4 tokens x 2 heads: 8 bytes per head
    other = _kv_args(6, 2, **heads)
    other.kv_item_lens = [PAGE] * 4 + [2 * PAGE] * 2
    other.kv_data_lens = [8 * PAGE] * 4 + [16 * PAGE] * 2
    other.kv_data_ptrs = _args(6, pages=16)[0]  # room for the larger pages
    layout = _Manager(other, _server("prefill")).kvwire_local_layout()
    assert layout.heads is None
    assert [b.page_bytes for b in layout.buffers] == [PAGE] * 4 + [2 * PAGE] * 2


def test_the_prefill_prefers_kvwire_hisparse_when_it_is_installed() -> None:
    """kvwire-hisparse is installed in the repo's venv: it is kvwire-mooncake's transport plus split destinations."""
    assert default_backend() == "hisparse"
    assert "device_kv_indices" in kvwire.default_registry().get("hisparse").capabilities
    assert KvwireManagerMixin.kvwire_backend is None


# -- bytes, between two in-process connections -------------------------------------------------------------


def _pools(buffers: int, pages: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, 256, (buffers, pages, PAGE), dtype=np.uint8)


def _ptrs(pools: np.ndarray) -> list[int]:
    return [int(pools[i].ctypes.data) for i in range(pools.shape[0])]


def _layout(pools: np.ndarray, ids: list[int], attention: Any, drafts: int, memory: Any = "host") -> KVLayout:
    n, pages = pools.shape[0], pools.shape[1]
    return layout_from_kv_args(
        _ptrs(pools), [pages * PAGE] * n, [PAGE] * n, ids, attention=attention, memory=memory, num_draft_entries=drafts
    )


_RECEIVERS: list[kvwire.Connection] = []  # kept open for the test's sends (the local backend: same process)


def _wire(local: KVLayout, peer: KVLayout, sender: kvwire.Connection | None = None) -> tuple[SglangSender, str]:
    sender = sender or kvwire.connect("local")
    receiver = kvwire.connect("local")
    _RECEIVERS[:] = [receiver]
    sender.register_kv_buffers(local)
    receiver.register_kv_buffers(peer)
    sender.add_peer(receiver.endpoint(), peer)
    return SglangSender(sender), receiver.endpoint()


SRC, DST, DEVICE_DST = [2, 7, 0], [9, 3, 11], [5, 1, 6]


@pytest.mark.parametrize(
    ("attention", "src_ids", "dst_ids", "src_drafts", "dst_drafts"),
    [
        ("mha", [], [], 4, 4),  # plain MHA, 2 target + 2 draft layers on both sides
        ("mla", [], [], 1, 1),
        ("mha", [3, 5, 3, 5, 6, 6], [3, 5, 3, 5, 6, 6], 2, 2),  # hybrid MHA, sglang's band (num_hidden_layers 6)
        ("mha", [], [], 0, 2),  # the decode has a draft layer, the prefill none: it stays untouched
        ("mha", [], [], 0, 4),  # as many draft layers as target layers (sglang's positional pairing errs here)
        ("mha", [3, 5, 3, 5], [3, 5, 3, 5, 6, 6], 0, 2),  # the same with layer ids (sglang pairs them by id)
    ],
    ids=[
        "plain-mha",
        "plain-mla",
        "hybrid-mha",
        "decode-only-draft",
        "decode-only-2-drafts",
        "decode-only-draft-hybrid",
    ],
)
def test_draft_kv_lands_on_the_decodes_draft_buffers_position_for_position(
    attention: str, src_ids: list[int], dst_ids: list[int], src_drafts: int, dst_drafts: int
) -> None:
    per_target = 4 if attention == "mha" else 2
    src, dst = _pools(per_target + src_drafts, 8, 1), _pools(per_target + dst_drafts, 12, 2)
    before = dst.copy()
    adapter, endpoint = _wire(
        _layout(src, src_ids, attention, src_drafts), _layout(dst, dst_ids, attention, dst_drafts)
    )
    ret = adapter.send_kvcache(
        endpoint,
        np.array(SRC, np.int32),
        _ptrs(dst),
        np.array(DST, np.int32),
        None,  # type: ignore[arg-type]
        dst_layer_ids=dst_ids,  # transfer_worker passes the decode's registered kv_layer_ids
        dst_kv_item_len=PAGE,
    )
    assert ret == 0
    filled = src.shape[0]  # the decode's first `filled` buffers, in sglang's order; the rest untouched
    assert (dst[:filled][:, DST] == src[:, SRC]).all()
    others = [p for p in range(12) if p not in DST]
    assert (dst[:filled][:, others] == before[:filled][:, others]).all()
    assert (dst[filled:] == before[filled:]).all()


def _hisparse_pair(sender: kvwire.Connection | None = None) -> tuple[SglangSender, str, np.ndarray, np.ndarray]:
    """A prefill of 2 MLA target + 1 draft layer; a HiSparse decode: target in host memory, draft on the device."""
    src, dst = _pools(3, 8, 3), _pools(3, 12, 4)
    decode = _layout(dst, [], "mla", 1, ["host", "host", "device"])
    adapter, endpoint = _wire(_layout(src, [], "mla", 1), decode, sender)
    return adapter, endpoint, src, dst


def test_a_hisparse_decode_gets_the_target_at_kv_indices_and_the_draft_at_device_kv_indices() -> None:
    adapter, endpoint, src, dst = _hisparse_pair()
    before = dst.copy()
    ret = adapter.send_kvcache(
        endpoint,
        np.array(SRC, np.int32),
        _ptrs(dst),
        np.array(DST, np.int32),
        None,  # type: ignore[arg-type]
        dst_layer_ids=[],
        dst_device_kv_indices=np.array(DEVICE_DST, np.int32),
    )
    assert ret == 0
    assert (dst[:2][:, DST] == src[:2][:, SRC]).all()
    assert (dst[2][DEVICE_DST] == src[2][SRC]).all()
    for b, written in ((0, DST), (1, DST), (2, DEVICE_DST)):
        others = [p for p in range(12) if p not in written]
        assert (dst[b][others] == before[b][others]).all()


def test_device_kv_indices_on_a_backend_without_them_are_refused_with_minus_22_and_the_install_hint(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kvwire-mooncake lacks device_kv_indices: the send is the caller's to fix (install kvwire-hisparse), -22."""
    caps = kvwire.default_registry().get("local").capabilities - {"device_kv_indices"}
    plain = kvwire.Connection("plain", LocalBackend, caps, BackendConfig(), spec_version="1.5")
    adapter, endpoint, _, dst = _hisparse_pair(plain)
    before = dst.copy()
    with caplog.at_level(logging.ERROR, logger="kvwire.sglang"):
        ret = adapter.send_kvcache(
            endpoint,
            np.array(SRC, np.int32),
            _ptrs(dst),
            np.array(DST, np.int32),
            None,  # type: ignore[arg-type]
            dst_device_kv_indices=np.array(DEVICE_DST, np.int32),
        )
    assert ret == -22
    assert (dst == before).all()
    (record,) = caplog.records
    assert record.getMessage() == (
        f"kvwire send_kvcache to session {endpoint} failed (status -22, peer {endpoint}): UnsupportedFeatureError: "
        "backend 'plain' (spec 1.5) does not support 'device_kv_indices', needed for dst_device_kv_indices; "
        "nothing was sent. Use a backend that supports it (pip install kvwire-hisparse)"
    )
