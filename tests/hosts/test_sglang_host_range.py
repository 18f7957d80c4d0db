"""kvwire-sglang inside sglang's own plugin loader: the supported release is replaced, another one refused.

sglang's ``load_plugins()`` (the call every sglang process makes at start) runs in the pinned sglang venv,
with the installed version read by kvwire seen as 0.5.22 for the refusal: the process stops with the
reason (sglang's loader swallows an ``Exception``, so kvwire-sglang raises ``SystemExit``); with
``KVWIRE_SGLANG_UNSUPPORTED=fallback`` it starts on sglang's own manager, with ``try`` on kvwire's.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from sglang_serving import PYTHON, build_venv

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sglang-servers"), pytest.mark.timeout(1800)]

LOAD = """
import sys
import kvwire.hosts.host_range as host_range
if sys.argv[1] != "real":
    host_range.version = lambda name: sys.argv[1] if name == "sglang" else "?"
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.disaggregation.mooncake.conn as conn
print("manager:", conn.MooncakeKVManager.__qualname__)
"""


def _load(version: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    full = {**clean, "SGLANG_PLUGINS": "kvwire", "SGLANG_USE_CPU_ENGINE": "1", **env}
    return subprocess.run([PYTHON, "-c", LOAD, version], env=full, capture_output=True, text=True, timeout=600)


def test_sglangs_plugin_loader_replaces_the_manager_on_the_supported_release_only() -> None:
    build_venv()
    real = _load("real")
    assert real.returncode == 0 and real.stdout.splitlines()[-1] == "manager: KvwireKVManager", real.stderr[-2000:]
    refused = _load("0.5.22")
    assert refused.returncode == 1, refused.stdout
    assert refused.stderr.splitlines()[-1] == (
        "kvwire-sglang: sglang 0.5.22 is not a release kvwire supports (tested: 0.5.23); install sglang==0.5.23, "
        "or set KVWIRE_SGLANG_UNSUPPORTED to fallback (run without kvwire) or try (use kvwire untested)"
    )
    fallback = _load("0.5.22", KVWIRE_SGLANG_UNSUPPORTED="fallback")
    assert fallback.returncode == 0 and fallback.stdout.splitlines()[-1] == "manager: MooncakeKVManager"
    tried = _load("0.5.22", KVWIRE_SGLANG_UNSUPPORTED="try")
    assert tried.returncode == 0 and tried.stdout.splitlines()[-1] == "manager: KvwireKVManager"
