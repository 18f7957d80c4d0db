"""Run the prefill and decode processes of sglang 0.5.23's own disaggregation code (see ``side.py``).

Importable from the repo's own venv (no sglang there): :func:`run_pair` only spawns
``side.py`` once per TP rank of the scenario (a prefill and a decode, or more: TP
ranks, a second decode server) with the sglang venv's python, on 127.0.0.1, and
reads back what each process wrote. It never hangs: all are killed at ``timeout_s``.

    from pair import run_pair
    r = run_pair("plain-mha", "kvwire")
    assert r["outcome"] == "verified", r

``outcome`` is one of ``verified`` (sglang reported Success on every process for
every request, and every decode rank's pool holds exactly its heads of the source
pages where asked, token by token and head by head, nothing else changed; a killed
decode's request Failed on the prefill within the scenario's bound), ``failed as
expected`` (a failure scenario: Failed everywhere and the decode pool, guard pages
included, unchanged) or ``broke: <why>``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
#: The venv that make_venv.sh builds (override: KVWIRE_SGLANG_PYTHON).
SGLANG_PYTHON = Path(os.environ.get("KVWIRE_SGLANG_PYTHON") or REPO / ".venv-sglang" / "bin" / "python")


def _load_side() -> Any:
    """``side.py`` as a module, for its scenario table (its top level imports only the standard library)."""
    spec = importlib.util.spec_from_file_location("kvwire_sglang_side", HERE / "side.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


_SIDE = _load_side()
SCENARIOS: tuple[str, ...] = tuple(_SIDE.SCENARIOS)
FAILURE_SCENARIOS = frozenset(name for name, s in _SIDE.SCENARIOS.items() if not s.expect_success)
#: What ``pair.py`` runs without ``--scenario``: all but the throughput shapes (see bench/sglang_throughput.py).
DEFAULT_SCENARIOS: tuple[str, ...] = tuple(name for name, s in _SIDE.SCENARIOS.items() if not s.bench)
MODES: tuple[str, ...] = tuple(_SIDE.MODES)
TAIL_CHARS = 4000


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for the bootstrap server; sglang and Mooncake pick their own others)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def side_env(mode: str) -> dict[str, str]:
    """The environment of both sides: Mooncake over TCP on loopback; ``SGLANG_PLUGINS=kvwire`` only in kvwire mode."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "MC_", "MOONCAKE_"))}
    env.pop("PYTHONPATH", None)  # the repo venv's paths have no place in the sglang venv
    env.pop("VIRTUAL_ENV", None)
    env.update(
        MC_FORCE_TCP="1",
        MOONCAKE_PROTOCOL="tcp",
        SGLANG_HOST_IP="127.0.0.1",
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
    )
    if mode == "kvwire":
        env["SGLANG_PLUGINS"] = "kvwire"
    return env


#: Mooncake's own (glog) error lines: ``E1201 22:51:18.506904  2285 file.h:183] ...``.
_GLOG_ERROR = re.compile(r"^[EF]\d{4} \d")


def error_lines(text: str, limit: int = 20) -> list[str]:
    """Lines logged as errors: Python logging's ERROR / CRITICAL (sglang, kvwire), tracebacks, Mooncake's glog E/F.

    Mooncake logs ``Local segment descriptor not found`` at every engine start: noise, left in.
    """
    keys = (" ERROR ", " CRITICAL ", "Traceback (most recent call last)")
    return [line for line in text.splitlines() if any(k in line for k in keys) or _GLOG_ERROR.match(line)][:limit]


