"""Plugins that exit, abort, crash, hang or print: ``kvwire check`` reports them, and a host never meets them.

The hostile backends are real installed wheels (tests/core/plugin_wheels.py).
Every case asserts the exit code, the error type and the exact message.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
import time
from importlib import metadata
from pathlib import Path

import pytest

import kvwire

from plugin_wheels import VARIANTS, RunPy, check_json

pytestmark = pytest.mark.slow

#: Each hostile kind: (status, error) in ``kvwire check --json`` with ``--timeout 2``.
HOSTILE: dict[str, tuple[str, str | None]] = {
    "exit_plugin": ("import-error", "SystemExit(0) raised at import (a backend must not exit the process)"),
    "base_exception": (
        "import-error",
        "PluginAbort('transport self-test failed') raised at import (a backend must raise only Exception subclasses)",
    ),
    "os_exit": (
        "import-error",
        "the check process exited with code 3 (os._exit, or a crash in native code) while importing kvtest_os_exit; "
        "fix the module-level code of kvtest_os_exit (importing it must not block or exit), "
        "or uninstall kvtest-os-exit",
    ),
    "segfault": (
        "import-error",
        "the check process was killed by signal 11 (SIGSEGV) while importing kvtest_segfault; "
        "fix the module-level code of kvtest_segfault (importing it must not block or exit), "
        "or uninstall kvtest-segfault",
    ),
    "keyboard_interrupt": (
        "import-error",
        "raised KeyboardInterrupt while importing kvtest_keyboard_interrupt; "
        "fix the module-level code of kvtest_keyboard_interrupt (importing it must not block or exit), "
        "or uninstall kvtest-keyboard-interrupt",
    ),
    "import_loop": (
        "timeout",
        "no answer within 2s while importing kvtest_import_loop (the check process was killed); "
        "fix the module-level code of kvtest_import_loop (importing it must not block or exit), or raise --timeout",
    ),
    "hung_availability": (
        "timeout",
        "no answer within 2s in kvtest_hung_availability:Backend.availability() (the check process was killed); "
        "fix kvtest_hung_availability:Backend.availability() (it must answer without blocking), or raise --timeout",
    ),
    "print_noise": ("ok", None),
    "fd_noise": ("ok", None),
}
TIMEOUT = ("--timeout", "2")
INSTALLED = ", ".join(
    sorted({name for name, _ in VARIANTS.values()} | {ep.name for ep in metadata.entry_points(group="kvwire.backends")})
)


def _env(plugin_site: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVWIRE_")}
    env["PYTHONPATH"] = os.pathsep.join([str(plugin_site), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**env, **extra}


@pytest.fixture(scope="module")
def full_run(run_with_plugins: RunPy) -> tuple[subprocess.CompletedProcess[str], float]:
    """``kvwire check --json --timeout 2`` over every test wheel, and how long it took."""
    start = time.monotonic()
    proc = run_with_plugins("-m", "kvwire", "check", "--json", *TIMEOUT)
    return proc, time.monotonic() - start


def test_check_survives_every_hostile_plugin(full_run: tuple[subprocess.CompletedProcess[str], float]) -> None:
    proc, elapsed = full_run
    assert proc.returncode == 1, proc.stderr
    entries = {e["name"]: e for e in json.loads(proc.stdout)}  # valid JSON: no plugin output got in
    assert {name: (entries[name]["status"], entries[name]["error"]) for name in HOSTILE} == HOSTILE
    assert entries["local"]["status"] == "ok"
    assert entries["ok"]["status"] == "ok"
    assert proc.stdout.startswith("[\n")
    assert proc.stderr.count("noise") == 2  # print() and os.write(1, ...) went to stderr, not into the JSON
    assert elapsed < 30  # the hangs were cut at 2 s, concurrently with everything else


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_each_hostile_kind_alone(run_with_plugins: RunPy, name: str) -> None:
    status, error = HOSTILE[name]
    code, entries = check_json(run_with_plugins, "--backends", f"local,{name}", *TIMEOUT)
    assert code == (0 if status == "ok" else 1)
    assert (entries[name]["status"], entries[name]["error"]) == (status, error)
    assert entries["local"]["status"] == "ok"
    assert set(entries) == {"local", name}  # --backends: a report on those only


def test_the_per_child_mode_reports_the_same(run_with_plugins: RunPy) -> None:
    """One ``python -m kvwire.registry.isolation`` per backend (used where fork is not) says the same things."""
    script = textwrap.dedent(
        f"""
        import json, kvwire
        from kvwire.registry.isolation import check_isolated
        registry = kvwire.Registry(allow={sorted(HOSTILE)!r}, policy="quarantine")
        infos = check_isolated(registry, 2.0, fork=False)
        print(json.dumps({{i.name: [i.status, i.error] for i in infos if i.status != "blocked"}}))
        """
    )
    proc = run_with_plugins("-c", script)
    assert proc.returncode == 0, proc.stderr
    assert {name: tuple(v) for name, v in json.loads(proc.stdout).items()} == HOSTILE


HOST_SCRIPT = """
import sys
import kvwire
with kvwire.connect("local") as conn:
    print("CONNECTED", conn.endpoint().startswith("local://"))
