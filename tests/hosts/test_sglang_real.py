"""kvwire inside sglang 0.5.23's own prefill/decode code, one process per TP rank on 127.0.0.1 (tests/hosts/sglang).

Each process runs sglang's ``ServerArgs`` (published for its TP rank), Mooncake engine (TCP), bootstrap
server, the manager class that sglang's ``get_kv_class`` returns, its sender, receiver and
``transfer_worker``, with CPU pools of random bytes. In ``kvwire`` mode ``SGLANG_PLUGINS=kvwire`` and
sglang's own ``load_plugins()`` install kvwire-sglang's manager; every byte is checked on every decode
rank (its heads, token by token, across attention-TP sizes), and every page outside the request. A decode
killed after sending its metadata fails only its own request. Draft-model KV (speculative decoding), a
HiSparse decode's split host/device buffers (through kvwire-hisparse) and a prefill of two pipeline stages
are verified the same way. The sglang venv (``make_venv.sh``, --no-deps, pinned) is built once and cached.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from offline import index_unreachable

pytestmark = pytest.mark.slow

HERE = Path(__file__).parent / "sglang"
ROOT = Path(__file__).parents[2]
VENV = ROOT / ".venv-sglang"


def _load_pair() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sglang_pair", HERE / "pair.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["sglang_pair"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def pair() -> ModuleType:
    """The harness, once the pinned sglang venv exists (built here when missing or stale)."""
    proc = subprocess.run(
        ["bash", str(HERE / "make_venv.sh"), str(VENV)], capture_output=True, text=True, timeout=1800, cwd=ROOT
    )
    if proc.returncode == 3:
        index_unreachable(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _load_pair()


def _run(pair: ModuleType, scenario: str, mode: str) -> dict[str, Any]:
    result: dict[str, Any] = pair.run_pair(scenario, mode, timeout_s=180)
    return result


@pytest.mark.parametrize("scenario", ["plain-mha", "plain-mla", "hybrid-mha", "hybrid-mla"])
def test_every_pool_shape_moves_exact_bytes_through_sglangs_own_transfer_worker_and_kvwire(
    pair: ModuleType, scenario: str
) -> None:
    result = _run(pair, scenario, "kvwire")
    prefill, decode = result["prefill"], result["decode"]
    assert result["outcome"] == "verified", result
    assert prefill["manager"] == decode["manager"] == "kvwire_sglang.plugin.KvwireKVManager"
    assert prefill["kvwire_sends"] >= 1 and all("error" not in call for call in prefill["kvwire_calls"]), prefill
    assert decode["pages_checked"] > 0 and decode["mismatches"] == [] and decode["other_pages_changed"] == []


def test_the_harness_verifies_stock_sglang_too(pair: ModuleType) -> None:
    """The same harness without the plugin: sglang's own MooncakeKVManager, so a kvwire pass is not the harness's."""
    result = _run(pair, "plain-mha", "stock")
    assert result["outcome"] == "verified", result
    assert result["prefill"]["manager"].endswith("MooncakeKVManager")
    assert "kvwire_sends" not in result["prefill"] or result["prefill"]["kvwire_sends"] == 0


def test_a_bad_destination_page_is_refused_by_kvwire_before_any_byte_moves(pair: ModuleType) -> None:
    """Stock sglang writes some in-range pages before Mooncake's server rejects the bad one; kvwire writes none."""
    result = _run(pair, "bad-page", "kvwire")
    prefill, decode = result["prefill"], result["decode"]
    assert result["outcome"] == "failed as expected", result
    assert prefill["kvpoll"] == decode["kvpoll"] == "Failed"
    (call,) = prefill["kvwire_calls"]
    assert call["error"] == (
        "InvalidTransferError: dst_kv_indices[2] = 12 is out of range: peer buffer 0 (layer 0, k, host) has 12 pages"
    )
    assert decode["other_pages_changed"] == [] and decode["pages_compared_unchanged"] > 0
    # a refusal of the request's own input fails that request, and the decode session stays in service
    assert prefill["failed_sessions"] == []


# -- attention TP sizes that differ: one process per TP rank, as sglang deploys them ------------------------------

