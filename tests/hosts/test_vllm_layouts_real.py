"""kvwire's vLLM connector on the KV layouts vLLM resolves itself, once per supported release (slow).

No test here sets a layout by hand; the one that forces one does it the operator's way
(``VLLM_KV_CACHE_LAYOUT``) to check its refusal.

* ``probe_layouts.py`` (one process): for every attention backend class that imports on this machine, a
  prefill and a decode engine whose KV caches vLLM built (``resolve_kv_cache_layout`` with the backend's
  supported layouts and the connector's wish, ``get_kv_cache_configs``, ``allocate_kv_cache``) move a
  request's blocks through the ``local`` backend, TP 1 -> 1, 1 -> 2 and 2 -> 1, every byte checked head by
  head against the prefill rank routed to it.
* ``pd_node.py`` pairs (two vLLM processes, real Schedulers): an MLA model (DeepSeek-V2 on vLLM's CPU MLA
  backend, whose kernels split each block in two) through kvwire-nixl and kvwire-mooncake, an MLA TP-1 prefill
  filling a TP-2 decode, and a token-major layout forced with ``VLLM_KV_CACHE_LAYOUT``: whole blocks between
  equal TP sizes, refused at once, with the reason, across them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ports import free_port_run

sys.path.insert(0, str(Path(__file__).parent / "vllm"))

from pd_pair import NodeProcess, node_env

from kvwire.hosts.vllm.layout import LBNHC_ACROSS_TP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = Path(__file__).parent / "vllm"
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROMPT = 100  # tokens: 4 blocks of 32
LOAD_TIMEOUT_S = 8.0
# the backends vLLM runs by default on GPUs and on this CPU, MHA and MLA: the probe must cover at least these
EXPECTED = {"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION", "CPU_ATTN", "TRITON_MLA", "FLASHMLA", "CPU_MLA"}


def _extra(backend: str) -> dict[str, Any]:
    return {
        "backend": backend,
        "side_channel_port": free_port_run(4),
        "load_timeout_s": LOAD_TIMEOUT_S,
        "transfer_timeout_s": 5,
    }


@pytest.fixture(scope="module")
def probe(each_vllm_python: Path) -> dict[str, Any]:
    proc = subprocess.run(
        [str(each_vllm_python), str(HERE / "probe_layouts.py")],
        capture_output=True,
        text=True,
        timeout=900,
        env=node_env(),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_every_attention_backend_that_imports_moves_verified_blocks_on_the_layout_vllm_resolves(
    probe: dict[str, Any],
) -> None:
    backends = probe["backends"]
    assert set(backends) >= EXPECTED, sorted(backends)
    for name, entry in backends.items():
        for pair in ("1->1", "1->2", "2->1"):
            got = entry[pair]
            assert "error" not in got, (name, pair, got)
            supported, layout = got["supported"], got["layout"]
            # the connector asks for LBHNC (None for MLA): vLLM takes it where the backend supports it
            want = "LBHNC" if "LBHNC" in supported and not entry["mla"] else supported[0]
            assert (layout, got["decode_layout"]) == (want, want), (name, supported)
            d_tp = int(pair[-1])
            assert got["finished_recving"] == [["d0"]] * d_tp, (name, pair, got)
            if layout == "LBNHC" and not entry["mla"] and pair != "1->1":  # token-major across TP sizes
                p_tp = int(pair[0])
                reason = (
                    f"refused before anything moved: request 'd0': the prefill runs TP size {p_tp}, this decode "
                    f"{d_tp}, and this decode's KV cache cannot move across TP sizes: {LBNHC_ACROSS_TP}"
                )
                assert got["failures"] == [{"d0": reason}] * d_tp, (name, pair)
                assert got["load_errors"] == [[5, 6, 7]] * d_tp and got["bytes_match"] is False
            else:
                assert got["failures"] == [{}] * d_tp and got["load_errors"] == [[]] * d_tp, (name, pair, got)
                assert got["bytes_match"] is True, (name, pair)
            assert got["untouched"] is True, (name, pair)  # no other block of the decode was written
    flash = backends["FLASH_ATTN"]["1->1"]
    assert flash["supported"][0] == "LBNHC" and flash["layout"] == "LBHNC"  # what get_required_kvcache_layout did
    assert flash["stride"] == [16384, 4096, 128, 1]  # [16, 4, 32, 128]: head-major blocks
    assert backends["FLEX_ATTENTION"]["1->1"]["stride"] == [16384, 128, 512, 1]  # token-major: LBNHC only
    cpu_mla = backends["CPU_MLA"]["1->2"]
    assert (cpu_mla["shape"], cpu_mla["split"]) == ([32, 1, 16, 40], 2)  # 16 blocks of 32 tokens, kernels of 16


@pytest.fixture(scope="module", params=["nixl", "mooncake"])
def mla_pair(request: pytest.FixtureRequest, each_vllm_python: Path) -> Iterator[tuple[NodeProcess, NodeProcess]]:
    """A DeepSeek-V2 (MLA) prefill and decode on vLLM's CPU MLA backend, the layout vLLM's."""
    extra = _extra(request.param)
    prefill, decode = NodeProcess(each_vllm_python, "MLA prefill"), NodeProcess(each_vllm_python, "MLA decode")
    try:
        common = {"extra": extra, "mla": True, "attn_backend": "CPU_MLA"}
        started = prefill.call("start", role="prefill", **common)
        assert started["use_mla"] is True and started["layout"] == "LBNHC", started
        assert (started["kv_shape"], started["split"]) == ([128, 1, 16, 40], 2)  # a block is two kernel blocks
        decode.call("start", role="decode", filler_tokens=PROMPT, **common)
        yield prefill, decode
    finally:
        prefill.close()
        decode.close()


def test_an_mla_models_latent_blocks_move_byte_exact_between_two_vllm_processes(
    mla_pair: tuple[NodeProcess, NodeProcess],
) -> None:
    prefill, decode = mla_pair
    for i, n_tokens in enumerate((PROMPT, 2 * PROMPT + 7)):
        sent = prefill.call("prefill", req_id=f"p{i}", n_tokens=n_tokens, seed=31 + i)
        got = decode.call("decode", req_id=f"d{i}", n_tokens=n_tokens, params=sent["params"], timeout_s=60)
        assert got["finished_recving"] is True and got["failures"] == {}, got
        assert len(got["block_ids"]) == -(-n_tokens // 32)
        assert all(p != d for p, d in zip(sent["block_ids"], got["block_ids"], strict=True)), (sent, got)
        assert got["digests"] == sent["digests"] != got["digests_before"]  # per layer, per block
        assert got["invalid_block_ids"] == [] and got["status"] == "RUNNING"
        freed = prefill.call("step_until_sent", req_id=f"p{i}", timeout_s=30)
        assert freed == {"sent": True, "in_requests": False, "free_blocks": 63, "failures": []}


def _start_tp2_decode(python: Path, extra: dict[str, Any], env: dict[str, str], **model: Any) -> list[NodeProcess]:
    """Two decode ranks of one TP-2 engine (they meet in one gloo group: started together)."""
    decodes = [NodeProcess(python, f"TP-2 decode rank {r}", env=env) for r in range(2)]
    port = free_port_run(1)
    for r, node in enumerate(decodes):
        node.send({"cmd": "start", "role": "decode", "extra": extra, "filler_tokens": PROMPT, **model}
                  | {"tp_size": 2, "tp_rank": r, "dist_port": port}, 180)  # fmt: skip
    for node in decodes:
        node.read(180)
    return decodes


def test_an_mla_tp1_prefill_fills_each_rank_of_a_tp2_decode_with_the_whole_latent(each_vllm_python: Path) -> None:
    extra, model = _extra("nixl"), {"mla": True, "attn_backend": "CPU_MLA"}
    prefill = NodeProcess(each_vllm_python, "MLA TP-1 prefill")
    decodes: list[NodeProcess] = []
    try:
        prefill.call("start", role="prefill", extra=extra, **model)
        decodes = _start_tp2_decode(each_vllm_python, extra, node_env(), **model)
        sent = prefill.call("prefill", req_id="p0", n_tokens=PROMPT, seed=41)
        for node in decodes:
            got = node.call("decode", req_id="d0", n_tokens=PROMPT, params=sent["params"], timeout_s=60)
            assert got["finished_recving"] is True and got["failures"] == {}, got
            assert got["digests"] == sent["digests"] and got["invalid_block_ids"] == []
        freed = prefill.call("step_until_sent", req_id="p0", timeout_s=30)  # after both decode ranks' writes
        assert freed == {"sent": True, "in_requests": False, "free_blocks": 63, "failures": []}
    finally:
        for node in [prefill, *decodes]:
            node.close()


def test_a_forced_token_major_layout_moves_whole_blocks_between_equal_tp_sizes_and_is_refused_across(
    each_vllm_python: Path,
) -> None:
    env = {**node_env(), "VLLM_KV_CACHE_LAYOUT": "LBNHC"}  # an operator's override of the connector's LBHNC
    extra, model = _extra("nixl"), {"heads": 4}
    prefill = NodeProcess(each_vllm_python, "LBNHC prefill", env=env)
    decode = NodeProcess(each_vllm_python, "LBNHC decode", env=env)
    decodes: list[NodeProcess] = []
    try:
        started = prefill.call("start", role="prefill", extra=extra, **model)
        assert (started["layout"], started["kv_stride"]) == ("LBNHC", [16384, 128, 512, 1]), started
        decode.call("start", role="decode", extra=extra, filler_tokens=PROMPT, **model)
        sent = prefill.call("prefill", req_id="p0", n_tokens=PROMPT, seed=51)
        got = decode.call("decode", req_id="d0", n_tokens=PROMPT, params=sent["params"], timeout_s=60)
        assert got["finished_recving"] is True and got["failures"] == {} and got["digests"] == sent["digests"]
        decode.close()  # at most one engine pair at a time
        decodes = _start_tp2_decode(each_vllm_python, extra, env, **model)
        sent = prefill.call("prefill", req_id="p1", n_tokens=PROMPT, seed=52)
        for node in decodes:
            t0 = time.monotonic()
            got = node.call("decode", req_id="d1", n_tokens=PROMPT, params=sent["params"], timeout_s=60)
            assert time.monotonic() - t0 < LOAD_TIMEOUT_S  # refused at once, not timed out
            assert got["failures"] == {
                "d1": "refused before anything moved: request 'd1': the prefill runs TP size 1, this decode 2, and "
                f"this decode's KV cache cannot move across TP sizes: {LBNHC_ACROSS_TP}"
            }
            assert got["invalid_block_ids"] == sorted(got["block_ids"]) and got["digests"] == got["digests_before"]
            assert (got["status"], got["finish_reason"]) == ("gone", "error")
    finally:
        for node in [prefill, decode, *decodes]:
            node.close()
