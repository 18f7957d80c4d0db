"""Every entry point reads kvwire's configuration: ``connect()``, ``kvwire bench``, ``kvwire check``,
``kvwire config``, the sglang plugin's manager and the vLLM connector's settings.

Each is run with a ``KVWIRE_*`` variable, a file (``$KVWIRE_CONFIG``) and a bad value: the value is used, or
start-up stops with a :class:`kvwire.ConfigError` naming the variable or the file. (The sglang plugin inside
sglang's own server: tests/hosts/test_sglang_serving_tp.py.)
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire import BackendConfig, ConfigError, KVLayout, resolve_config
from kvwire.hosts.vllm.settings import ConnectorSettings
from kvwire_sglang.manager import KvwireManagerMixin
from kvwire_sglang.registration import Published

KVWIRE = [sys.executable, "-m", "kvwire"]
BAD_TIMEOUT = "$KVWIRE_TIMEOUT_S='five' is not a number; write e.g. KVWIRE_TIMEOUT_S=5"


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No ``KVWIRE_*`` configuration variable from the outside."""
    for var in list(os.environ):
        if var.startswith("KVWIRE_") and var not in ("KVWIRE_BACKENDS", "KVWIRE_POLICY", "KVWIRE_TEST_CACHE"):
            monkeypatch.delenv(var)
    return monkeypatch


def _file(tmp_path: Path, text: str = "timeout_s = 7\nhost = '127.0.0.2'\n[options]\nstreams = 2\n") -> Path:
    path = tmp_path / "kvwire.toml"
    path.write_text(text)
    return path