def outcome(scenario: str, sides: Mapping[str, dict[str, Any]]) -> str:
    """``verified``, ``failed as expected`` or ``broke: <why>`` (see the module docstring).

    ``sides`` are every process's results by name (as :func:`run_pair` returns them).
    A killed decode (``"killed": True``) is judged only through the prefill's view of
    its request: Failed, within the scenario's ``fail_within_s`` of the send.
    """
    sc = _SIDE.SCENARIOS[scenario]
    live = {name: s for name, s in sides.items() if not s.get("killed")}
    broken = [f"{name}: {s.get('error', 'no result')}" for name, s in live.items() if not s.get("ok")]
    if broken:
        return "broke: " + "; ".join(broken)
    prefills = {name: s for name, s in live.items() if s["role"] == "prefill"}
    decodes = {name: s for name, s in live.items() if s["role"] == "decode"}
    if not sc.expect_success:
        states = {name: s["kvpoll"] for name, s in live.items()}
        if set(states.values()) != {"Failed"}:
            return f"broke: expected Failed everywhere, got {states}"
        for name, s in decodes.items():
            if s["other_pages_changed"]:
                changed = s["other_pages_changed"]
                return f"broke: Failed, but {len(changed)} {name} pages were written before the failure: {changed[:6]}"
        return "failed as expected"
    for name, s in decodes.items():
        if s["other_pages_changed"]:
            return f"broke: {name}: pages written that were not asked for: {s['other_pages_changed'][:6]}"
        if s["kvpoll"] != "Success":
            return f"broke: {name} {s['kvpoll']} ({s.get('failure')})"
        if s["mismatch_count"] or not s["pages_checked"]:
            return f"broke: {name}: {s['mismatch_count']} head slices differ: {s['mismatches'][:6]}"
    for name, s in prefills.items():
        for r in s["requests"]:
            want = "Failed" if r["server"] == sc.killed_decode and r["rep"] >= sc.killed_at_rep else "Success"
            if r["kvpoll"] != want:
                what = f"request {r['rep']} of decode server {r['server']}"
                return f"broke: {name}: {what} {r['kvpoll']}, expected {want} ({r['failure']})"
            if want == "Failed" and (r["seconds"] is None or r["seconds"] > sc.fail_within_s):
                return f"broke: {name}: the killed decode's request took {r['seconds']} s to fail"
        if s.get("kvwire_sends") == 0:
            return f"broke: kvwire mode, but no send_kvcache of {name} went through kvwire"
    return "verified"


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL ``proc``'s process group (the one started for it: side.py and its children) and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def run_pair(scenario: str, mode: str, timeout_s: float = 120, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``scenario``'s processes in ``mode`` (``stock`` | ``kvwire``); every process's result and the outcome.

    Returns ``{"scenario", "mode", "outcome", "wall_s", "processes", NAME: ...}`` with one
    dict per process name (``prefill`` and ``decode`` always among them; see
    ``Scenario.processes`` in side.py), as ``side.py`` wrote it plus ``returncode``
    and ``errors_logged`` (the error lines of its stderr), and ``stderr_tail`` when
    the outcome is not the expected one. A scenario's killed decode ranks are
    SIGKILLed (with their process groups) once they sent their metadata and every
    prefill rank saw it; their dict then has ``"killed": True`` and ``killed_at_s``
    (seconds since the start). All processes get ``timeout_s - 10`` s of their own
    and are killed at ``timeout_s``. ``env`` is added to every process's
    environment (e.g. ``PYTHONPATH`` of an experimental kvwire copy).
    """
    if scenario not in SCENARIOS or mode not in MODES:
        raise ValueError(f"unknown scenario {scenario!r} or mode {mode!r}")
    if not SGLANG_PYTHON.exists():
        raise FileNotFoundError(f"{SGLANG_PYTHON} (build it with tests/hosts/sglang/make_venv.sh)")
    sc = _SIDE.SCENARIOS[scenario]
    work = Path(tempfile.mkdtemp(prefix=f"kvwire-sglang-{scenario}-{mode}-"))
    port, room = free_port(), random.randrange(1, 2**62)
    full_env = {**side_env(mode), **(env or {})}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    killed: dict[str, float] = {}
    started = time.monotonic()
    try:
        for p in sc.processes():
            cmd = [str(SGLANG_PYTHON), str(HERE / "side.py"), "--role", p.role, "--scenario", scenario]
            cmd += ["--mode", mode, "--bootstrap-port", str(port), "--room", str(room)]
            cmd += ["--rank", str(p.rank), "--server", str(p.server), "--stage", str(p.stage)]
            cmd += ["--workdir", str(work), "--timeout-s", str(max(timeout_s - 10, 5))]
            with open(work / f"{p.name}.out", "wb") as out, open(work / f"{p.name}.err", "wb") as err:
                procs[p.name] = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env=full_env,
                    cwd=work,
                    start_new_session=True,
                )
        deadline = started + timeout_s
        victims = [p.name for p in sc.killed()]
        prefills = [p.name for p in sc.processes() if p.role == "prefill"]
        while time.monotonic() < deadline and any(proc.poll() is None for proc in procs.values()):
            for name in victims:
                sent = name not in killed and (work / f"{name}.metadata_sent").exists()
                if sent and all((work / f"{q}.waiting").exists() for q in prefills):  # and its metadata arrived
                    _kill_group(procs[name])
                    killed[name] = round(time.monotonic() - started, 2)
                    (work / f"{name}.killed").touch()
            time.sleep(0.05)
    finally:
        for proc in procs.values():
            _kill_group(proc)
    wall = round(time.monotonic() - started, 2)

    sides: dict[str, dict[str, Any]] = {}
    for name, proc in procs.items():
        path = work / f"{name}.json"
        role = "prefill" if name.startswith("prefill") else "decode"
        side: dict[str, Any]
        if name in killed:
            side = {"role": role, "name": name, "killed": True, "killed_at_s": killed[name]}
        elif path.exists():
            side = json.loads(path.read_text())
        else:
            error = f"no result (killed after {timeout_s}s or crashed)"
            side = {"role": role, "name": name, "ok": False, "error": error}
        stderr = (work / f"{name}.err").read_text(errors="replace")
        side["returncode"] = proc.returncode
        side["errors_logged"] = error_lines(stderr)
        side["_stderr"] = stderr
        sides[name] = side
    result: dict[str, Any] = {"scenario": scenario, "mode": mode, "wall_s": wall, "processes": list(procs)}
    result["outcome"] = outcome(scenario, sides)
    expected = "failed as expected" if scenario in FAILURE_SCENARIOS else "verified"
    for name, side in sides.items():
        stderr = side.pop("_stderr")
        if result["outcome"] != expected:
            side["stderr_tail"] = stderr[-TAIL_CHARS:]
        result[name] = side
    shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description="Run sglang prefill/decode pairs and print one line each.")
    p.add_argument("--scenario", action="append", choices=SCENARIOS)
    p.add_argument("--mode", action="append", choices=MODES)
    p.add_argument("--timeout-s", type=float, default=120)
    p.add_argument("--json", action="store_true", help="print each full result as JSON")
    a = p.parse_args()
    for sc in a.scenario or DEFAULT_SCENARIOS:
        for md in a.mode or MODES:
            r = run_pair(sc, md, a.timeout_s)
            print(json.dumps(r, indent=1) if a.json else f"{sc:14} {md:7} {r['wall_s']:6.1f}s  {r['outcome']}")
