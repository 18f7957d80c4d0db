"""Shared fixtures: test backend wheels installed into a throwaway directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import plugin_wheels  # next to this file: pytest puts this directory on sys.path for its conftest
from plugin_wheels import RunPy


@pytest.fixture(scope="session")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the installed test backend wheels (see plugin_wheels.VARIANTS)."""
    return plugin_wheels.build_and_install(tmp_path_factory.mktemp("kvtest-plugins"))


@pytest.fixture(scope="session")
def run_with_plugins(plugin_site: Path) -> RunPy:
    """Run ``python <args>`` in a fresh process that sees the test wheels' entry points."""

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
        full_env["PYTHONPATH"] = str(plugin_site)
        full_env.update(env or {})
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=full_env, timeout=120)

    return run
