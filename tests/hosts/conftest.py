"""Host fixtures: sglang's released source, read from its wheels on PyPI (never installed, never imported).

A wheel is downloaded once per version with ``pip download --no-deps
--only-binary=:all:`` into ``$KVWIRE_TEST_CACHE`` (default
``~/.cache/kvwire-tests/sglang``), and its ``sglang/**/*.py`` extracted next to
it. Both steps write into a temporary directory first and then rename it into
place, so concurrent pytest sessions never see a half-written wheel or tree.

:func:`sglang_release_overlay` extracts a whole wheel instead (package data and ``dist-info`` too): put on
``PYTHONPATH`` in front of the pinned sglang venv, that release is the one sglang's processes import and the
one ``importlib.metadata`` reports.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
from offline import index_unreachable

from kvwire.hosts.host_range import SUPPORTED

DOWNLOAD_TIMEOUT_S = 600


class SourceUnavailable(Exception):
    """The wheel cannot be had (no index, no such version, a broken download): the reason says which."""


def cache_root() -> Path:
    return Path(os.environ.get("KVWIRE_TEST_CACHE") or Path.home() / ".cache" / "kvwire-tests" / "sglang")


def sglang_wheel_source(version: str) -> Path:
    """The directory holding sglang ``version``'s ``sglang/`` package source (``.py`` files only)."""
    base = cache_root() / version
    tree = base / "src"
    if not (tree / "sglang").is_dir():
        base.mkdir(parents=True, exist_ok=True)
        _extract(_download(version, base / "wheel"), tree)
    return tree


def _download(version: str, directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    cached = sorted(directory.glob(f"sglang-{version}-*.whl"))
    if cached:
        return cached[0]
    with tempfile.TemporaryDirectory(dir=directory, prefix=".download-") as tmp:
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        command += ["--disable-pip-version-check", "--quiet", f"sglang=={version}", "-d", tmp]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=DOWNLOAD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise SourceUnavailable(f"pip download sglang=={version} timed out after {DOWNLOAD_TIMEOUT_S} s") from None
        if proc.returncode != 0:
            lines = [line.strip() for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
            reason = lines[-1] if lines else f"exit status {proc.returncode}"
            raise SourceUnavailable(f"pip download sglang=={version} failed: {reason}")
        wheels = sorted(Path(tmp).glob(f"sglang-{version}-*.whl"))
        if not wheels:
            raise SourceUnavailable(f"pip download sglang=={version} produced no wheel")
        target = directory / wheels[0].name
        os.replace(wheels[0], target)  # atomic: a concurrent session's identical wheel is simply replaced
    return target


def sglang_release_overlay(version: str) -> Path:
    """A directory holding sglang ``version``'s whole wheel, extracted: its package and its ``dist-info``."""
    base = cache_root() / version
    tree = base / "overlay"
    if not (tree / "sglang").is_dir():
        base.mkdir(parents=True, exist_ok=True)
        _extract(_download(version, base / "wheel"), tree, everything=True)
    return tree


def _extract(wheel: Path, tree: Path, *, everything: bool = False) -> None:
    staging = Path(tempfile.mkdtemp(dir=tree.parent, prefix=".extract-"))
    try:
        try:
            with zipfile.ZipFile(wheel) as archive:
                for info in archive.infolist():
                    if everything or (info.filename.startswith("sglang/") and info.filename.endswith(".py")):
                        archive.extract(info, staging)  # zipfile drops ".." and absolute parts
        except zipfile.BadZipFile as exc:
            wheel.unlink(missing_ok=True)
            raise SourceUnavailable(f"{wheel.name} is not a valid wheel ({exc}); removed, retry") from None
        try:
            staging.rename(tree)
        except OSError:
            if not (tree / "sglang").is_dir():  # not a concurrent session's finished tree: a real failure
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _or_skip(fetch: Callable[[str], Path], what: str) -> Callable[[str], Path]:
    """``fetch``, skipping the test (through :func:`index_unreachable`) when the wheel cannot be had."""

    def get(version: str) -> Path:
        try:
            return fetch(version)
        except SourceUnavailable as exc:
            index_unreachable(f"sglang {version} {what} unavailable: {exc}")

    return get


@pytest.fixture(scope="session")
def sglang_source() -> Callable[[str], Path]:
    """``(version) -> Path`` of the directory holding that release's ``sglang/`` source; skips when unavailable."""
    return _or_skip(sglang_wheel_source, "source")


#: The vLLM releases the connector supports (kvwire.hosts.host_range.SUPPORTED), oldest first; make_venv.sh
#: builds the newest by default, into ``.venv-vllm``, and another one into ``.venv-vllm-<version>``.
VLLM_RELEASES: tuple[str, ...] = SUPPORTED["vllm"]


def vllm_venv_python(version: str) -> Path:
    """The interpreter of the pinned vLLM ``version`` venv, built by make_venv.sh when missing or stale.

    A cold build takes about 1-2 minutes; the test skips only when the package index is unreachable
    (make_venv.sh's exit 3).
    """
    root = Path(__file__).parents[2]
    venv = root / (".venv-vllm" if version == VLLM_RELEASES[-1] else f".venv-vllm-{version}")
    script = Path(__file__).parent / "vllm" / "make_venv.sh"
    env = {**os.environ, "VLLM_VERSION": version}
    proc = subprocess.run(
        ["bash", str(script), str(venv)], capture_output=True, text=True, timeout=1800, cwd=root, env=env
    )
    if proc.returncode == 3:
        index_unreachable(proc.stderr.strip().splitlines()[-1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    python = venv / "bin" / "python"
    shown = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.stdout.strip() == version, (venv, shown.stdout, shown.stderr[-2000:])
    return python


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The newest supported vLLM release's venv (``.venv-vllm``)."""
    return vllm_venv_python(VLLM_RELEASES[-1])


@pytest.fixture(scope="session", params=VLLM_RELEASES)
def each_vllm_python(request: pytest.FixtureRequest) -> Path:
    """Each supported vLLM release's venv in turn: a test taking it runs once per release."""
    return vllm_venv_python(request.param)


@pytest.fixture(scope="session")
def sglang_release() -> Callable[[str], Path]:
    """``(version) -> Path`` of :func:`sglang_release_overlay`; skips when the wheel cannot be had."""
    return _or_skip(sglang_release_overlay, "wheel")
