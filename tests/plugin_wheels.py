"""Small test backend distributions, one per validator rule, built as real wheels.

Each variant is the source of one module; :func:`build_and_install` writes a
project per variant, builds every wheel with one ``pip wheel`` call and
installs them with ``pip install --target`` into a throwaway directory, so
discovery goes through real ``importlib.metadata`` entry points.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

HEADER = """\
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor
from typing import Optional

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire import BackendConfig, KVLayout

"""

GOOD_SEND = """\
    @kvwire.hookimpl
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Optional[Executor],
        dst_layer_ids: Optional[Sequence[int]] = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int:
        return 0
"""


def backend_source(
    *,
    spec_version: str | None = '"1.5"',
    capabilities: str = 'frozenset({"layer_ids", "device_kv_indices", "mha", "mla", "host_memory"})',
    init: str = "    def __init__(self, config: BackendConfig) -> None:\n        self.config = config\n",
    send: str = GOOD_SEND,
    extra: str = "",
    close: bool = True,
    prelude: str = "",
) -> str:
    """Module source of a backend class ``Backend``; each argument replaces one part."""
    lines = [HEADER, prelude, "class Backend:\n"]
    if spec_version is not None:
        lines.append(f"    spec_version = {spec_version}\n")
    lines.append(f"    capabilities = {capabilities}\n\n")
    lines.append(init + "\n")
    lines.append(
        "    @kvwire.hookimpl\n    def register_kv_buffers(self, layout: KVLayout) -> None:\n        pass\n\n"
        '    @kvwire.hookimpl\n    def endpoint(self) -> str:\n        return "test://endpoint"\n\n'
        "    @kvwire.hookimpl\n    def add_peer(self, session_id: str, layout: KVLayout) -> None:\n        pass\n\n"
        "    @kvwire.hookimpl\n    def remove_peer(self, session_id: str) -> None:\n        pass\n\n"
    )
    lines.append(send + "\n")
    if close:
        lines.append("    @kvwire.hookimpl\n    def close(self) -> None:\n        pass\n")
    lines.append(extra)
    return "".join(lines)


def _send(params: str) -> str:
    body = textwrap.indent(textwrap.dedent(params).strip(), " " * 8)
    return f"    @kvwire.hookimpl\n    def send_kvcache(\n        self,\n{body}\n    ) -> int:\n        return 0\n"


_P13 = "\ndst_kv_item_len: int | None = None,\ndst_attn_tp_size: int | None = None,"

_P5 = """\
session_id: str,
prefill_kv_indices: NDArray[np.int32],
dst_kv_ptrs: Sequence[int],
dst_kv_indices: NDArray[np.int32],
executor: Optional[Executor],
"""

#: distribution suffix -> (entry-point name, module source)
VARIANTS: dict[str, tuple[str, str]] = {
    "ok": ("ok", backend_source()),
    "adapted": (
        "adapted",
        backend_source(
            spec_version='"1.1"',
            capabilities='frozenset({"layer_ids", "mha"})',
            send=_send(_P5 + "dst_layer_ids: Optional[Sequence[int]] = None,"),
        ),
    ),
    "missing-parameter": (
        "missing_parameter",
        backend_source(
            send=_send(_P5 + "dst_layer_ids: Optional[Sequence[int]] = None," + _P13),
            capabilities='frozenset({"layer_ids"})',
        ),
    ),
    "unknown-parameter": (
        "unknown_parameter",
        backend_source(
            send=_send(
                _P5 + "dst_layer_ids: Optional[Sequence[int]] = None,\n"
                "dst_device_indices: NDArray[np.int32] | None = None,"
                "\ndst_kv_item_len: int | None = None,\ndst_attn_tp_size: int | None = None,"
            )
        ),
    ),
    "parameter-order": (
        "parameter_order",
        backend_source(
            send=_send(
                "session_id: str,\nprefill_kv_indices: NDArray[np.int32],\ndst_kv_indices: NDArray[np.int32],\n"
                "dst_kv_ptrs: Sequence[int],\nexecutor: Optional[Executor],\n"
                "dst_layer_ids: Optional[Sequence[int]] = None,\n"
                "dst_device_kv_indices: NDArray[np.int32] | None = None,"
                "\ndst_kv_item_len: int | None = None,\ndst_attn_tp_size: int | None = None,"
            )
        ),
    ),
    "parameter-kind": (
        "parameter_kind",
        backend_source(
            send=_send(
                _P5 + "*,\ndst_layer_ids: Optional[Sequence[int]] = None,\n"
                "dst_device_kv_indices: NDArray[np.int32] | None = None,"
                "\ndst_kv_item_len: int | None = None,\ndst_attn_tp_size: int | None = None,"
            )
        ),
    ),
    "default-mismatch": (
        "default_mismatch",
        backend_source(
            send=_send(
                _P5 + "dst_layer_ids: Optional[Sequence[int]] = (),\n"
                "dst_device_kv_indices: NDArray[np.int32] | None = None,"
                "\ndst_kv_item_len: int | None = None,\ndst_attn_tp_size: int | None = None,"
            )
        ),
    ),
    "annotation-mismatch": (
        "annotation_mismatch",
        backend_source(
            send=_send(
                _P5.replace("session_id: str", "session_id: bytes") + "dst_layer_ids: Optional[Sequence[int]] = None,\n"
                "dst_device_kv_indices: NDArray[np.int64] | None = None,"
                "\ndst_kv_item_len: int | None = None,\ndst_attn_tp_size: int | None = None,"
            )
        ),
    ),
    "var-args": (
        "var_args",
        backend_source(send=_send(_P5 + "**kwargs: object,")),
    ),
    "unknown-hook": (
        "unknown_hook",
        backend_source(extra="\n    @kvwire.hookimpl\n    def send_kv_cache(self) -> int:\n        return 0\n"),
    ),
    "missing-hook": ("missing_hook", backend_source(close=False)),
    "spec-version": ("spec_version", backend_source(spec_version='"2.0"')),
    "constructor": (
        "constructor",
        backend_source(init="    def __init__(self, host: str, port: int) -> None:\n        self.host = host\n"),
    ),
    "import-error": (
        "import_error",
        backend_source(prelude='raise ImportError("libfake_transport.so: cannot open shared object file")\n\n'),
    ),
    "twin-a": ("twin", backend_source()),
    "twin-b": ("twin", backend_source()),
    # Hostile at import or in availability(): `kvwire check` must survive them, and `connect("local")` never sees them.
    "exit": ("exit_plugin", backend_source(prelude="import sys\n\nsys.exit(0)\n\n")),
    "base-exception": (
        "base_exception",
        backend_source(
            prelude=(
                'class PluginAbort(BaseException):\n    pass\n\n\nraise PluginAbort("transport self-test failed")\n\n'
            )
        ),
    ),
    "os-exit": ("os_exit", backend_source(prelude="import os\n\nos._exit(3)\n\n")),
    "keyboard-interrupt": ("keyboard_interrupt", backend_source(prelude="raise KeyboardInterrupt\n\n")),
    "segfault": ("segfault", backend_source(prelude="import ctypes\n\nctypes.string_at(0)\n\n")),
    "import-loop": ("import_loop", backend_source(prelude="import time\n\nwhile True:\n    time.sleep(0.05)\n\n")),
    "print-noise": ("print_noise", backend_source(prelude='print("noise")\n\n')),
    "fd-noise": ("fd_noise", backend_source(prelude='import os\n\nos.write(1, b"noise")\n\n')),
    "hung-availability": (
        "hung_availability",
        backend_source(
            extra=(
                "\n    @classmethod\n    def availability(cls) -> str | None:\n"
                "        import time\n\n        while True:\n            time.sleep(0.05)\n"
            )
        ),
    ),
}

#: Entry-point names of the variants that end or hang the process that imports them (or probes their runtime).
FATAL_IN_PROCESS = frozenset({"os_exit", "segfault", "import_loop", "hung_availability", "keyboard_interrupt"})
#: Entry-point names of the variants that write to stdout at import.
NOISY = frozenset({"print_noise", "fd_noise"})

PYPROJECT = """\
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "kvtest-{suffix}"
version = "0.3.{index}"
dependencies = ["kvwire"]