#: Each rank's (attn_tp_size, attn_tp_rank) as sglang derived them from the published SpawnRanks, and its heads
#: of the model's 4 KV heads. A request moves 4 pages of 4 K/V buffers: 16 pages; a page of 4 tokens x 8 dims
#: fp16 is 64 bytes per head.
_TP_RANKS = {
    "tp-1-2": {"prefill": ([1, 0], [0, 1, 2, 3]), "decode": ([2, 0], [0, 1]), "decode-r1": ([2, 1], [2, 3])},
    "tp-2-1": {"prefill": ([2, 0], [0, 1]), "prefill-r1": ([2, 1], [2, 3]), "decode": ([1, 0], [0, 1, 2, 3])},
}


def _check_tp_ranks(result: dict[str, Any], scenario: str) -> None:
    """Every rank has its TP rank and heads; every decode rank holds exactly its heads of every requested page."""
    ranks = _TP_RANKS[scenario]
    assert result["processes"] == list(ranks)
    prefill_tp = sum(1 for name in ranks if name.startswith("prefill"))
    for name, (attn_tp, heads) in ranks.items():
        side = result[name]
        assert (side["attn_tp"], side["heads"]) == (attn_tp, heads), (name, side)
        if side["role"] == "prefill":
            assert side["requests"] == [{"server": 0, "rep": 0, "kvpoll": "Success", "failure": None, **_seconds(side)}]
            assert side["failed_sessions"] == []
        else:
            assert side["prefill_attn_tp_size"] == prefill_tp  # what the bootstrap server learned from the prefill
            assert side["target_tp_ranks"] == list(range(prefill_tp))
            assert side["kvpoll"] == "Success" and side["failure"] is None
            assert side["pages_checked"] == 16 and side["head_slices_checked"] == 16 * 4 * len(heads)
            assert side["mismatches"] == [] and side["mismatch_count"] == 0 and side["other_pages_changed"] == []


def _seconds(side: dict[str, Any]) -> dict[str, Any]:
    """The one request's ``seconds`` (a time, checked to be one), so that a dict of the rest compares exactly."""
    (request,) = side["requests"]
    assert isinstance(request["seconds"], float) and 0 < request["seconds"] < 30, request
    return {"seconds": request["seconds"]}


@pytest.mark.parametrize("scenario", ["tp-1-2", "tp-2-1"])
def test_kvwire_slices_heads_across_attention_tp_sizes_through_sglangs_send_kvcache_slice(
    pair: ModuleType, scenario: str
) -> None:
    """TP 1 -> 2: the prefill rank sends each decode rank its 2 of 4 heads; TP 2 -> 1: each prefill rank fills its 2."""
    result = _run(pair, scenario, "kvwire")
    assert result["outcome"] == "verified", result
    _check_tp_ranks(result, scenario)
    prefills = [result[name] for name in result["processes"] if name.startswith("prefill")]
    calls = [call for side in prefills for call in side["kvwire_calls"]]
    # one send per (prefill rank, decode rank): 16 pages of the decode rank's (1 -> 2) or the prefill rank's
    # (2 -> 1) 2 heads: 16 x 4 tokens x 2 heads x 16 bytes
    assert [call["bytes"] for call in calls] == [2048, 2048]
    assert all(side["kvwire_sends"] == len(side["kvwire_calls"]) for side in prefills)
    sessions = {call["session"] for call in calls}
    assert len(sessions) == (2 if scenario == "tp-1-2" else 1)  # two decode ranks, or the one decode rank


def test_the_harness_verifies_stock_sglangs_own_head_slicing_too(pair: ModuleType) -> None:
    """TP 1 -> 2 without the plugin: sglang's own send_kvcache_slice, token by token, passes the same checks."""
    result = _run(pair, "tp-1-2", "stock")
    assert result["outcome"] == "verified", result
    _check_tp_ranks(result, "tp-1-2")
    assert all(result[name]["manager"].endswith("MooncakeKVManager") for name in result["processes"])
    assert "kvwire_sends" not in result["prefill"]


