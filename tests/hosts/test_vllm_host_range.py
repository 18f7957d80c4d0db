"""The vLLM connector in the pinned vLLM venv: supported on vLLM 0.32.0 and 0.33.0, refused on another release
unless ``try``.

The release kvwire reads is seen as 0.34.0 for the refusal (a newer release: its CUDA torch 2.14 pin is more than
this CPU machine installs); the check comes first in the connector's
constructor, so vLLM fails at start with the reason, before any config is read.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

BUILD = """
import sys
import kvwire.hosts.host_range as host_range
from kvwire.hosts.vllm.connector import KvwireConnector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
host_range.version = lambda name: sys.argv[1] if name == "vllm" else "?"
try:
    KvwireConnector(None, KVConnectorRole.SCHEDULER)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def _build(python: Path, version: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    proc = subprocess.run(
        [str(python), "-c", BUILD, version], env={**clean, **env}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()[-1]


def test_the_connector_refuses_an_unsupported_vllm_unless_told_to_try(vllm_python: Path) -> None:
    assert _build(vllm_python, "0.34.0") == (
        "UnsupportedHostError vllm 0.34.0 is not a release kvwire supports (tested: 0.32.0, 0.33.0); install "
        "vllm==0.33.0, or set KVWIRE_VLLM_UNSUPPORTED to try (use kvwire untested)"
    )
    # past the check (the supported release, or "try"), the constructor goes on to read vLLM's config
    for version, env in (("0.33.0", {}), ("0.34.0", {"KVWIRE_VLLM_UNSUPPORTED": "try"})):
        assert (
            _build(vllm_python, version, **env)
            == "AttributeError 'NoneType' object has no attribute 'kv_transfer_config'"
        )


RESOLVE = """
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
import kvwire.hosts.vllm
for path in ("kvwire.hosts.vllm", "kvwire.compat.vllm"):
    config = KVTransferConfig(kv_connector="KvwireConnector", kv_connector_module_path=path, kv_role="kv_producer")
    cls = KVConnectorFactory.get_connector_class(config)
    print(path, cls.__module__, cls is kvwire.hosts.vllm.KvwireConnector)
"""


def test_vllms_factory_finds_the_connector_by_its_module_path_and_by_the_old_one(vllm_python: Path) -> None:
    """Users' configs name kv_connector_module_path="kvwire.compat.vllm": it still resolves, to the same class."""
    proc = subprocess.run([str(vllm_python), "-c", RESOLVE], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-2:] == [
        "kvwire.hosts.vllm kvwire.hosts.vllm.connector True",
        "kvwire.compat.vllm kvwire.hosts.vllm.connector True",
    ]
