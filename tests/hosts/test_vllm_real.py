"""vLLM 0.33.0's own connector machinery, on CPU, without a model or a GPU (tests/hosts/vllm).

The vLLM venv (``make_venv.sh``: vllm --no-deps, the local CPU torch wheel, pinned requirements, nixl, the
Mooncake engine, kvwire core and plugins) is built once and cached in ``.venv-vllm``. The probes run in it as
subprocesses with ``VLLM_TARGET_DEVICE=cpu`` and print one JSON object each:

* ``probe_factory.py``: ``KVConnectorFactory.create_connector`` loads the out-of-tree stub class
  (``stub_connector.KvwireConnector``) for both roles and every kv_role, from a ``VllmConfig`` without a
  model_config, and its worker receives the tensors vLLM's own ``allocate_kv_cache`` makes.
* ``probe_scheduler.py``: vLLM's real v1 ``Scheduler`` (tiny local model config, no weights) drives the stub's
  scheduler-side hooks for a producer and a consumer request.

What the kvwire connector must fit is written down in tests/hosts/vllm/README.md.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

# the first test also waits for a cold venv build (about 2-4 minutes; make_venv.sh may take up to 1800 s)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = Path(__file__).parent / "vllm"
ROOT = Path(__file__).parents[2]
STUB = "stub_connector.KvwireConnector"
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def _probe(python: Path, name: str) -> dict[str, Any]:
    env = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("PYTHONPATH", None)  # the venv's own site-packages only
    proc = subprocess.run(
        [str(python), str(HERE / name)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def test_vllms_factory_loads_an_out_of_tree_connector_for_both_roles_without_a_model(vllm_python: Path) -> None:
    result = _probe(vllm_python, "probe_factory.py")
    assert result["platform"] == "CpuPlatform" and result["torch"].endswith("+cpu")
    assert set(result["roles"]) == {"kv_producer", "kv_consumer", "kv_both"}
    for kv_role, entry in result["roles"].items():
        assert entry["model_config"] == "None", kv_role
        assert entry["disable_hybrid_kv_cache_manager"] is True  # CPU, and the stub is not SupportsHMA
        for role in ("SCHEDULER", "WORKER"):
            conn = entry[role]
            assert conn["class"] == STUB and conn["is_KVConnectorBase_V1"] and conn["role"] == role, (kv_role, conn)
            assert conn["extra"] == {"backend": "mooncake", "probe": True}
        # 2 layers x 8 blocks of [2 heads, 32 tokens, 2 x 64 dims] fp16, layer-outermost views into one buffer
        (tensor,) = entry["kv_cache_config"]["kv_cache_tensors"]
        assert tensor == {"size": 262144, "layers": LAYERS, "layer_stride": 131072, "block_stride": 16384, "offset": 0}
        caches = entry["WORKER"]["register_kv_caches"]
        assert list(caches) == LAYERS
        for i, name in enumerate(LAYERS):
            t = caches[name]
            assert (t["shape"], t["stride"], t["dtype"]) == ([8, 2, 32, 128], [8192, 4096, 128, 1], "torch.float16")
            assert t["same_storage_as_first"] and t["storage_nbytes"] == 262144
            assert t["data_ptr_minus_first"] == i * 131072
    # one process, class-level log: per kv_role a SCHEDULER and a WORKER instance, then the worker's registration
    assert [c[0] for c in result["calls"]] == ["__init__", "__init__", "register_kv_caches"] * 3
    assert [c[1] for c in result["calls"][:3]] == ["SCHEDULER", "WORKER", LAYERS]


def test_vllms_real_scheduler_drives_the_connectors_scheduler_hooks(vllm_python: Path) -> None:
    result = _probe(vllm_python, "probe_scheduler.py")
    producer, consumer = result["producer"], result["consumer"]
    assert "error" not in producer and "error" not in consumer, result
    assert producer["steps"][0] == {"connector_class": STUB}
    assert [c[0] for c in producer["calls"]] == [
        "__init__", "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
        "build_connector_meta", "request_finished", "build_connector_meta",
    ]  # fmt: skip
    # 40 prompt tokens in blocks of 16: 3 blocks (block 0 is vLLM's null block); request_finished gets them flat
    assert producer["calls"][3][1] == ["p0", [[1, 2, 3]], 0]
    assert producer["calls"][5][1] == ["p0", [1, 2, 3]]
    # consumer: 32 tokens claimed async -> WAITING_FOR_REMOTE_KVS; finished_recving -> scheduled from token 32
    assert [c[0] for c in consumer["calls"]] == [
        "__init__", "on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc",
        "build_connector_meta", "update_connector_output", "update_state_after_alloc", "build_connector_meta",
        "request_finished",
    ]  # fmt: skip
    assert consumer["calls"][3][1] == ["d0", [[1, 2]], 32]
    assert consumer["calls"][6][1] == ["d0", [[1, 2, 3]], 0]
    assert consumer["steps"][0]["status"] == "WAITING_FOR_REMOTE_KVS"
    assert consumer["steps"][2]["status"] == "RUNNING"
    assert consumer["steps"][2]["schedule_2"]["new"] == [["d0", [[1, 2, 3]], 32]]
    assert consumer["steps"][2]["schedule_2"]["num_scheduled_tokens"] == {"d0": 8}