print("IMPORTED", sorted(m for m in sys.modules if m.startswith("kvtest")))
"""


def test_a_host_connecting_to_local_never_imports_the_others(run_with_plugins: RunPy) -> None:
    proc = run_with_plugins("-c", HOST_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "CONNECTED True\nIMPORTED []\n"


CONNECT_SCRIPT = """
import kvwire
for name in ("exit_plugin", "base_exception"):
    try:
        kvwire.connect(name)
    except kvwire.BackendLoadError as exc:
        print(type(exc).__name__, exc)
print("STILL RUNNING")
"""


def test_connect_to_an_exiting_plugin_raises_instead_of_exiting(run_with_plugins: RunPy) -> None:
    proc = run_with_plugins("-c", CONNECT_SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "BackendImportError backend 'exit_plugin' (kvtest-exit 0.3.16, entry point kvtest_exit:Backend) failed to "
        "import: SystemExit(0) raised at import (a backend must not exit the process). Fix or reinstall kvtest-exit "
        "(module kvtest_exit), or uninstall it; the other backends are unaffected",
        "BackendImportError backend 'base_exception' (kvtest-base-exception 0.3.17, entry point "
        "kvtest_base_exception:Backend) failed to import: PluginAbort('transport self-test failed') raised at import "
        "(a backend must raise only Exception subclasses). Fix or reinstall kvtest-base-exception "
        "(module kvtest_base_exception), or uninstall it; the other backends are unaffected",
        "STILL RUNNING",
    ]
    assert issubclass(kvwire.BackendImportError, kvwire.BackendLoadError)


def test_in_process_scan_records_exits_as_import_errors(run_with_plugins: RunPy) -> None:
    script = (
        "import kvwire\n"
        "reg = kvwire.Registry(allow=['exit_plugin', 'base_exception', 'local'], policy='quarantine')\n"
        "print({i.name: i.status for i in reg.scan() if i.status != 'blocked'})\n"
    )
    proc = run_with_plugins("-c", script)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "{'base_exception': 'import-error', 'exit_plugin': 'import-error', 'local': 'ok'}\n"


def _allow_error(source: str) -> str:
    return (
        f"kvwire check: error: {source} names backend(s) that are not installed: 'mooncak' (did you mean "
        f"'mooncake'?); installed: {INSTALLED}. Fix the spelling, or install the backend's distribution\n"
    )


def test_a_typo_in_the_allow_list_fails_check(run_with_plugins: RunPy) -> None:
    proc = run_with_plugins("-m", "kvwire", "check", "--strict", env={"KVWIRE_BACKENDS": "mooncak"})
    assert proc.returncode == 1
    assert proc.stdout.endswith("\n0/1 allowed backend(s) pass (--strict)\n")
    assert proc.stderr == _allow_error("$KVWIRE_BACKENDS")
    proc = run_with_plugins("-m", "kvwire", "check", "--json", "--backends", "mooncak")
    assert proc.returncode == 1
    assert json.loads(proc.stdout) == []  # nothing installed by that name; the error says which are
    assert proc.stderr == _allow_error("--backends")


@pytest.mark.parametrize(
    ("args", "env", "message"),
    [
        (
            ("--backends", ","),
            {},
            f"kvwire check: error: --backends ',' names no backend; give backend names separated by commas "
            f"(installed: {INSTALLED}), or leave it out to check all of them\n",
        ),
        (
            (),
            {"KVWIRE_BACKENDS": " , "},
            f"kvwire check: error: $KVWIRE_BACKENDS=',' names no backend; list backend names separated by commas "
            f"(installed: {INSTALLED}), or unset it to allow every installed backend\n",
        ),
        (("--timeout", "0"), {}, "kvwire check: error: --timeout must be a finite number of seconds > 0, got 0\n"),
    ],
)
def test_an_empty_allow_list_is_a_usage_error(
    run_with_plugins: RunPy, args: tuple[str, ...], env: dict[str, str], message: str
) -> None:
    proc = run_with_plugins("-m", "kvwire", "check", *args, env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", message)


def test_a_typo_in_the_allow_list_fails_connect(run_with_plugins: RunPy) -> None:
    script = textwrap.dedent(
        """
        import kvwire
        for call in (lambda: kvwire.connect("local"), lambda: kvwire.Registry(allow=["local", "mooncak"]).get("local")):
            try:
                call()
            except kvwire.BackendLoadError as exc:
                print(type(exc).__name__, exc)
        try:
            kvwire.connect("mooncak")
        except kvwire.BackendLoadError as exc:
            print(type(exc).__name__, str(exc).split(";")[0])
        """
    )
    proc = run_with_plugins("-c", script, env={"KVWIRE_BACKENDS": "local,mooncak"})
    assert proc.returncode == 0, proc.stderr
    tail = f"names backend(s) that are not installed: 'mooncak' (did you mean 'mooncake'?); installed: {INSTALLED}."
    assert proc.stdout.splitlines() == [
        f"BackendLoadError $KVWIRE_BACKENDS {tail} Fix the spelling, or install the backend's distribution",
        f"BackendLoadError allow {tail} Fix the spelling, or install the backend's distribution",
        "BackendLoadError backend 'mooncak' is not installed (did you mean 'mooncake'?). Available: local (kvwire "
        "0.1.0). Not available: adapted (blocked: not in the allow-list (local, mooncak))",
    ]


@pytest.mark.parametrize(
    ("name", "hint"), [("nosuch", ""), ("mooncak", " (did you mean 'mooncake'?)")], ids=["unknown", "typo"]
)
def test_pytest_with_an_unknown_backend_is_one_usage_error(
    plugin_site: Path, tmp_path: Path, name: str, hint: str
) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--kvwire-backend", name],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=_env(plugin_site),
        timeout=120,
    )
    assert proc.returncode == 4  # pytest's usage error
    assert proc.stdout == ""
    assert proc.stderr.strip() == (
        f"ERROR: --kvwire-backend {name}: no installed kvwire backend is named {name!r}{hint}; "
        f"installed: {INSTALLED}. Fix the name, or pip install the backend's distribution"
    )


def test_check_into_a_closed_pipe_exits_quietly(plugin_site: Path) -> None:
    command = [sys.executable, "-m", "kvwire", "check", "--json", "--backends", "local,ok"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(plugin_site))
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before kvwire writes a byte
    stderr = proc.stderr.read()
    assert proc.wait(timeout=120) == 141  # 128 + SIGPIPE, as a shell reports a process ended by SIGPIPE
    assert stderr == b""


def test_check_piped_into_head_exits_quietly(plugin_site: Path) -> None:
    shell = f"set -o pipefail; {sys.executable} -m kvwire check --json --backends local,ok | head -1"
    proc = subprocess.run(
        ["bash", "-c", shell], capture_output=True, text=True, env=_env(plugin_site), timeout=120, check=False
    )
    assert proc.stdout == "[\n"
    assert proc.stderr == ""  # no BrokenPipeError traceback
    assert proc.returncode in (0, 141)


def test_a_keyboard_interrupt_in_a_command_is_one_line_and_exit_130(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Round 1 leftover: a KeyboardInterrupt (Ctrl-C, or a plugin imported in process) printed a traceback."""
    cli = importlib.import_module("kvwire.cli.main")

    def interrupted(args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_check", interrupted)
    assert cli.main(["check"]) == 130
    assert capsys.readouterr().err == "kvwire check: interrupted\n"
