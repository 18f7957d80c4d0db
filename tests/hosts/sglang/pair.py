"""Run a prefill and a decode of sglang 0.5.23's own disaggregation code as two processes (see ``side.py``).

Importable from the repo's own venv (no sglang there): :func:`run_pair` only spawns
``side.py`` twice with the sglang venv's python, on 127.0.0.1, and reads back what
each side wrote. It never hangs: both processes are killed at ``timeout_s``.

    from pair import run_pair
    r = run_pair("plain-mha", "kvwire")
    assert r["outcome"] == "verified", r

``outcome`` is one of ``verified`` (sglang reported Success on both sides and the
decode pool holds exactly the source pages where asked, nothing else changed),
``failed as expected`` (a failure scenario: Failed on both sides and the decode
pool, guard pages included, unchanged) or ``broke: <why>``.
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


def outcome(scenario: str, prefill: dict[str, Any], decode: dict[str, Any]) -> str:
    """``verified``, ``failed as expected`` or ``broke: <why>`` (see the module docstring)."""
    broken = [f"{s['role']}: {s.get('error', 'no result')}" for s in (decode, prefill) if not s.get("ok")]
    if broken:
        return "broke: " + "; ".join(broken)
    states = (prefill["kvpoll"], decode["kvpoll"])
    changed = decode["other_pages_changed"]
    if scenario in FAILURE_SCENARIOS:
        if states != ("Failed", "Failed"):
            return f"broke: expected Failed on both sides, got prefill {states[0]}, decode {states[1]}"
        if changed:
            return f"broke: Failed, but {len(changed)} decode pages were written before the failure: {changed[:6]}"
        return "failed as expected"
    if changed:
        return f"broke: pages written that were not asked for: {changed[:6]}"
    if states != ("Success", "Success"):
        return f"broke: prefill {states[0]} ({prefill.get('failure')}), decode {states[1]} ({decode.get('failure')})"
    if decode["mismatches"] or not decode["pages_checked"]:
        return f"broke: {len(decode['mismatches'])} page mismatches: {decode['mismatches'][:6]}"
    if prefill.get("kvwire_sends") == 0:
        return "broke: kvwire mode, but no send_kvcache went through kvwire"
    return "verified"


def run_pair(scenario: str, mode: str, timeout_s: float = 120, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run one transfer of ``scenario`` in ``mode`` (``stock`` | ``kvwire``); both sides' results and the outcome.

    Returns ``{"scenario", "mode", "outcome", "wall_s", "prefill", "decode"}``, each
    side's dict as ``side.py`` wrote it plus ``returncode`` and ``errors_logged``
    (the error lines of its stderr), and ``stderr_tail`` when the outcome is not the
    expected one. Both sides get ``timeout_s - 10`` s of their own and are killed
    (with their process groups) at ``timeout_s``. ``env`` is added to both sides'
    environment (e.g. ``PYTHONPATH`` of an experimental kvwire copy).
    """
    if scenario not in SCENARIOS or mode not in MODES:
        raise ValueError(f"unknown scenario {scenario!r} or mode {mode!r}")
    if not SGLANG_PYTHON.exists():
        raise FileNotFoundError(f"{SGLANG_PYTHON} (build it with tests/hosts/sglang/make_venv.sh)")
    work = Path(tempfile.mkdtemp(prefix=f"kvwire-sglang-{scenario}-{mode}-"))
    port, room = free_port(), random.randrange(1, 2**62)
    full_env = {**side_env(mode), **(env or {})}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    started = time.monotonic()
    try:
        for role in ("prefill", "decode"):
            cmd = [str(SGLANG_PYTHON), str(HERE / "side.py"), "--role", role, "--scenario", scenario]
            cmd += ["--mode", mode, "--bootstrap-port", str(port), "--room", str(room)]
            cmd += ["--workdir", str(work), "--timeout-s", str(max(timeout_s - 10, 5))]
            with open(work / f"{role}.out", "wb") as out, open(work / f"{role}.err", "wb") as err:
                procs[role] = subprocess.Popen(
                    cmd,
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=err,
                    env=full_env,
                    cwd=work,
                    start_new_session=True,
                )
        deadline = started + timeout_s
        for proc in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):  # the group started above: side.py and its children
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = round(time.monotonic() - started, 2)

    sides: dict[str, dict[str, Any]] = {}
    for role, proc in procs.items():
        path = work / f"{role}.json"
        side: dict[str, Any] = (
            json.loads(path.read_text())
            if path.exists()
            else {"role": role, "ok": False, "error": f"no result (killed after {timeout_s}s or crashed)"}
        )
        stderr = (work / f"{role}.err").read_text(errors="replace")
        side["returncode"] = proc.returncode
        side["errors_logged"] = error_lines(stderr)
        side["_stderr"] = stderr
        sides[role] = side
    result: dict[str, Any] = {"scenario": scenario, "mode": mode, "wall_s": wall}
    result["outcome"] = outcome(scenario, sides["prefill"], sides["decode"])
    expected = "failed as expected" if scenario in FAILURE_SCENARIOS else "verified"
    for role, side in sides.items():
        stderr = side.pop("_stderr")
        if result["outcome"] != expected:
            side["stderr_tail"] = stderr[-TAIL_CHARS:]
        result[role] = side
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
    for sc in a.scenario or SCENARIOS:
        for md in a.mode or MODES:
            r = run_pair(sc, md, a.timeout_s)
            print(json.dumps(r, indent=1) if a.json else f"{sc:12} {md:7} {r['wall_s']:6.1f}s  {r['outcome']}")
