"""What the sglang deployment tests share: the venv, the example's launch helpers, the tiny models, checks.

The servers are started by ``examples/pd-sglang/deploy.py`` (the example users run), with the Python of the
pinned sglang venv (``tests/hosts/sglang/make_venv.sh``); the models are made by the example's
``tiny_model.py`` in that venv. Every server runs with sglang's strict idle memory check
(``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1``): a KV page or request slot leaked by a transfer, an
abort or a dead peer stops that server, which the tests see.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.util
import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from offline import index_unreachable

ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "pd-sglang"
VENV = ROOT / ".venv-sglang"
PYTHON = str(VENV / "bin" / "python")
#: sglang's own leak check, made fatal: a leaked page stops the server (sglang's scheduler on_idle).
STRICT_ENV = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1"}
PAGE = 16
#: Bytes of one page of the tiny llama in all its KV buffers: 16 tokens x 2 layers x (K, V) x 2 heads x 16 x 4.
LLAMA_PAGE_BYTES = PAGE * 2 * 2 * 2 * 16 * 4
LLAMA_BUFFERS = 4
#: The tiny MLA model: 16 tokens x 2 layers x (32 + 8) latent x 4 bytes, one buffer per layer.
MLA_PAGE_BYTES = PAGE * 2 * 40 * 4
MLA_BUFFERS = 2
LEAK_MARKERS = ("memory leak detected", "double free", "use-after-free")


@contextlib.contextmanager
def one_deployment_at_a_time() -> Iterator[None]:
    """Held for a module's whole deployment: its sglang servers never start beside another module's.

    xdist workers may run two deployment modules at once (each of 3-6 servers of about 1.5 GB, starting
    in 20-50 s on two cores alone); together they outgrow the machine and each other's start-up deadlines.
    """
    with open(ROOT / ".sglang-servers.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def build_venv() -> None:
    """The pinned sglang venv (built when missing or stale; the test skips when the index is unreachable)."""
    proc = subprocess.run(
        ["bash", str(ROOT / "tests/hosts/sglang/make_venv.sh"), str(VENV)],
        capture_output=True,
        text=True,
        timeout=1800,
        cwd=ROOT,
    )
    if proc.returncode == 3:
        index_unreachable(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-3000:]


def load_deploy() -> ModuleType:
    """The example's ``deploy`` module (stdlib only, so it imports here too)."""
    if "pd_sglang_deploy" in sys.modules:
        return sys.modules["pd_sglang_deploy"]
    spec = importlib.util.spec_from_file_location("pd_sglang_deploy", EXAMPLE / "deploy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["pd_sglang_deploy"] = module
    spec.loader.exec_module(module)
    return module


def make_model(path: Path, arch: str = "llama", kv_seed: int | None = None) -> Path:
    """A tiny model made by the example's ``tiny_model.py`` in the sglang venv (torch, transformers)."""
    argv = [PYTHON, str(EXAMPLE / "tiny_model.py"), str(path), "--arch", arch]
    if kv_seed is not None:
        argv += ["--kv-seed", str(kv_seed)]
    subprocess.run(argv, check=True, capture_output=True, timeout=300)
    return path


def pages(lengths: list[int]) -> int:
    """KV pages a prefill sends for prompts of these lengths (a partial last page is sent whole)."""
    return sum(math.ceil(n / PAGE) for n in lengths)


def counters_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    names = set(before) | set(after)
    return {n: after.get(n, 0.0) - before.get(n, 0.0) for n in names}


def assert_no_leak(*processes: Any) -> None:
    """Every process still runs and none logged one of sglang's leak findings."""
    for process in processes:
        assert process.alive(), f"{process.name} died:\n{process.tail(60)}"
        text = process.log.read_text(errors="replace")
        found = [m for m in LEAK_MARKERS if m in text]
        assert not found, f"{process.name} logged {found}:\n{process.tail(60)}"
