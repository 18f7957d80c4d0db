"""Mooncake engine wheels: which ones are installed, and which one fits this host.

All Mooncake engine wheels ship the same top-level ``mooncake`` package, so two
of them overwrite each other's files. :func:`engine_conflict` is registered as a
``kvwire.install_checks`` entry point: ``kvwire check`` fails with its message.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from types import MappingProxyType

__all__ = ["ENGINE_WHEELS", "engine_conflict", "host_kind"]

#: The Mooncake engine wheels (normalised names) -> the hosts each is for. They all ship the same
#: top-level ``mooncake`` package, so two of them overwrite each other's files.
ENGINE_WHEELS: Mapping[str, str] = MappingProxyType(
    {
        "mooncake-transfer-engine-non-cuda": "hosts without CUDA: kvwire-mooncake[cpu]",
        "mooncake-transfer-engine": "CUDA 12 hosts: kvwire-mooncake[cuda]",
        "mooncake-transfer-engine-cuda13": "CUDA 13 hosts: kvwire-mooncake[cuda13]",
        "mooncake-transfer-engine-npu": "Ascend hosts: kvwire-ascend[npu]",
    }
)
_CUDA = ("mooncake-transfer-engine", "mooncake-transfer-engine-cuda13")
_NON_CUDA = "mooncake-transfer-engine-non-cuda"
_NPU = "mooncake-transfer-engine-npu"


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_engines() -> dict[str, str]:
    found: dict[str, str] = {}
    for dist in metadata.distributions():
        name = _normalise(dist.metadata["Name"] or "")
        if name in ENGINE_WHEELS:
            found.setdefault(name, dist.version)
    return found


def host_kind(find_library: Callable[[str], str | None] | None = None) -> str:
    """``"npu"`` (CANN set up), ``"cuda"`` (a CUDA driver) or ``"cpu"``: which engine wheel fits this host."""
    if find_library is None:
        import ctypes.util

        find_library = ctypes.util.find_library
    if os.environ.get("ASCEND_HOME_PATH") or find_library("ascendcl"):
        return "npu"
    if sys.platform.startswith("linux") and find_library("cuda"):
        return "cuda"
    return "cpu"


def _keep(installed: Sequence[str], host: str) -> str | None:
    """The installed wheel that fits ``host``, or None when that cannot be told (two CUDA builds, say)."""
    cuda = [n for n in _CUDA if n in installed]
    prefer = {"npu": [[_NPU], [_NON_CUDA]], "cuda": [cuda, [_NON_CUDA]], "cpu": [[_NON_CUDA]]}[host]
    for group in prefer:
        present = [n for n in group if n in installed]
        if len(present) == 1:
            return present[0]
        if present:
            return None
    return None


def engine_conflict(installed: Mapping[str, str] | None = None, host: str | None = None) -> str | None:
    """None when at most one Mooncake engine wheel is installed; else a message saying which to remove.

    ``installed`` (normalised name -> version) and ``host`` (see :func:`host_kind`)
    default to this environment and this machine.
    """
    found = dict(_installed_engines() if installed is None else installed)
    if len(found) < 2:
        return None
    names = sorted(found)
    listed = "; ".join(f"{n} {found[n]} ({ENGINE_WHEELS.get(n, '?')})" for n in names)
    head = (
        f"{len(names)} Mooncake engine wheels are installed: {listed}. They ship the same `mooncake` package "
        "and overwrite each other's files, so which engine loads is an accident of install order"
    )
    kind = host_kind() if host is None else host
    keep = _keep(names, kind)
    if keep is None:
        return (
            f"{head}. Keep the one for this host and remove the others: pip uninstall -y {' '.join(names)} "
            "&& pip install <the one>"
        )
    others = [n for n in names if n != keep]
    what = {"npu": "an Ascend host", "cuda": "a host with a CUDA driver", "cpu": "a host without CUDA or CANN"}[kind]
    return (
        f"{head}. This is {what}: keep {keep}, remove {', '.join(others)}: "
        f"pip uninstall -y {' '.join(names)} && pip install {keep}=={found[keep]} "
        "(uninstalling one deletes the files the other shares, so reinstall the one you keep)"
    )
