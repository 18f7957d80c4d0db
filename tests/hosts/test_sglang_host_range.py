"""kvwire-sglang inside sglang's own plugin loader: the supported release is replaced, another one refused.

sglang's ``load_plugins()`` (the call every sglang process makes at start) runs in the pinned sglang venv
(0.5.23), and with sglang 0.5.22's own wheel in front of it on ``PYTHONPATH``: the newest earlier release, and
one that has sglang's plugin framework (0.5.11 and later do; none before 0.5.23 has the manager hooks
kvwire-sglang needs, see README "Supported sglang releases"). On 0.5.22 the process stops with the reason
(sglang's loader swallows an ``Exception``, so kvwire-sglang raises ``SystemExit``); with
``KVWIRE_SGLANG_UNSUPPORTED=fallback`` it starts on sglang's own manager; with ``try`` it stops naming the hook
0.5.22 lacks.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from sglang_serving import PYTHON, build_venv

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sglang-servers"), pytest.mark.timeout(1800)]

LOAD = """
from sglang.srt.plugins import load_plugins
load_plugins()
import sglang.srt.disaggregation.mooncake.conn as conn
print("manager:", conn.MooncakeKVManager.__qualname__)
"""
EARLIER = "0.5.22"


def _load(overlay: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVWIRE_", "PYTHONPATH"))}
    full = {**clean, "SGLANG_PLUGINS": "kvwire", "SGLANG_USE_CPU_ENGINE": "1", **env}
    if overlay is not None:
        full["PYTHONPATH"] = str(overlay)
    return subprocess.run([PYTHON, "-c", LOAD], env=full, capture_output=True, text=True, timeout=600)


def test_sglangs_plugin_loader_replaces_the_manager_on_the_supported_release_only(
    sglang_release: Callable[[str], Path],
) -> None:
    build_venv()
    real = _load()
    assert real.returncode == 0 and real.stdout.splitlines()[-1] == "manager: KvwireKVManager", real.stderr[-2000:]
    earlier = sglang_release(EARLIER)
    refused = _load(earlier)
    assert refused.returncode == 1, refused.stdout
    assert refused.stderr.splitlines()[-1] == (
        f"kvwire-sglang: sglang {EARLIER} is not a release kvwire supports (tested: 0.5.23); install "
        "sglang==0.5.23, or set KVWIRE_SGLANG_UNSUPPORTED to fallback (run without kvwire) or try (use kvwire "
        "untested)"
    )
    fallback = _load(earlier, KVWIRE_SGLANG_UNSUPPORTED="fallback")
    assert fallback.returncode == 0, fallback.stderr[-2000:]
    assert fallback.stdout.splitlines()[-1] == "manager: MooncakeKVManager"
    tried = _load(earlier, KVWIRE_SGLANG_UNSUPPORTED="try")
    assert tried.returncode == 1, tried.stdout
    assert tried.stderr.splitlines()[-1] == (
        "kvwire-sglang: this sglang's MooncakeKVManager has no build_receiver_registration_message "
        "(kvwire-sglang needs sglang 0.5.23's); set KVWIRE_SGLANG_UNSUPPORTED=fallback to run on sglang's own "
        "Mooncake path"
    )