@pytest.mark.parametrize(("scenario", "killed_at"), [("killed-decode", 0), ("killed-decode-warm", 1)])
def test_a_killed_decode_fails_its_request_alone_and_the_other_decode_gets_exact_bytes(
    pair: ModuleType, scenario: str, killed_at: int
) -> None:
    """Decode server 0 is SIGKILLed after sending its metadata for request ``killed_at`` (-warm: after a first
    request to each decode succeeded); then the prefill sends that request to both decode servers.

    kvwire finds the dead peer (Mooncake: connection refused), returns -102 to sglang's transfer_worker, which
    marks the session failed and the request Failed within milliseconds; decode server 1's requests are verified.
    """
    result = _run(pair, scenario, "kvwire")
    assert result["outcome"] == "verified", result
    assert result["processes"] == ["prefill", "decode", "decode-s1"]
    killed, prefill, live = result["decode"], result["prefill"], result["decode-s1"]
    assert killed["killed"] is True and killed["returncode"] == -9
    assert [(r["server"], r["rep"], r["kvpoll"]) for r in prefill["requests"]] == [
        (server, rep, "Failed" if (server, rep) == (0, killed_at) else "Success")
        for rep in range(killed_at + 1)
        for server in (0, 1)
    ]
    (dead,) = [r for r in prefill["requests"] if r["kvpoll"] == "Failed"]
    assert re.fullmatch(r"KVTransferError: .*Failed to send kv chunk of \d+ to 127\.0\.0\.1:\d+", dead["failure"])
    assert 0 < dead["seconds"] < 5, dead
    (failed_call,) = [call for call in prefill["kvwire_calls"] if "error" in call]
    sent = [call["bytes"] for call in prefill["kvwire_calls"] if "error" not in call]
    assert failed_call["error"].startswith(f"PeerUnreachableError: peer {failed_call['session']} is unreachable")
    assert sent == [2048] * (2 * killed_at + 1)
    assert prefill["failed_sessions"] == [failed_call["session"]]
    assert any("failed (status -102," in line for line in prefill["errors_logged"]), prefill["errors_logged"]
    assert live["kvpoll"] == "Success" and live["pages_checked"] == 16 * (killed_at + 1)
    assert live["mismatches"] == [] and live["other_pages_changed"] == []


# -- draft-model KV (speculative decoding) and HiSparse split decodes ------------------------------------------


def _labels(layers: list[int], roles: str, memory: str = "host") -> list[list[Any]]:
    """kvwire's (layer, role, memory) of each buffer: ``roles`` one letter per buffer (k, v, or m for MLA's kv)."""
    return [[layer, "kv" if r == "m" else r, memory] for layer, r in zip(layers, roles, strict=True)]


#: scenario -> (the prefill's layout labels, the decode's, pages checked on the decode, bytes sent). A request moves
#: 4 pages; an MHA page is 4 tokens x 2 heads x 8 dims fp16 = 128 bytes, an MLA page 4 x 24 fp16 = 192 bytes.
_DRAFT = {
    # 2 target layers (K0 K1 V0 V1) then 2 draft layers (K2 K3 V2 V3) on both sides, positional (kv_layer_ids [])
    "draft-mha": (_labels([0, 1, 0, 1, 2, 3, 2, 3], "kkvvkkvv"),) * 2 + (32, 32 * 128),
    "draft-mla": (_labels([0, 1, 2, 3], "mmmm"),) * 2 + (16, 16 * 192),
    # a hybrid pool: the target's layers 3 and 5, the draft's in sglang's band num_hidden_layers (6) + i
    "draft-hybrid-mha": (_labels([3, 5, 3, 5, 6, 7, 6, 7], "kkvvkkvv"),) * 2 + (32, 32 * 128),
    # the decode has a draft layer the prefill lacks: kvwire writes the target's layers only
    "draft-decode-only": (_labels([0, 1, 0, 1], "kkvv"), _labels([0, 1, 0, 1, 2, 2], "kkvvkv"), 16, 16 * 128),
    # as many draft layers as target layers on the decode only: where sglang's own pairing errs (see below)
    "draft-decode-only-2": (
        _labels([0, 1, 0, 1], "kkvv"),
        _labels([0, 1, 0, 1, 2, 3, 2, 3], "kkvvkkvv"),
        16,
        16 * 128,
    ),
}


