"""Discovery and validation through real entry points of real installed wheels."""

from __future__ import annotations

import textwrap
from typing import Any

import pytest

from plugin_wheels import FATAL_IN_PROCESS, NOISY, VARIANTS, RunPy, check_json

pytestmark = pytest.mark.slow

#: Two test wheels hang (at import, in availability()): a short limit keeps a full check quick.
FAST = ("--timeout", "3")
#: Every test backend an in-process scan survives (the fatal ones end or hang it, the noisy ones print).
IN_PROCESS_SAFE = ",".join(sorted({name for name, _ in VARIANTS.values()} - FATAL_IN_PROCESS - NOISY | {"local"}))

EXPECTED_RULE = {
    "missing_parameter": "missing-parameter",
    "unknown_parameter": "unknown-parameter",
    "parameter_order": "parameter-order",
    "parameter_kind": "parameter-kind",
    "default_mismatch": "default-mismatch",
    "annotation_mismatch": "annotation-mismatch",
    "var_args": "var-args",
    "unknown_hook": "unknown-hook",
    "missing_hook": "missing-hook",
    "spec_version": "spec-version",
    "constructor": "constructor",
}


@pytest.fixture(scope="module")
def full_check(run_with_plugins: RunPy) -> tuple[int, dict[str, Any]]:
    """``kvwire check --json`` over every installed test wheel, hostile ones included, run once."""
    return check_json(run_with_plugins, *FAST)


def test_each_rule_is_reported_by_check(full_check: tuple[int, dict[str, Any]]) -> None:
    code, entries = full_check
    assert code == 1
    for name, rule in EXPECTED_RULE.items():
        entry = entries[name]
        assert entry["status"] == "drift", entry
        assert rule in {f["rule"] for f in entry["findings"]}, (name, entry["findings"])
        for finding in entry["findings"]:
            assert set(finding) >= {"hook", "rule", "message"}
    assert entries["ok"]["status"] == "ok"
    assert entries["ok"]["spec_version"] == "1.5"
    assert entries["adapted"]["status"] == "adapted"
    assert entries["adapted"]["spec_version"] == "1.1"
    assert entries["adapted"]["capabilities"] == ["layer_ids", "mha"]
    assert entries["local"]["status"] == "ok"
    # How submit_kvcache runs: the core's pool for every one of these; nothing for a backend that does not load.
    assert (entries["ok"]["submit"], entries["adapted"]["submit"], entries["local"]["submit"]) == ("core",) * 3
    assert entries["missing_parameter"]["submit"] is None


def test_ascend_case_message_names_everything(run_with_plugins: RunPy, full_check: tuple[int, dict[str, Any]]) -> None:
    _, entries = full_check
    (finding,) = entries["missing_parameter"]["findings"]
    assert finding["hook"] == "send_kvcache"
    assert finding["message"] == (
        "parameter `dst_device_kv_indices` added in spec 1.2 is missing (the caller's value would be dropped)"
    )
    assert finding["fix"].startswith(
        "add `dst_device_kv_indices: NDArray[np.int32] | None = None` after `dst_layer_ids`"
    )
    assert "dst_device_kv_indices: NDArray[np.int32] | None = None" in finding["spec_signature"]
    assert "dst_device_kv_indices" not in finding["impl_signature"]
    proc = run_with_plugins("-m", "kvwire", "check", *FAST)
    assert (
        "[missing-parameter] backend 'missing_parameter' (kvtest-missing-parameter 0.3.2, "
        "entry point kvtest_missing_parameter:Backend), hook send_kvcache:"
    ) in proc.stdout


@pytest.mark.parametrize(
    ("name", "fragment"),
    [
        (
            "unknown_parameter",
            "parameter `dst_device_indices` is not in the spec; did you mean `dst_device_kv_indices`?",
        ),
        ("parameter_order", "parameters are in the order (session_id, prefill_kv_indices, dst_kv_indices, dst_kv_ptrs"),
        ("parameter_kind", "parameter `dst_layer_ids` is keyword-only, the spec's is positional-or-keyword"),
        ("default_mismatch", "parameter `dst_layer_ids` has default (), the spec's has default None"),
        (
            "annotation_mismatch",
            "parameter `dst_device_kv_indices` is annotated `NDArray[np.int64] | None`, "
            "spec says `NDArray[np.int32] | None`",
        ),
        ("var_args", "`**kwargs` would swallow arguments"),
        (
            "unknown_hook",
            "`send_kv_cache` is marked @kvwire.hookimpl but the spec has no such hook; did you mean `send_kvcache`?",
        ),
        ("missing_hook", "required hook `close` is not implemented"),
        ("spec_version", "spec_version 2.0 is of major version 2; this kvwire implements 1.5"),
        ("constructor", "the constructor must take exactly one parameter, `config: kvwire.BackendConfig`"),
    ],
)
def test_rule_messages(full_check: tuple[int, dict[str, Any]], name: str, fragment: str) -> None:
    _, entries = full_check
    messages = [f["message"] for f in entries[name]["findings"]]
    assert any(fragment in m for m in messages), messages


