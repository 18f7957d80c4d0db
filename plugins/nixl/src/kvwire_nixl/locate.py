"""Finding NIXL without importing it (``kvwire check``), and importing it when a transport opens.

NIXL ships as ``nixl-cu12`` / ``nixl-cu13`` wheels (modules ``nixl_cu12`` /
``nixl_cu13``) and a ``nixl`` meta package that imports the one matching the
process's CUDA. kvwire-nixl uses the meta package when it is installed, else
the wheel found.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import socket
import sys
import warnings
from pathlib import Path
from types import ModuleType
from typing import Final

import kvwire

__all__ = ["MODULES", "WHEEL_MODULES", "efa_conflict", "find_ucx_plugin", "import_nixl", "nixl_availability"]

#: The modules that provide ``nixl_agent``, in the order they are tried.
MODULES: Final = ("nixl", "nixl_cu13", "nixl_cu12")
#: The modules of the NIXL wheels that hold the native code.
WHEEL_MODULES: Final = ("nixl_cu13", "nixl_cu12")
_INSTALL_HINT: Final = "pip install 'kvwire-nixl[cu12]' (or [cu13]), after a torch build of your choice"
_UCX_PLUGIN: Final = "libplugin_UCX.so"
_LIB_DIRS: Final = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64")


def _package_dir(module: str) -> Path | None:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def find_ucx_plugin(module: str) -> Path | None:
    """NIXL's UCX plugin for wheel ``module`` (``NIXL_PLUGIN_DIR`` first, then the wheel's own copies)."""
    package = _package_dir(module)
    candidates = []
    if os.environ.get("NIXL_PLUGIN_DIR"):
        candidates.append(Path(os.environ["NIXL_PLUGIN_DIR"]))
    if package is not None:
        site = package.parent
        candidates += [site / f"{module}.libs" / "nixl", site / f".{module}.mesonpy.libs" / "plugins"]
    return next((d / _UCX_PLUGIN for d in candidates if (d / _UCX_PLUGIN).is_file()), None)


def nixl_availability() -> str | None:
    """Why NIXL cannot run here, found without importing it; None when it looks usable."""
    wheels = [m for m in WHEEL_MODULES if _package_dir(m) is not None]
    if not wheels:
        return f"NIXL is not installed (no {' or '.join(WHEEL_MODULES)} module): {_INSTALL_HINT}"
    if not any(find_ucx_plugin(m) for m in wheels):
        return f"NIXL's UCX plugin ({_UCX_PLUGIN}) was not found in {', '.join(wheels)} nor in NIXL_PLUGIN_DIR"
    return None


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address or a name) is this machine's loopback, reachable from no other."""
    try:
        return socket.gethostbyname(host).startswith("127.")
    except OSError:
        return False


def efa_conflict() -> bool:
    """Whether the system has rdma-core's ``libefa.so.1``, which NIXL 1.5's UCX EFA module links unbundled.

    Loading it drags the system's libibverbs and libnl in next to the copies the
    NIXL wheel bundles, and the process then crashes (SIGSEGV, in libnl-route's
    destructor) when it exits, whatever kvwire tears down before.
    ``UCX_MODULES=^efa`` keeps that module out.
    """
    dirs = [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d] + list(_LIB_DIRS)
    return any((Path(d) / "libefa.so.1").exists() for d in dirs)


def import_nixl(config: kvwire.BackendConfig) -> ModuleType:
    """The NIXL module providing ``nixl_agent``; BackendUnavailableError when none imports.

    With ``config.process_settings``, variables NIXL and UCX read once, when their
    libraries load, get defaults (a value already set is kept): for a loopback
    ``config.host`` (the default 127.0.0.1) ``UCX_NET_DEVICES=lo``, so UCX's TCP
    listeners bind there only (for another host kvwire leaves the devices alone:
    naming one interface would drop UCX's RDMA devices too, and warns instead);
    ``UCX_MODULES=^efa``
    (see :func:`efa_conflict`), ``UCX_LOG_FILE=stderr`` and, unless ``verbose``,
    ``NIXL_LOG_LEVEL=ERROR`` and ``UCX_LOG_LEVEL=error``. Without it the environment is left alone, and a
    RuntimeWarning says when this process will crash at exit. Either way a RuntimeWarning says when UCX
    will listen on every interface.
    """
    first = not any(name in sys.modules for name in MODULES)
    # Restricting UCX's network devices to one interface would also drop its RDMA devices (mlx5_0:1, ...), so
    # kvwire does it only for a loopback host, where no peer is on another machine anyway.
    device = "lo" if is_loopback(config.host) else None
    if config.process_settings:
        if device is not None:  # UCX's TCP listeners then bind there only, not on every interface
            os.environ.setdefault("UCX_NET_DEVICES", device)
        os.environ.setdefault("UCX_MODULES", "^efa")
        os.environ.setdefault("UCX_LOG_FILE", "stderr")  # UCX logs to stdout by default
        if not config.verbose:
            os.environ.setdefault("NIXL_LOG_LEVEL", "ERROR")
            os.environ.setdefault("UCX_LOG_LEVEL", "error")
    if first and "UCX_NET_DEVICES" not in os.environ:
        warnings.warn(
            "kvwire-nixl: UCX will listen for connections on every network interface of this machine, whatever "
            f"BackendConfig.host ({config.host}) says; set UCX_NET_DEVICES to the interface of that address "
            "(and your RDMA devices, e.g. eth1,mlx5_0:1) before NIXL is imported"
            + ("" if device is None else ", or use BackendConfig(process_settings=True)"),
            RuntimeWarning,
            stacklevel=2,
        )
    if not config.process_settings and first and "UCX_MODULES" not in os.environ and efa_conflict():
        warnings.warn(
            "kvwire-nixl: this system's libefa.so.1 (rdma-core) will be loaded by NIXL's UCX EFA module next to "
            "the rdma-core bundled in the NIXL wheel, and the process will crash (SIGSEGV) when it exits. "
            "Set UCX_MODULES=^efa before NIXL is imported, or use BackendConfig(process_settings=True)",
            RuntimeWarning,
            stacklevel=2,
        )
    errors = []
    for name in MODULES:
        if _package_dir(name) is None:
            continue
        try:
            module = importlib.import_module(name)
        except (ImportError, OSError, RuntimeError) as exc:
            errors.append(f"{name}: {type(exc).__name__}: {exc}")
            continue
        if hasattr(module, "nixl_agent") and hasattr(module, "nixl_agent_config"):
            return module
        errors.append(f"{name}: has no nixl_agent")
    reason = "; ".join(errors) or f"NIXL is not installed: {_INSTALL_HINT}"
    raise kvwire.BackendUnavailableError(f"NIXL could not be imported: {reason}")