@pytest.mark.parametrize("scenario", list(_DRAFT))
def test_draft_model_kv_moves_exact_bytes_through_sglangs_own_transfer_worker_and_kvwire(
    pair: ModuleType, scenario: str
) -> None:
    """sglang appends the draft pool's buffers after the target's; kvwire labels them as layers of their own
    (K/V as sglang orders them) and each lands on the decode's buffer of the same position, checked byte by byte;
    a draft buffer the prefill has no source for stays exactly as it was."""
    result = _run(pair, scenario, "kvwire")
    prefill, decode = result["prefill"], result["decode"]
    want_prefill, want_decode, pages, sent = _DRAFT[scenario]
    assert result["outcome"] == "verified", result
    assert prefill["manager"] == decode["manager"] == "kvwire_sglang.plugin.KvwireKVManager"
    assert prefill["kvwire_layout"] == want_prefill
    assert decode["kvwire_layout"] == want_decode
    assert [call["bytes"] for call in prefill["kvwire_calls"]] == [sent]
    assert decode["pages_checked"] == pages and decode["mismatches"] == [] and decode["other_pages_changed"] == []
    # every page of every decode buffer (guard pages too) not written is compared: 14 per buffer, 4 written
    assert decode["pages_compared_unchanged"] == 14 * len(want_decode) - pages


@pytest.mark.parametrize(
    ("scenario", "pages", "sent"), [("hisparse-mla", 12, 12 * 192), ("hisparse-mha", 24, 24 * 128)]
)
def test_a_hisparse_decode_gets_the_target_at_its_host_pages_and_the_draft_at_its_device_kv_indices(
    pair: ModuleType, scenario: str, pages: int, sent: int
) -> None:
    """The decode (enable_hisparse) registers its target KV as host memory and its draft KV as device memory, and
    sends device_kv_indices (5, 10, 11, 1) beside kv_indices (9, 3, 4, 11); the prefill's kvwire-sglang takes
    kvwire-hisparse (installed in the venv) and writes each buffer at its own page ids, nothing else."""
    result = _run(pair, scenario, "kvwire")
    prefill, decode = result["prefill"], result["decode"]
    assert result["outcome"] == "verified", result
    assert prefill["kvwire_backend"] == "hisparse"
    if scenario == "hisparse-mla":
        assert prefill["kvwire_layout"] == _labels([0, 1, 2], "mmm")
        assert decode["kvwire_layout"] == _labels([0, 1], "mm") + _labels([2], "m", "device")
    else:
        assert prefill["kvwire_layout"] == _labels([0, 1, 0, 1, 2, 2], "kkvvkv")
        assert decode["kvwire_layout"] == _labels([0, 1, 0, 1], "kkvv") + _labels([2, 2], "kv", "device")
    assert [call["bytes"] for call in prefill["kvwire_calls"]] == [sent]
    assert decode["pages_checked"] == pages and decode["mismatches"] == [] and decode["other_pages_changed"] == []


def test_device_kv_indices_on_plain_kvwire_mooncake_are_refused_with_the_install_hint(pair: ModuleType) -> None:
    """The prefill forced onto kvwire-mooncake: the HiSparse decode is flagged when it registers, its request is
    refused with -22 and the hint to install kvwire-hisparse, and not one byte of the decode's pool changes."""
    result = _run(pair, "hisparse-on-mooncake", "kvwire")
    prefill, decode = result["prefill"], result["decode"]
    assert result["outcome"] == "failed as expected", result
    assert prefill["kvwire_backend"] == "mooncake"
    (call,) = prefill["kvwire_calls"]
    assert call["error"] == (
        "UnsupportedFeatureError: backend 'mooncake' (spec 1.5) does not support 'device_kv_indices', needed for "
        "dst_device_kv_indices; nothing was sent. Use a backend that supports it (pip install kvwire-hisparse)"
    )
    session = call["session"]
    logged = [line.split(": ", 1)[1] for line in prefill["errors_logged"] if " kvwire.sglang: " in line]
    assert logged == [
        f"kvwire: decode session {session} is a HiSparse split destination (host and device buffers), but backend "
        "'mooncake' cannot address device buffers: its sends are refused (status -22); install kvwire-hisparse on "
        "the prefill (pip install kvwire-hisparse)",
        f"kvwire send_kvcache to session {session} failed (status -22, peer {session}): {call['error']}",
    ]
    assert decode["other_pages_changed"] == [] and decode["pages_compared_unchanged"] == 14 * 3