def test_import_error_and_duplicates_are_isolated(full_check: tuple[int, dict[str, Any]]) -> None:
    _, entries = full_check
    broken = entries["import_error"]
    assert broken["status"] == "import-error"
    assert broken["error"] == "ImportError: libfake_transport.so: cannot open shared object file"
    twin = entries["twin"]
    assert twin["status"] == "duplicate"
    assert "kvtest-twin-a 0.3.14, kvtest-twin-b 0.3.15" in twin["error"]
    assert entries["ok"]["status"] == "ok"  # the others still load


def test_allow_list_never_imports_unlisted(run_with_plugins: RunPy) -> None:
    code, entries = check_json(run_with_plugins, env={"KVWIRE_BACKENDS": "ok,adapted"})
    assert code == 0
    assert entries["import_error"]["status"] == "blocked"  # imported, it would be import-error
    assert entries["missing_parameter"]["status"] == "blocked"
    code, entries = check_json(run_with_plugins, "--backends", "ok,local,import_error")
    assert code == 1
    assert entries["import_error"]["status"] == "import-error"


def test_strict_flag_fails_adapted(run_with_plugins: RunPy) -> None:
    assert check_json(run_with_plugins, "--backends", "ok,adapted")[0] == 0
    assert check_json(run_with_plugins, "--backends", "ok,adapted", "--strict")[0] == 1


def test_table_output(run_with_plugins: RunPy) -> None:
    proc = run_with_plugins("-m", "kvwire", "check", "--backends", "ok,adapted,local")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["backend", "distribution", "version", "spec", "status", "submit", "available"]
    assert lines[2].split()[:6] == ["adapted", "kvtest-adapted", "0.3.1", "1.1", "adapted", "core"]
    assert "3/3 allowed backend(s) pass" in proc.stdout


POLICY_SCRIPT = textwrap.dedent(
    """
    import kvwire
    reg = kvwire.Registry(policy={policy!r})
    try:
        infos = reg.load()
    except kvwire.BackendDriftError as exc:
        plugins = sorted({{f.backend for f in exc.findings}})
        print("DRIFT", plugins)
        raise SystemExit(0)
    print("LOADED", sorted(i.name for i in infos if i.usable))
    try:
        reg.connect("missing_parameter")
    except kvwire.BackendLoadError as exc:
        print("REFUSED", exc)
    conn = reg.connect("ok")
    print("ENDPOINT", conn.endpoint())
    """
)


def test_strict_policy_reports_all_drift_together(run_with_plugins: RunPy) -> None:
    proc = run_with_plugins("-c", POLICY_SCRIPT.format(policy="strict"), env={"KVWIRE_BACKENDS": IN_PROCESS_SAFE})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("DRIFT ")
    assert set(EXPECTED_RULE) <= set(eval(proc.stdout[len("DRIFT ") :]))


def test_quarantine_policy_keeps_the_rest_usable(run_with_plugins: RunPy) -> None:
    proc = run_with_plugins("-c", POLICY_SCRIPT.format(policy="quarantine"), env={"KVWIRE_BACKENDS": IN_PROCESS_SAFE})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    loaded = set(eval(out.splitlines()[0][len("LOADED ") :]))
    assert {"adapted", "local", "ok"} <= loaded
    assert not loaded & (set(EXPECTED_RULE) | {"import_error", "twin"})
    refused = next(line for line in out.splitlines() if line.startswith("REFUSED "))
    assert refused.startswith(
        "REFUSED backend 'missing_parameter' is not available (drift: 1 finding(s) (missing-parameter)). Available: "
    )
    assert "adapted (kvtest-adapted 0.3.1)" in refused
    assert "ok (kvtest-ok 0.3.0)" in refused
    assert "import_error (import-error: ImportError: libfake_transport.so" in refused
    assert "twin (duplicate: backend name 'twin' is claimed by 2 distributions" in refused
    assert "ENDPOINT test://endpoint" in out
    assert "drifts from the spec" in proc.stderr  # quarantine is loud


def test_connect_to_missing_backend_lists_available(run_with_plugins: RunPy) -> None:
    script = (
        "import kvwire\ntry:\n    kvwire.connect('nope')\nexcept kvwire.BackendLoadError as e:\n    print(e)\n"
    )
    proc = run_with_plugins("-c", script, env={"KVWIRE_BACKENDS": "ok,local,nope"})
    assert proc.stdout.startswith(
        "backend 'nope' is not installed. Available: local (kvwire 0.1.0), ok (kvtest-ok 0.3.0)."
    )
