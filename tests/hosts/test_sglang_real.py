"""kvwire inside sglang 0.5.23's own prefill/decode code, two processes on 127.0.0.1 (tests/hosts/sglang).

Each side runs sglang's ``ServerArgs``, Mooncake engine (TCP), bootstrap server, the manager class that
sglang's ``get_kv_class`` returns, its sender, receiver and ``transfer_worker``, with CPU pools of random
bytes. In ``kvwire`` mode ``SGLANG_PLUGINS=kvwire`` and sglang's own ``load_plugins()`` install
kvwire-sglang's manager; every byte is checked on the decode side, and every page outside the request.
The sglang venv (``make_venv.sh``, --no-deps, pinned) is built once and cached.
"""

from __future__ import annotations

import importlib.util
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
