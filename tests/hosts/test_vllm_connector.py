"""kvwire's vLLM connector (``kvwire.hosts.vllm.KvwireConnector``) run by vLLM's own classes, on CPU.

Once per supported release (0.32.0 and 0.33.0: ``each_vllm_python``), each in its cached venv (``.venv-vllm``,
``.venv-vllm-0.32.0``) (see ``test_vllm_real.py`` and tests/hosts/vllm/README.md):

* ``probe_kvwire_connector.py`` (one process): ``KVConnectorFactory`` builds the connector for both roles
  from a real ``VllmConfig``; the worker maps and registers what vLLM's ``allocate_kv_cache`` returns; vLLM's
  real v1 ``Scheduler`` drives the scheduler-side hooks for a prefill and a decode request.
* ``pd_node.py`` (two processes, a prefill and a decode): real Scheduler, connector through the factory,
  KV cache from ``allocate_kv_cache``, worker hooks through vLLM's own model-runner mixin; the prefill's
  "forward" writes random bytes into its blocks, and every block is compared byte for byte (sha256 per
  block and layer) on the decode, whose block ids differ from the prefill's. Through kvwire-mooncake and
  kvwire-nixl; then the failures: a bad block id refused before anything moves, a killed prefill.
* Across TP sizes: a TP-1 prefill and a TP-2 decode (two ``pd_node.py`` processes, one per TP rank, in one
  gloo group), 4 KV heads: each decode rank's blocks hold exactly its two heads of the prefill's blocks
  (sha256 per block, layer and head).
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

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = Path(__file__).parent / "vllm"
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
PROMPT = 100  # tokens: 4 blocks of 32
LOAD_TIMEOUT_S = 8.0


def _free_port() -> int:
    return free_port_run(4)  # a side channel per prefill TP rank: port + rank


def _extra(backend: str, port: int) -> dict[str, Any]:
    return {"backend": backend, "side_channel_port": port, "load_timeout_s": LOAD_TIMEOUT_S, "transfer_timeout_s": 5}


def test_vllms_factory_and_scheduler_run_the_kvwire_connector(each_vllm_python: Path) -> None:
    env = {**node_env(), "PROBE_SIDE_PORT": str(_free_port())}
    proc = subprocess.run(
        [str(each_vllm_python), str(HERE / "probe_kvwire_connector.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    factory, sched = result["factory"], result["scheduler"]
    assert "error" not in factory and "error" not in sched, result
    for role in ("SCHEDULER", "WORKER"):
        assert factory[role] == {
            "class": "kvwire.hosts.vllm.connector.KvwireConnector",
            "is_KVConnectorBase_V1": True,
            "role": role,
            "backend": "mooncake",
        }
    # one whole-block buffer per layer, at vLLM's layer stride in the one shared allocation
    assert factory["layout"] == {
        "buffers": [[0, 16384, 8, 0, "kv", "host"], [131072, 16384, 8, 1, "kv", "host"]],
        "layer_names": LAYERS,
        "backend": "mooncake",
        "producer": True,
        "consumer": True,
    }
    assert factory["missing_backend"] == [
        "kvwire.errors.ConfigError",
        'kv_connector_extra_config[\'backend\'] must name a kvwire backend (e.g. "mooncake" or "nixl"), got None',
    ]
    assert factory["bad_shape"] == [
        "kvwire.layout.buffers.LayoutError",
        "layer 'model.layers.0.self_attn.attn' (shape [2, 8, 2, 32, 128], stride [65536, 8192, 4096, 128, 1]): "
        "expected vLLM's [num_blocks, num_kv_heads, block_size, head_size + head_size_v] KV tensor (or an MLA "
        "latent [num_blocks, block_size, latent]); other KV-cache shapes (a raw buffer, a leading K/V dimension of "
        "2) are not supported",
    ]
    # the producer keeps its blocks and hands the decode's params; the next schedule() tells its workers
    params = sched["producer_params"]
    assert params["remote_block_ids"] == [1, 2, 3] and params["remote_request_id"] == "p0"
    assert params["do_remote_prefill"] is True and params["kvwire"] == 1 and params["remote_num_tokens"] == 40
    assert sched["producer_status"] == "FINISHED_LENGTH_CAPPED" and sched["producer_pending_push_work"] is True
    assert sched["producer_first_meta"] == "StepMetadata(to_send=(), to_receive=())"
    assert sched["producer_second_meta"] == (
        "StepMetadata(to_send=(ReadyToSend(request_id='p0', block_ids=(1, 2, 3)),), to_receive=())"
    )
    # the consumer waits for the remote KV, its own block ids recorded against the prefill's
    assert sched["consumer_status"] == "WAITING_FOR_REMOTE_KVS"
    # which free blocks vLLM hands out is its allocator's business (0.32.0 and 0.33.0 differ): three of them,
    # none the local request holds, and exactly those in the step's metadata
    (blocks,) = sched["consumer_blocks"]
    assert len(blocks) == 3 == len(set(blocks)) and 0 not in blocks, sched
    assert not set(blocks) & set(sched["filler_blocks"][0]), sched
    assert (
        f"ToReceive(request_id='d0', block_ids={tuple(blocks)}, remote=RemotePrefill(request_id='p0'"
        in (sched["consumer_meta"])
    )
    # params another connector wrote are refused: the decode computes that prompt itself
    assert sched["foreign_params_status"] == "RUNNING" and sched["foreign_params_scheduled"] == 40


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def pair(request: pytest.FixtureRequest, each_vllm_python: Path) -> Iterator[tuple[NodeProcess, NodeProcess, str]]:
    """A prefill and a decode node over one backend; the decode holds a local request's blocks first."""
    backend = request.param
    extra = _extra(backend, _free_port())
    prefill, decode = (
        NodeProcess(each_vllm_python, f"{backend} prefill"),
        NodeProcess(each_vllm_python, f"{backend} decode"),
    )
    try:
        started = prefill.call("start", role="prefill", extra=extra)
        # FlashAttention's layout, resolved by vLLM with the connector's wish (LBNHC without it): head-major
        assert started["attn_backend"] == "vllm.v1.attention.backends.flash_attn.FlashAttentionBackend"
        assert (started["layout"], started["kv_stride"]) == ("LBHNC", [8192, 4096, 128, 1]), started
        decode.call("start", role="decode", extra=extra, filler_tokens=PROMPT)
        yield prefill, decode, backend
    finally:
        prefill.close()
        decode.close()


