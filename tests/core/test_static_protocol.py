"""``kvwire.spec.protocol.BackendProtocol``: equal to the hookspecs, and what ``mypy --strict`` reports with it.

mypy reports a missing parameter and a renamed one; it does not compare default
values, so a wrong default passes mypy and is left to the load-time validator
(asserted here as it is).
"""

from __future__ import annotations

import importlib.util
import inspect
import re
import subprocess
import sys
import typing
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

import kvwire
from kvwire.registry.findings import BackendOrigin
from kvwire.spec import CURRENT, HOOK_FEATURES, BackendSpec, spec_hooks
from kvwire.spec.protocol import BackendProtocol

Shape = list[tuple[str, object, object, object]]


def _shape(func: Callable[..., object]) -> Shape:
    """(name, kind, default, resolved annotation) of each parameter but ``self``, then the return annotation."""
    hints = typing.get_type_hints(func)
    params = list(inspect.signature(func).parameters.values())[1:]
    return [(p.name, p.kind, p.default, hints[p.name]) for p in params] + [("return", None, None, hints["return"])]


REQUIRED = [h for h in spec_hooks(CURRENT) if h not in HOOK_FEATURES]


def test_protocol_has_exactly_the_required_hooks_of_the_current_spec() -> None:
    """Optional hooks (spec 1.5: submit, notifications) are not in it: a static type cannot make them optional."""
    members = {n for n in vars(BackendProtocol) if not n.startswith("_") and callable(getattr(BackendProtocol, n))}
    assert members == set(REQUIRED)


@pytest.mark.parametrize("hook", REQUIRED)
def test_protocol_signature_equals_the_hookspec(hook: str) -> None:
    assert getattr(BackendSpec, hook) is getattr(BackendProtocol, hook)  # one declaration, marked as the hookspec
    assert getattr(BackendSpec, hook).kvwire_spec == {  # type: ignore[attr-defined]
        "firstresult": True, "historic": False, "warn_on_impl": None, "warn_on_impl_args": None
    }
    spec = _shape(getattr(BackendSpec, hook))
    get_overloads: Callable[[Callable[..., object]], list[Callable[..., object]]] | None = getattr(
        typing, "get_overloads", None
    )
    if get_overloads is None:
        pytest.skip("typing.get_overloads needs Python 3.11")
    overloads = get_overloads(getattr(BackendProtocol, hook))
    if len(spec) == 1:  # no parameter: nothing to name
        assert overloads == []
        return
    positional, keyword = (_shape(f) for f in overloads)
    assert positional == spec
    kw = inspect.Parameter.KEYWORD_ONLY
    assert keyword == [(n, kw if n != "return" else None, d, a) for n, _, d, a in spec]


# -- mypy --strict on backend modules of a backend author's repository -------

HEADER = """\
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire.spec.protocol import BackendProtocol


class Backend:
    spec_version = "1.4"
    capabilities = frozenset({"layer_ids", "device_kv_indices", "mha", "host_memory"})

    def __init__(self, config: kvwire.BackendConfig) -> None:
        self.config = config

    @kvwire.hookimpl
    def register_kv_buffers(self, layout: kvwire.KVLayout) -> None:
        pass

    @kvwire.hookimpl
    def endpoint(self) -> str:
        return "test://endpoint"

    @kvwire.hookimpl
    def add_peer(self, session_id: str, layout: kvwire.KVLayout) -> None:
        pass

    @kvwire.hookimpl
    def remove_peer(self, session_id: str) -> None:
        pass

    @kvwire.hookimpl
    def close(self) -> None:
        pass

    @kvwire.hookimpl
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int:
        return 0


def _check(backend: Backend) -> BackendProtocol:
    return backend
"""

