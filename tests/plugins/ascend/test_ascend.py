"""kvwire-ascend on a CPU machine: validates, explains itself, refuses split destinations, moves
bytes through the host-memory engine double."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import kvwire
from kvwire import BackendConfig
from kvwire.testing.contract import *  # noqa: F403 - the contract suite, through the engine double

DOUBLE = BackendConfig(options={"engine": "host-double"})


@pytest.fixture(scope="session")
def kvwire_backend_name() -> str:
    return "ascend"


@pytest.fixture(scope="session")
def kvwire_backend_config() -> BackendConfig:
    return DOUBLE


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)


def test_discovery_and_validation_import_no_torch_npu_and_no_engine() -> None:
    proc = _python(
        "import sys, kvwire\n"
        "infos = {i.name: i for i in kvwire.Registry(allow=['ascend']).load()}\n"
        "print(infos['ascend'].status, 'torch_npu' in sys.modules, 'torch' in sys.modules, 'mooncake' in sys.modules)"
    )
    assert proc.stdout.split() == ["ok", "False", "False", "False"], proc.stderr


def test_check_shows_ok_with_the_reason_it_cannot_run_here() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire", "check", "--json", "--backends", "ascend"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    (entry,) = [e for e in json.loads(proc.stdout) if e["name"] == "ascend"]
    expected = ("ok", "kvwire-ascend", kvwire.SPEC_VERSION)
    assert (entry["status"], entry["distribution"], entry["spec_version"]) == expected
    assert "device_kv_indices" not in entry["capabilities"]
    assert entry["runtime"].startswith("unavailable: torch_npu is not installed (pip install 'kvwire-ascend[npu]'")
    table = subprocess.run(
        [sys.executable, "-m", "kvwire", "check", "--backends", "ascend"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    ).stdout
    assert "    unavailable: torch_npu is not installed" in table


def test_creating_it_without_npu_says_what_is_missing() -> None:
    with pytest.raises(kvwire.BackendUnavailableError) as exc:
        kvwire.connect("ascend")
    message = str(exc.value)
    assert message.startswith("backend 'ascend' (kvwire-ascend) cannot run on this machine: torch_npu is not installed")
    assert "CANN is not set up" in message


def test_requiring_split_destinations_fails_at_connect_naming_hisparse() -> None:
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        kvwire.connect("ascend", DOUBLE, features={"device_kv_indices"})
    message = str(exc.value)
    assert message.startswith(
        f"backend 'ascend' (kvwire-ascend, spec {kvwire.SPEC_VERSION}) does not support required feature(s) "
        "['device_kv_indices']; backends that support them: "
    )
    assert "hisparse (kvwire-hisparse)" in message  # and any other installed backend that declares it
    assert "local (kvwire)" in message


def test_direct_call_with_device_indices_is_refused_before_anything_moves() -> None:
    from kvwire_ascend.backend import AscendBackend

    backend = AscendBackend(DOUBLE)
    idx = np.array([0], np.int32)
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        backend.send_kvcache("nowhere:1", idx, [1], idx, None, None, idx)
    assert str(exc.value) == (
        "backend 'AscendBackend' does not support 'device_kv_indices', needed for dst_device_kv_indices; nothing "
        "was sent. Use a backend that supports it (pip install kvwire-hisparse)"
    )
    backend.close()


def test_unknown_engine_option_is_a_config_error() -> None:
    with pytest.raises(kvwire.ConfigError, match=r"BackendConfig.options\['engine'\] must be one of"):
        kvwire.connect("ascend", BackendConfig(options={"engine": "npu-sim"}))


def test_default_install_pulls_neither_torch_npu_nor_an_npu_engine() -> None:
    from importlib.metadata import requires

    requirements = requires("kvwire-ascend") or []
    default = [r for r in requirements if "extra ==" not in r]
    npu = [r for r in requirements if 'extra == "npu"' in r]
    assert not any(name in r for r in default for name in ("torch", "mooncake-transfer-engine"))
    assert any(r.startswith("torch-npu") and "<2.14" in r for r in npu), npu
    assert any(r.startswith("torch") and "<2.14" in r and not r.startswith("torch-npu") for r in npu), npu
    assert any(r.startswith("mooncake-transfer-engine-npu") for r in npu), npu
