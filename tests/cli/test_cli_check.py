"""``kvwire check`` for CI (--require-available, 100 columns), ``--version``/``versions``, plain help texts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import kvwire
from kvwire.cli.main import _check_table, main
from kvwire.registry.findings import Finding
from kvwire.registry.loading import BackendInfo

KVWIRE = [sys.executable, "-m", "kvwire"]
WIDTH = 100


def _kvwire(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    return subprocess.run(
        [*KVWIRE, *args], capture_output=True, text=True, env={**clean, **(env or {})}, timeout=120, check=False
    )


def _ascend_unavailable() -> None:
    pytest.importorskip("kvwire_ascend")
    from kvwire_ascend.backend import AscendBackend

    if AscendBackend.availability() is None:
        pytest.skip("this host can run the Ascend backend (torch_npu and CANN present)")


def test_require_available_fails_on_a_backend_that_loads_but_cannot_transfer_here() -> None:
    _ascend_unavailable()
    assert _kvwire("check", "--backends", "ascend").returncode == 0  # it loads: ok without the flag
    proc = _kvwire("check", "--require-available", env={"KVWIRE_BACKENDS": "ascend"})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr.startswith("kvwire check: error: backend 'ascend' (kvwire-ascend "), proc.stderr
    assert "loads but cannot transfer on this host (--require-available): torch_npu is not installed" in proc.stderr
    assert proc.stdout.endswith("\n0/1 allowed backend(s) pass (--require-available)\n"), proc.stdout
    row = next(line for line in proc.stdout.splitlines() if line.startswith("ascend "))
    assert row.split()[-1] == "no"  # the available column


def test_require_available_passes_when_every_allowed_backend_can_transfer() -> None:
    proc = _kvwire("check", "--require-available", "--backends", "local")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.endswith("\n1/1 allowed backend(s) pass (--require-available)\n")


def test_json_output_fails_the_same_way() -> None:
    _ascend_unavailable()
    proc = _kvwire("check", "--json", "--require-available", "--backends", "ascend,local")
    assert proc.returncode == 1
    entries = {e["name"]: e for e in json.loads(proc.stdout)}
    assert entries["ascend"]["runtime"].startswith("unavailable: ")
    assert "backend 'ascend'" in proc.stderr
    assert "backend 'local'" not in proc.stderr


def test_the_check_table_fits_100_columns_and_capabilities_need_verbose() -> None:
    plain = _kvwire("check")
    assert plain.returncode in (0, 1), plain.stderr
    lines = plain.stdout.splitlines()
    assert lines[0].split() == ["backend", "distribution", "version", "spec", "status", "submit", "available"]
    assert max(map(len, lines)) <= WIDTH, max(lines, key=len)
    assert "capabilities" not in plain.stdout
    verbose = _kvwire("check", "--verbose", "--backends", "local")
    assert max(map(len, verbose.stdout.splitlines())) <= WIDTH
    assert "    capabilities: device_kv_indices, device_memory, head_slicing, " in verbose.stdout


def _info(name: str, **kwargs: object) -> BackendInfo:
    return BackendInfo(name, f"kvwire-{name}", "0.1.0", f"kvwire_{name}:Backend", **kwargs)  # type: ignore[arg-type]


def test_long_notes_wrap_and_an_unprobed_backend_shows_no_availability() -> None:
    reason = "; ".join(f"reason number {i} is long enough to need wrapping" for i in range(6))
    far = _info(
        "far", status="ok", spec_version="1.5", capabilities=frozenset({"mha"}), runtime=f"unavailable: {reason}"
    )
    broken = _info("broken", status="import-error", error="ImportError: " + "x " * 80)
    text = _check_table([far, broken], verbose=True)
    lines = text.splitlines()
    assert max(map(len, lines)) <= WIDTH
    rows = {line.split()[0]: line.split() for line in lines if line.startswith(("far ", "broken "))}
    assert (rows["far"][-1], rows["broken"][-1]) == ("no", "-")
    assert " ".join(text.split()).count(reason) == 1  # wrapped, not cut
    assert text.count("capabilities:") == 1  # listed for the backend that loaded only
    assert "    capabilities: mha" in lines


def test_a_drifted_backend_prints_each_signature_once() -> None:
    spec, impl = "send_kvcache(a: int, b: int, c: int) -> int", "send_kvcache(a: int, *, b: int, c: int) -> int"
    findings = tuple(
        Finding(
            "kw",
            "kvwire-kw",
            "0.1.0",
            "kvwire_kw:Backend",
            "send_kvcache",
            "parameter-kind",
            f"parameter `{name}` is keyword-only, the spec's is positional-or-keyword",
            spec,
            impl,
            f"make `{name}` a plain parameter (move it out of the `/` or `*` section)",
        )
        for name in ("b", "c")
    )
    lines = _check_table([_info("kw", status="drift", spec_version="1.5", findings=findings)]).splitlines()
    assert lines[2:] == [
        "kw       kvwire-kw     0.1.0    1.5   drift   -       -",
        "    backend 'kw' (kvwire-kw 0.1.0, entry point kvwire_kw:Backend), hook send_kvcache: 2 findings",
        f"        spec: {spec}",
        f"        impl: {impl}",
        "        [parameter-kind] parameter `b` is keyword-only, the spec's is positional-or-keyword",
        "            fix:  make `b` a plain parameter (move it out of the `/` or `*` section)",
        "        [parameter-kind] parameter `c` is keyword-only, the spec's is positional-or-keyword",
        "            fix:  make `c` a plain parameter (move it out of the `/` or `*` section)",
    ]


def test_version_is_one_line_and_versions_the_long_form() -> None:
    start = time.monotonic()
    short = _kvwire("--version")
    elapsed = time.monotonic() - start
    assert short.returncode == 0
    assert short.stdout.splitlines() == [
        f"kvwire {kvwire.__version__} (backend spec {kvwire.SPEC_VERSION}; "
        f"loads backends of spec 1.0 to {kvwire.SPEC_VERSION})"
    ]
    assert elapsed < 10  # it imports no backend
    long = _kvwire("versions")
    assert long.returncode == 0
    assert long.stdout.splitlines()[:2] == [
        f"kvwire {kvwire.__version__}",
        f"backend spec {kvwire.SPEC_VERSION} (loads backends of spec 1.0 to {kvwire.SPEC_VERSION})",
    ]
    assert any(line.split()[:3] == ["local", "kvwire", kvwire.__version__] for line in long.stdout.splitlines())
    data = json.loads(_kvwire("versions", "--json").stdout)
    assert data["backends"]["local"] == {"distribution": "kvwire", "version": kvwire.__version__}


@pytest.mark.parametrize("command", [[], ["check"], ["versions"], ["bench"], ["lint"], ["spec"]])
def test_help_texts_are_plain(command: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: kvwire")
    assert "``" not in out


def test_spec_takes_at_and_keeps_version_as_a_hidden_alias(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["spec", "--help"])
    out = capsys.readouterr().out
    assert "--at " in out
    assert "--version" not in out
    assert main(["spec", "--at", "1.2"]) == 0
    at = capsys.readouterr().out
    assert main(["spec", "--version", "1.2"]) == 0
    assert capsys.readouterr().out == at
    assert at.startswith("kvwire backend spec 1.2 ")