#: module name -> source, as in a backend author's repository
MODULES = {
    "correct": HEADER,
    # sglang #33523: the override kept up with everything but dst_device_kv_indices
    "seed_drift": HEADER.replace("        dst_device_kv_indices: NDArray[np.int32] | None = None,\n", ""),
    "renamed": HEADER.replace("def add_peer(self, session_id: str", "def add_peer(self, session: str"),
    "wrong_default": HEADER.replace(
        "dst_layer_ids: Sequence[int] | None = None", "dst_layer_ids: Sequence[int] | None = ()"
    ),
}


@pytest.fixture(scope="module")
def mypy_output(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """mypy --strict over every module at once; its output lines, per module."""
    pytest.importorskip("mypy", reason="mypy is a dev dependency (make setup)")
    work = tmp_path_factory.mktemp("author-repo")
    for name, source in MODULES.items():
        (work / f"{name}.py").write_text(source)
    proc = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir", str(work / ".cache")]
        + [f"{name}.py" for name in MODULES],
        capture_output=True,
        text=True,
        cwd=work,
        timeout=300,
    )
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr
    lines: dict[str, list[str]] = {name: [] for name in MODULES}
    for line in proc.stdout.splitlines():
        lines[line.split(".py:", 1)[0]].append(line)
    return lines


def _load(tmp_path: Path, name: str) -> ModuleType:
    path = tmp_path / f"{name}.py"
    path.write_text(MODULES[name])
    spec = importlib.util.spec_from_file_location(f"kvtest_static_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rules(tmp_path: Path, name: str) -> set[str]:
    result = kvwire.validate_backend(_load(tmp_path, name).Backend, BackendOrigin(name))
    return {f.rule for f in result.findings}


def _at(name: str) -> str:
    """``<module>.py:<line>:`` of the ``return backend`` line, where mypy reports a drifted class."""
    return f"{name}.py:{MODULES[name].splitlines().index('    return backend') + 1}:"


def _conflict(name: str) -> list[str]:
    return [
        f'{_at(name)} error: Incompatible return value type (got "Backend", expected "BackendProtocol")  '
        "[return-value]",
        f'{_at(name)} note: Following member(s) of "Backend" have conflicts:',
        f"{_at(name)} note:     Expected:",
    ]


@pytest.mark.slow
def test_mypy_accepts_a_correct_backend(mypy_output: dict[str, list[str]], tmp_path: Path) -> None:
    assert mypy_output["correct"] == []
    assert _rules(tmp_path, "correct") == set()


@pytest.mark.slow
def test_mypy_reports_the_seed_drift(mypy_output: dict[str, list[str]], tmp_path: Path) -> None:
    lines = mypy_output["seed_drift"]
    assert lines[:3] == _conflict("seed_drift")
    expected, got = 2, lines.index(f"{_at('seed_drift')} note:     Got:")
    assert any("dst_device_kv_indices" in line for line in lines[expected:got])
    impl = lines[got + 1]
    assert re.search(
        r"def send_kvcache\(self, session_id: str, .* dst_layer_ids: Sequence\[int\] \| None = \.\.\., ", impl
    )
    assert "dst_device_kv_indices" not in impl
    assert _rules(tmp_path, "seed_drift") == {"missing-parameter"}


@pytest.mark.slow
def test_mypy_reports_a_renamed_parameter(mypy_output: dict[str, list[str]], tmp_path: Path) -> None:
    lines = mypy_output["renamed"]
    assert lines[:3] == _conflict("renamed")
    assert f"{_at('renamed')} note:         def add_peer(self, *, session_id: str, layout: KVLayout) -> None" in lines
    assert lines[-1] == f"{_at('renamed')} note:         def add_peer(self, session: str, layout: KVLayout) -> None"
    assert _rules(tmp_path, "renamed") == {"unknown-parameter"}  # the validator, at load time


@pytest.mark.slow
def test_a_wrong_default_passes_mypy_and_the_validator_reports_it(
    mypy_output: dict[str, list[str]], tmp_path: Path
) -> None:
    """mypy checks that a default exists and has the parameter's type, never its value."""
    assert mypy_output["wrong_default"] == []
    assert _rules(tmp_path, "wrong_default") == {"default-mismatch"}