[project.entry-points."kvwire.backends"]
{name} = "{module}:Backend"

[tool.setuptools]
py-modules = ["{module}"]
"""


def build_and_install(workdir: Path) -> Path:
    """Build every variant's wheel and install them all into ``workdir/site``; return that path."""
    src_root = workdir / "src"
    wheels = workdir / "wheels"
    site = workdir / "site"
    projects = []
    for index, (suffix, (name, source)) in enumerate(VARIANTS.items()):
        module = "kvtest_" + suffix.replace("-", "_")
        project = src_root / suffix
        project.mkdir(parents=True)
        (project / "pyproject.toml").write_text(PYPROJECT.format(suffix=suffix, index=index, name=name, module=module))
        (project / f"{module}.py").write_text(source)
        projects.append(str(project))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), *projects], check=True)
    built = sorted(str(p) for p in wheels.glob("*.whl"))
    assert len(built) == len(VARIANTS), built
    subprocess.run([*pip, "install", "--no-deps", "--target", str(site), *built], check=True)
    return site


#: ``run(*python_args, env=None)``: Python in a fresh process that sees the installed test wheels.
RunPy = Callable[..., subprocess.CompletedProcess[str]]


def check_json(run: RunPy, *extra: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """``kvwire check --json`` through the plugins, as {name: entry}."""
    proc = run("-m", "kvwire", "check", "--json", *extra, env=env)
    assert proc.stdout, proc.stderr
    return proc.returncode, {entry["name"]: entry for entry in json.loads(proc.stdout)}
