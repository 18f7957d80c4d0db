"""``BackendConfig``: the one constructor argument every backend takes.

A single config type for all backends means a backend constructor cannot
drift: new options become fields with defaults, and backend-specific settings
go in ``options`` (each backend documents and type-checks its own keys).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from kvwire.errors import ConfigError

__all__ = ["BackendConfig", "ResolvedConfig", "check_seconds", "resolve_config"]


@dataclass(frozen=True)
class BackendConfig:
    """Settings shared by every backend; all fields have sane defaults.

    Attributes:
        host: address this endpoint advertises to its peers, and the only
            address it accepts connections on where the backend can enforce
            that. Where an engine listens beyond it, and what a peer that can
            connect may do, is backend-specific: each backend's README says so
            in its "Security" section.
        protocol: transport protocol (``"tcp"``, ``"rdma"``, ``"ascend"``...).
        metadata_server: ``"P2PHANDSHAKE"`` (no server) or a metadata-server URL.
        device: device names for RDMA NICs or accelerators (``"mlx5_0"``, ``"npu:0"``).
        timeout_s: a transfer that has not completed after this long fails with
            :class:`~kvwire.TransferTimeoutError` (never a hang).
        verbose: let the engine's own logging through (quiet by default).
        process_settings: allow the backend to change process-wide state it
            would otherwise leave alone (environment variables its engine reads,
            capturing file descriptor 2 around engine creation). Off by default,
            so a host embedding kvwire finds its process as it left it; the
            ``kvwire`` CLI turns it on.
        options: backend-specific settings, keyed by name (each backend
            documents its keys and checks their types when it is created; an
            object such as a host's own engine instance may be passed here).
    """

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    device: str = ""
    timeout_s: float = 10.0
    verbose: bool = False
    process_settings: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("host", "protocol", "metadata_server", "device"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise ConfigError(f"BackendConfig.{name} must be a str, got {type(value).__name__} {value!r}")
        if not self.host:
            raise ConfigError("BackendConfig.host must not be empty")
        if not self.protocol:
            raise ConfigError("BackendConfig.protocol must not be empty")
        if isinstance(self.timeout_s, bool) or not isinstance(self.timeout_s, (int, float)):
            raise ConfigError(f"BackendConfig.timeout_s must be a number of seconds, got {self.timeout_s!r}")
        if not (self.timeout_s > 0 and math.isfinite(self.timeout_s)):
            raise ConfigError(f"BackendConfig.timeout_s must be finite and > 0, got {self.timeout_s!r}")
        for name in ("verbose", "process_settings"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"BackendConfig.{name} must be a bool, got {getattr(self, name)!r}")
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"BackendConfig.options must be a mapping, got {type(self.options).__name__}")
        for key in self.options:
            if not isinstance(key, str) or not key:
                raise ConfigError(f"BackendConfig.options keys must be non-empty str, got {key!r}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable fields (for handing the same settings to a child process).

        Raises ConfigError when an option is not JSON data (an engine object, say):
        such a config can only be used in this process.
        """
        options = dict(self.options)
        try:
            json.dumps(options)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"BackendConfig.options cannot be sent to another process: {exc}") from None
        return {f.name: options if f.name == "options" else getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackendConfig:
        """Inverse of :meth:`to_dict`; unknown keys are a ConfigError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"BackendConfig: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))

    @classmethod
    def from_sources(
        cls,
        path: str | os.PathLike[str] | None = None,
        *,
        env: Mapping[str, str] | None = None,
        **overrides: Any,
    ) -> BackendConfig:
        """A config from a file, the environment and arguments (docs/configuration.md).

        Precedence, highest first: ``overrides`` (a None value counts as not
        given) > ``KVWIRE_*`` variables of ``env`` (default ``os.environ``) >
        the TOML or JSON file at ``path`` (default ``$KVWIRE_CONFIG``) > the
        defaults; ``options`` merge key by key in that order. A bad key or
        value is a :class:`ConfigError` naming it and where it was set.
        Every kvwire entry point (``connect()``, the CLI, the sglang plugin,
        the vLLM connector) builds its config this way.
        """
        return resolve_config(path, env=env, **overrides).config

    def option(self, key: str, default: object = None) -> object:
        """A backend-specific option, or ``default``."""
        return self.options.get(key, default)


@dataclass(frozen=True)
class ResolvedConfig:
    """A :class:`BackendConfig` and where each of its values came from (``kvwire config`` prints this).

    ``sources`` maps a field name, or ``options.<key>`` for a backend option, to its source:
    ``"the default"``, ``"config file <path>"``, ``"$KVWIRE_<NAME>"`` or ``"argument <name>="``.
    """

    config: BackendConfig
    sources: Mapping[str, str]

    def lines(self) -> list[str]:
        """``field = value  (source)``, one per field and option, in field order."""
        rows: list[tuple[str, str, str]] = []
        for f in fields(self.config):
            if f.name == "options":
                for key, value in sorted(self.config.options.items()):
                    rows.append((f"options.{key}", _shown(value), self.sources.get(f"options.{key}", "argument")))
            else:
                rows.append((f.name, _shown(getattr(self.config, f.name)), self.sources.get(f.name, "argument")))
        width = max(len(r[0]) for r in rows)
        vwidth = min(40, max(len(r[1]) for r in rows))
        return [f"{name.ljust(width)} = {value.ljust(vwidth)}  ({source})" for name, value, source in rows]

    def to_dict(self) -> dict[str, Any]:
        """``{"config": {...}, "sources": {...}}`` (options that are not JSON data shown as their repr)."""
        config = {f.name: getattr(self.config, f.name) for f in fields(self.config) if f.name != "options"}
        config["options"] = {k: _jsonable(v) for k, v in self.config.options.items()}
        return {"config": config, "sources": dict(self.sources)}


def _jsonable(value: object) -> object:
    """``value`` if it is JSON data, else its repr (an engine object passed as an option)."""
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)
    return value


def _shown(value: object) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def resolve_config(
    path: str | os.PathLike[str] | None = None,
    *,
    env: Mapping[str, str] | None = None,
    **overrides: Any,
) -> ResolvedConfig:
    """:meth:`BackendConfig.from_sources`, keeping where each value came from."""
    from kvwire.settings.sources import gather

    base = BackendConfig()
    defaults = {f.name: getattr(base, f.name) for f in fields(BackendConfig)}
    gathered = gather(defaults, path, os.environ if env is None else env, overrides)
    try:
        config = BackendConfig(**gathered.values)
    except ConfigError as exc:
        raise ConfigError(gathered.explain(str(exc))) from None
    return ResolvedConfig(config, MappingProxyType(dict(gathered.sources)))


def check_seconds(value: object, what: str, *, zero: bool = False) -> float:
    """``value`` as a number of seconds: finite and > 0 (>= 0 with ``zero``), not a bool.

    :class:`kvwire.ConfigError` naming ``what`` otherwise: ``<what> must be a finite number of
    seconds > 0, got <value>``.
    """
    number = value if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    if not (math.isfinite(number) and (number >= 0 if zero else number > 0)):
        raise ConfigError(f"{what} must be a finite number of seconds {'>=' if zero else '>'} 0, got {value!r}")
    return float(number)