def test_blocks_move_byte_exact_between_two_vllm_processes(pair: tuple[NodeProcess, NodeProcess, str]) -> None:
    prefill, decode, _ = pair
    for i, n_tokens in enumerate((PROMPT, 2 * PROMPT + 7)):
        sent = prefill.call("prefill", req_id=f"p{i}", n_tokens=n_tokens, seed=11 + i)
        got = decode.call("decode", req_id=f"d{i}", n_tokens=n_tokens, params=sent["params"], timeout_s=60)
        assert got["finished_recving"] is True and got["failures"] == {}, got
        assert len(sent["block_ids"]) == -(-n_tokens // 32) == len(got["block_ids"])
        # every block lands on another id than the prefill's (the decode's local request holds blocks first)
        assert all(p != d for p, d in zip(sent["block_ids"], got["block_ids"], strict=True)), (sent, got)
        assert got["digests"] == sent["digests"]  # per layer, per block
        assert got["digests"] != got["digests_before"]
        assert got["invalid_block_ids"] == [] and got["status"] == "RUNNING"
        freed = prefill.call("step_until_sent", req_id=f"p{i}", timeout_s=30)
        assert freed == {"sent": True, "in_requests": False, "free_blocks": 63, "failures": []}


@pytest.mark.parametrize(
    ("tamper", "message"),
    [
        (lambda ids: [ids[0], 63, *ids[2:]], "prefill_block_ids [{0}, 63, {2}, {3}] are not the blocks request "
         "'{req}' holds ([{0}, {1}, {2}, {3}], or their tail); nothing was sent"),
        (lambda ids: [*ids[:3], 6400], "prefill_block_ids[3] = 6400 is not a block of this KV cache: ids run 1..63 "
         "(block 0 is vLLM's null block)"),
    ],
)  # fmt: skip
def test_a_bad_block_id_is_refused_before_anything_moves(
    pair: tuple[NodeProcess, NodeProcess, str], tamper: Any, message: str
) -> None:
    prefill, decode, _ = pair
    req = f"bad{_free_port()}"
    sent = prefill.call("prefill", req_id=req, n_tokens=PROMPT, seed=3)
    ids = sent["block_ids"]
    params = dict(sent["params"], remote_block_ids=tamper(ids))
    t0 = time.monotonic()
    got = decode.call("decode", req_id="d" + req, n_tokens=PROMPT, params=params, timeout_s=60)
    assert time.monotonic() - t0 < LOAD_TIMEOUT_S  # refused at once, not timed out
    assert got["finished_recving"] is True
    assert got["digests"] == got["digests_before"]  # nothing moved
    assert got["invalid_block_ids"] == sorted(got["block_ids"])
    reason = message.format(*ids, req=req)
    assert got["failures"] == {
        "d" + req: "the prefill did not take the registration: the prefill's kvwire side channel failed: " + reason
    }
    assert (got["status"], got["finish_reason"]) == ("gone", "error")  # vLLM's kv_load_failure_policy "fail"
    # the prefill keeps the request's blocks for its real decode until the lease ends; release them now
    good = decode.call("decode", req_id="g" + req, n_tokens=PROMPT, params=sent["params"], timeout_s=60)
    assert good["digests"] == sent["digests"] and good["failures"] == {}
    assert prefill.call("step_until_sent", req_id=req, timeout_s=30)["sent"] is True


def test_a_killed_prefill_leaves_the_decodes_blocks_as_load_errors_in_bounded_time(
    each_vllm_python: Path,
) -> None:
    extra = _extra("mooncake", _free_port())
    prefill, decode = NodeProcess(each_vllm_python, "prefill"), NodeProcess(each_vllm_python, "decode")
    try:
        prefill.call("start", role="prefill", extra=extra)
        decode.call("start", role="decode", extra=extra, filler_tokens=PROMPT)
        sent = prefill.call("prefill", req_id="k0", n_tokens=PROMPT, seed=9)
        prefill.kill()
        t0 = time.monotonic()
        got = decode.call("decode", req_id="dk0", n_tokens=PROMPT, params=sent["params"], timeout_s=60)
        assert time.monotonic() - t0 < LOAD_TIMEOUT_S + 5
        assert got["finished_recving"] is True
        assert got["invalid_block_ids"] == sorted(got["block_ids"])
        assert got["digests"] == got["digests_before"]
        (reason,) = got["failures"].values()
        assert reason.startswith("the prefill did not take the registration: the prefill's kvwire side channel at ")
        assert "could not be reached" in reason
        assert (got["status"], got["finish_reason"]) == ("gone", "error")
    finally:
        prefill.close()
        decode.close()


def test_a_tp1_prefill_fills_a_tp2_decode_head_by_head(each_vllm_python: Path) -> None:
    extra = _extra("nixl", _free_port())
    prefill = NodeProcess(each_vllm_python, "TP-1 prefill")
    decodes = [NodeProcess(each_vllm_python, f"TP-2 decode rank {r}") for r in range(2)]
    try:
        prefill.call("start", role="prefill", extra=extra, heads=4)
        dist_port = _free_port()
        for r, node in enumerate(decodes):  # the two ranks meet in one gloo group: start them together
            node.send(
                {"cmd": "start", "role": "decode", "extra": extra, "filler_tokens": PROMPT, "heads": 4}
                | {"tp_size": 2, "tp_rank": r, "dist_port": dist_port},
                180,
            )
        for node in decodes:
            node.read(180)
        sent = prefill.call("prefill", req_id="p0", n_tokens=PROMPT, seed=21)
        want = prefill.call("head_digests", block_ids=sent["block_ids"])["digests"]
        assert all(len(blocks) == 4 and len(set(blocks[0])) == 4 for blocks in want.values())  # 4 distinct heads
        assert sent["params"]["tp_size"] == 1
        for r, node in enumerate(decodes):
            got = node.call("decode", req_id="d0", n_tokens=PROMPT, params=sent["params"], timeout_s=60)
            assert got["finished_recving"] is True and got["failures"] == {}, got
            assert got["invalid_block_ids"] == [] and got["status"] == "RUNNING"
            assert not set(sent["block_ids"]) & set(got["block_ids"])  # every block lands on a different id
            heads = node.call("head_digests", block_ids=got["block_ids"])["digests"]
            assert heads == {layer: [b[2 * r : 2 * r + 2] for b in want[layer]] for layer in LAYERS}
        freed = prefill.call("step_until_sent", req_id="p0", timeout_s=30)  # after both decode ranks' writes
        assert freed == {"sent": True, "in_requests": False, "free_blocks": 63, "failures": []}
    finally:
        for node in [prefill, *decodes]:
            node.close()
