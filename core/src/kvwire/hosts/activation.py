"""The one line a host process logs when kvwire starts carrying its KV (sglang's and vLLM's alike)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from kvwire.config import ResolvedConfig
from kvwire.registry.manager import default_registry

__all__ = ["activation_line", "configured"]


def _version(distribution: str) -> str:
    try:
        return version(distribution)
    except PackageNotFoundError:
        return "?"


def configured(resolved: ResolvedConfig | None) -> str:
    """``; configured: key=value (source), ...`` for each setting a variable or the config file made, else ''."""
    if resolved is None:
        return ""
    config = resolved.config
    made = [
        f"{key}={config.options[key[8:]] if key.startswith('options.') else getattr(config, key)!r} ({source})"
        for key, source in resolved.sources.items()
        if source.startswith(("$", "config file"))
    ]
    return f"; configured: {', '.join(made)}" if made else ""


def activation_line(connection: Any, host: str, role: str, detail: str, resolved: ResolvedConfig | None) -> str:
    """``kvwire V active in HOST V (role): backend 'name' (distribution V, spec S), detail; configured: ...``."""
    info = default_registry().get(connection.name)
    return (
        f"kvwire {_version('kvwire')} active in {host} {_version(host)} ({role}): backend {connection.name!r} "
        f"({info.distribution or 'registered at runtime'} {info.version or ''}, spec {connection.spec_version}), "
        f"{detail}{configured(resolved)}"
    )
