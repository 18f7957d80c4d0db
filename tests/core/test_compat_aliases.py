"""The old import paths users' configurations hold still work, and give the very modules of the new ones."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("kvwire.compat.vllm", "kvwire.hosts.vllm"),
        ("kvwire.compat.vllm.settings", "kvwire.hosts.vllm.settings"),
        ("kvwire.compat.vllm.sending", "kvwire.hosts.vllm.sending"),
        ("kvwire.compat.sglang", "kvwire_sglang"),
        ("kvwire.compat.sglang.send", "kvwire_sglang.send"),
        ("kvwire.compat.activation", "kvwire.hosts.activation"),
        ("kvwire.compat.host_range", "kvwire.hosts.host_range"),
    ],
)
def test_an_old_module_path_is_the_new_module(old: str, new: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(new)


def test_names_reached_through_the_old_paths_are_the_same_objects() -> None:
    from kvwire.compat.sglang import SglangSender
    from kvwire.compat.vllm import ConnectorSettings
    from kvwire.compat.vllm.sending import Sender
    from kvwire.hosts.vllm import ConnectorSettings as Settings
    from kvwire.hosts.vllm.sending import Sender as NewSender
    from kvwire_sglang import SglangSender as NewSglangSender

    assert (ConnectorSettings, Sender, SglangSender) == (Settings, NewSender, NewSglangSender)


def test_an_unknown_old_name_is_the_usual_import_error() -> None:
    with pytest.raises(ModuleNotFoundError) as exc:
        importlib.import_module("kvwire.compat.nothing")
    assert exc.value.name == "kvwire.compat.nothing"


def test_the_old_transport_helpers_path_still_imports() -> None:
    import kvwire.submit
    import kvwire.transport

    assert {n: getattr(kvwire.submit, n) for n in kvwire.submit.__all__} == {
        n: getattr(kvwire.transport, n) for n in kvwire.submit.__all__
    }


def test_a_fresh_process_imports_the_old_vllm_path_first() -> None:
    """As vLLM's factory does: importlib.import_module on the configured path, nothing of kvwire imported before."""
    code = (
        "import importlib, sys; m = importlib.import_module('kvwire.compat.vllm'); "
        "print(m.__name__, sys.modules['kvwire.compat.vllm'] is sys.modules['kvwire.hosts.vllm'])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "kvwire.hosts.vllm True"