def _cli(*argv: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_") or k == "KVWIRE_TEST_CACHE"}
    return subprocess.run([*KVWIRE, *argv], env={**base, **env}, capture_output=True, text=True, timeout=300)


# -- kvwire.connect() ---------------------------------------------------------------------------------------


def test_connect_without_a_config_reads_the_variables_and_the_file(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv("KVWIRE_CONFIG", str(_file(tmp_path)))
    clean_env.setenv("KVWIRE_TIMEOUT_S", "3")
    conn = kvwire.connect("local")
    try:
        assert conn.config.timeout_s == 3  # the variable over the file
        assert conn.config.host == "127.0.0.2" and dict(conn.config.options) == {"streams": 2}  # the file
    finally:
        conn.close()


def test_connect_with_a_config_uses_it_as_given(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KVWIRE_TIMEOUT_S", "3")
    conn = kvwire.connect("local", BackendConfig(timeout_s=9))
    try:
        assert conn.config.timeout_s == 9
    finally:
        conn.close()


def test_connect_refuses_a_bad_variable_or_a_missing_file(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv("KVWIRE_TIMEOUT_S", "five")
    with pytest.raises(ConfigError) as exc:
        kvwire.connect("local")
    assert str(exc.value) == BAD_TIMEOUT
    clean_env.delenv("KVWIRE_TIMEOUT_S")
    clean_env.setenv("KVWIRE_CONFIG", "/nonexistent/kvwire.toml")
    with pytest.raises(ConfigError) as exc:
        kvwire.connect("local")
    assert str(exc.value).startswith("config file /nonexistent/kvwire.toml ($KVWIRE_CONFIG) cannot be read")


# -- resolve_config and `kvwire config` ---------------------------------------------------------------------


def test_resolve_config_names_the_source_of_every_value(tmp_path: Path) -> None:
    path = _file(tmp_path)
    resolved = resolve_config(env={"KVWIRE_CONFIG": str(path), "KVWIRE_TIMEOUT_S": "3"}, verbose=True)
    assert resolved.config == BackendConfig(host="127.0.0.2", timeout_s=3, verbose=True, options={"streams": 2})
    assert resolved.sources["timeout_s"] == "$KVWIRE_TIMEOUT_S"
    assert resolved.sources["host"] == resolved.sources["options.streams"] == f"config file {path}"
    assert resolved.sources["verbose"] == "argument verbose="
    assert resolved.sources["protocol"] == "the default"


def test_kvwire_config_prints_each_value_and_its_source(tmp_path: Path) -> None:
    path = _file(tmp_path)
    proc = _cli("config", env={"KVWIRE_CONFIG": str(path), "KVWIRE_TIMEOUT_S": "3"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "timeout_s        = 3.0             ($KVWIRE_TIMEOUT_S)" in lines, lines
    assert f'host             = "127.0.0.2"     (config file {path})' in lines, lines
    assert f"options.streams  = 2               (config file {path})" in lines, lines
    assert 'protocol         = "tcp"           (the default)' in lines, lines
    data = json.loads(_cli("config", "--json", "--file", str(path), env={}).stdout)
    assert data["config"]["timeout_s"] == 7 and data["sources"]["timeout_s"] == f"config file {path}"


def test_kvwire_config_and_check_stop_on_a_bad_value() -> None:
    for command in (["config"], ["check", "--backends", "local"]):
        proc = _cli(*command, env={"KVWIRE_TIMEOUT_S": "five"})
        assert proc.returncode == 2, (command, proc.stdout, proc.stderr)
        assert proc.stderr == f"kvwire {command[0]}: error: {BAD_TIMEOUT}\n"
        assert proc.stdout == ""


# -- kvwire bench -------------------------------------------------------------------------------------------

BENCH = ["bench", "--backend", "mooncake", "--requests", "1", "--tokens", "256", "--json"]


def test_bench_runs_with_the_variables_the_file_and_its_flags_above_them(tmp_path: Path) -> None:
    pytest.importorskip("kvwire_mooncake")
    proc = _cli(*BENCH, env={"KVWIRE_CONFIG": str(_file(tmp_path, "timeout_s = 7\n")), "KVWIRE_TIMEOUT_S": "6"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    used = json.loads(proc.stdout)["backend_config"]
    assert used["config"]["timeout_s"] == 6 and used["sources"]["timeout_s"] == "$KVWIRE_TIMEOUT_S"
    assert used["config"]["process_settings"] is True  # the CLI's own setting
    proc = _cli(*BENCH, "--timeout", "5", env={"KVWIRE_TIMEOUT_S": "6"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    used = json.loads(proc.stdout)["backend_config"]
    assert used["config"]["timeout_s"] == 5 and used["sources"]["timeout_s"] == "argument timeout_s="


def test_bench_stops_before_the_run_on_a_bad_variable_or_a_missing_file() -> None:
    pytest.importorskip("kvwire_mooncake")
    for env, message in (
        ({"KVWIRE_TIMEOUT_S": "five"}, BAD_TIMEOUT),
        (
            {"KVWIRE_CONFIG": "/nonexistent.toml"},
            "config file /nonexistent.toml ($KVWIRE_CONFIG) cannot be read: No such file or directory",
        ),
    ):
        proc = _cli(*BENCH, env=env)
        assert (proc.returncode, proc.stdout) == (2, ""), proc.stderr
        assert proc.stderr.endswith(f"kvwire bench: error: {message}\n"), proc.stderr


# -- the sglang plugin's manager ----------------------------------------------------------------------------


class _SglangManager:
    """What sglang's ``MooncakeKVManager.init_engine`` leaves behind: its engine, and the server's arguments."""

    server_args = SimpleNamespace(enable_metrics=False, disaggregation_mode="prefill")

    def init_engine(self) -> None:
        self.engine = SimpleNamespace(engine=object())


class _Manager(KvwireManagerMixin, _SglangManager):  # type: ignore[misc]
    kvwire_backend = "local"

    def kvwire_local_layout(self) -> KVLayout:
        self.pool = np.zeros((4, 64), np.uint8)
        return KVLayout.mla([self.pool])


def test_the_sglang_managers_connection_reads_kvwires_configuration(
    clean_env: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _file(tmp_path)
    clean_env.setenv("KVWIRE_CONFIG", str(path))
    clean_env.setenv("KVWIRE_TIMEOUT_S", "3")
    manager: Any = _Manager()
    with caplog.at_level(logging.INFO, logger="kvwire"):
        manager.init_engine()
    (line,) = [r.getMessage() for r in caplog.records if "active in sglang" in r.getMessage()]
    assert line.endswith(
        f"; configured: host='127.0.0.2' (config file {path}), timeout_s=3.0 ($KVWIRE_TIMEOUT_S), "
        f"options.streams=2 (config file {path})"
    ), line
    try:
        config = manager.kvwire_connection.config
        assert config.timeout_s == 3 and config.host == "127.0.0.2"
        # sglang's own engine and memory above anything the sources say
        assert config.options["engine"] is manager.engine.engine and config.options["host_registered"] is True
        assert config.options["streams"] == 2
    finally:
        manager.kvwire_connection.close()
    clean_env.setenv("KVWIRE_TIMEOUT_S", "five")
    with pytest.raises(ConfigError) as exc:
        _Manager().init_engine()
    assert str(exc.value) == BAD_TIMEOUT


# -- the vLLM connector's settings --------------------------------------------------------------------------


def test_the_vllm_connector_reads_kvwires_configuration_under_its_extra_config(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv("KVWIRE_CONFIG", str(_file(tmp_path)))
    clean_env.setenv("KVWIRE_TIMEOUT_S", "3")
    settings = ConnectorSettings.from_extra_config({"backend": "nixl"})
    assert settings.backend_config.timeout_s == 3 and settings.backend_config.host == "127.0.0.2"
    given = {"backend": "nixl", "transfer_timeout_s": 4, "host": "10.0.0.9", "backend_options": {"lanes": 1}}
    config = ConnectorSettings.from_extra_config(given).backend_config
    assert (config.timeout_s, config.host, dict(config.options)) == (4, "10.0.0.9", {"streams": 2, "lanes": 1})
    clean_env.setenv("KVWIRE_TIMEOUT_S", "five")
    with pytest.raises(ConfigError) as exc:
        ConnectorSettings.from_extra_config({"backend": "nixl"})
    assert str(exc.value) == BAD_TIMEOUT


def test_the_vllm_worker_logs_one_activation_line_naming_what_configured_it(
    clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    torch = pytest.importorskip("torch")
    from kvwire.hosts.vllm.settings import EngineSide
    from kvwire.hosts.vllm.worker import WorkerSide

    clean_env.setenv("KVWIRE_TIMEOUT_S", "3")
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": 1, "lease_s": 60})
    raw = torch.zeros(2 * 4 * 4096, dtype=torch.int8)  # 2 layers x 4 blocks, LBHNC: 2 heads x 16 tokens x 64 fp16
    caches = {
        f"model.layers.{i}.self_attn.attn": torch.as_strided(
            raw, (4, 2, 16, 128), (4096, 2048, 128, 1), i * 4 * 4096
        ).view(torch.float16)
        for i in range(2)
    }
    worker = WorkerSide(EngineSide(settings, 1, producer=False, consumer=True), 0)
    with caplog.at_level(logging.INFO, logger="kvwire"):
        worker.register_kv_caches(caches)
    try:
        (line,) = [r.getMessage() for r in caplog.records if "active in vllm" in r.getMessage()]
        v = kvwire.__version__  # 'local' is kvwire's own; vLLM is not installed here ('?')
        assert line.startswith(f"kvwire {v} active in vllm ? (kv_consumer): backend 'local' (kvwire {v}, spec "), line
        assert "2 layers x 4 head-major blocks of 4096 bytes, TP 0/1" in line, line
        assert line.endswith("; configured: timeout_s=3.0 ($KVWIRE_TIMEOUT_S)"), line
    finally:
        worker.shutdown()


# -- a decode's registration never raises out of sglang's hooks ----------------------------------------------


class _PrefillBase:
    """sglang's prefill-side registration hook, as the mixin calls it."""

    def _publish_peer_registration(self, session_id: str, decode_kv_args: Any) -> str:
        return "sglang's verdict"


class _Prefill(KvwireManagerMixin, _PrefillBase):  # type: ignore[misc]
    pass


@pytest.mark.parametrize(
    ("session", "ptrs", "message"),
    [
        ("s1", ["zz"], "decode session s1: ValueError: invalid literal for int() with base 10: 'zz'; sends to it"),
        ("s2", [object()], "decode session s2: TypeError: int() argument must be a string"),
        ("s" * 5000, [1], "decode session " + "s" * 200 + ": published buffers at"),
    ],
)
def test_whatever_a_decode_registers_sglangs_hook_returns_its_verdict(
    session: str, ptrs: list[Any], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    pool = np.zeros((4, 64), np.uint8)
    manager: Any = _Prefill()
    manager.kvwire_connection = kvwire.connect("local", BackendConfig())
    manager._kvwire_lock = threading.Lock()
    manager._kvwire_registered = {session: Published(KVLayout.mla([pool]), session, None)}
    manager._kvwire_endpoints = {}
    try:
        with caplog.at_level(logging.ERROR, logger="kvwire"):
            verdict = manager._publish_peer_registration(session, SimpleNamespace(dst_kv_ptrs=ptrs))
    finally:
        manager.kvwire_connection.close()
    assert verdict == "sglang's verdict"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith(f"kvwire: {message}"), line