@pytest.mark.parametrize("scenario", ["draft-mha", "draft-decode-only", "hisparse-mla"])
def test_the_harness_verifies_stock_sglang_with_draft_kv_and_hisparse_too(pair: ModuleType, scenario: str) -> None:
    """The same checks pass with sglang's own MooncakeKVManager: the harness's expectations are sglang's."""
    result = _run(pair, scenario, "stock")
    assert result["outcome"] == "verified", result
    assert result["prefill"]["manager"].endswith("MooncakeKVManager")
    assert result["prefill"]["kvwire_layout"] is None and "kvwire_sends" not in result["prefill"]


# -- a pipeline-parallel prefill: one process per stage, each sending its own layers -------------------------------


@pytest.mark.parametrize(("scenario", "layers"), [("pp-2-1", [0, 1, 2, 3]), ("pp-2-1-hybrid", [3, 5, 7, 9])])
def test_each_stage_of_a_pipeline_parallel_prefill_sends_its_layers_onto_the_decodes_same_layers(
    pair: ModuleType, scenario: str, layers: list[int]
) -> None:
    """Prefill PP 2 (sglang derives pp_rank from each process's world rank), decode PP 1 with all 4 layers.

    Each stage numbers its layers from its ``prefill_start_layer`` (plain pool) or reports their ids (hybrid:
    sglang passes the decode's whole ``kv_layer_ids``, and kvwire pairs by layer id as sglang does); both stages'
    sends land on the decode's layers of the same number, checked byte by byte on all 8 of its buffers.
    """
    result = _run(pair, scenario, "kvwire")
    assert result["outcome"] == "verified", result
    assert result["processes"] == ["prefill", "prefill-p1", "decode"]
    for stage, name in enumerate(("prefill", "prefill-p1")):
        side = result[name]
        own = layers[2 * stage : 2 * stage + 2]
        assert side["pp"] == [2, stage]
        assert side["kvwire_layout"] == _labels(own + own, "kkvv")
        assert [call["bytes"] for call in side["kvwire_calls"]] == [2048]  # 4 pages x 4 buffers x 128 bytes
        assert side["requests"] == [{"server": 0, "rep": 0, "kvpoll": "Success", "failure": None, **_seconds(side)}]
    decode = result["decode"]
    assert decode["kvwire_layout"] == _labels(layers + layers, "kkkkvvvv")
    assert decode["pages_checked"] == 32 and decode["mismatches"] == [] and decode["other_pages_changed"] == []
    assert decode["pages_compared_unchanged"] == 14 * 8 - 32


def test_stock_sglang_writes_the_targets_v_into_a_decode_only_drafts_k_where_kvwire_does_not(pair: ModuleType) -> None:
    """A decode with 2 draft layers, a prefill with none and 2 target layers: sglang's get_mha_kv_ptrs_with_pp takes
    the decode's V buffers from after its draft K (``dst_kv_ptrs[L + D:]``), so stock sglang writes the target's V
    pages into the draft's K buffers (decode buffers 4 and 5) and leaves the decode's V buffers as they were. The same
    run through kvwire is verified (test_draft_model_kv_moves_exact_bytes..., draft-decode-only-2)."""
    result = _run(pair, "draft-decode-only-2", "stock")
    decode = result["decode"]
    assert result["outcome"].startswith("broke: decode: pages written that were not asked for: ['buffer 4 page 3'")
    assert decode["kvpoll"] == "Success"  # sglang reports success
    assert sorted({line.split(" page")[0] for line in decode["other_pages_changed"]}) == ["buffer 4", "buffer 5"]
    assert {m.split(" page")[0] for m in decode["mismatches"]} == {"buffer 2", "buffer 3"}  # the V never arrived
