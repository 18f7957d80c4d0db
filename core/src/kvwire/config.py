"""``BackendConfig``: the one constructor argument every backend takes.

A single config type for all backends means a backend constructor cannot
drift: new options become fields with defaults, and backend-specific settings
go in ``options``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from kvwire.errors import ConfigError

__all__ = ["BackendConfig"]

#: Mooncake's TCP transport poisons a peer beyond ~2060 queued descriptors.
_MAX_DESCRIPTORS_LIMIT = 2048


@dataclass(frozen=True)
class BackendConfig:
    """Settings shared by every backend; all fields have sane defaults.

    Attributes:
        host: local address this endpoint listens on and advertises.
        protocol: transport protocol (``"tcp"``, ``"rdma"``, ``"ascend"``...).
        metadata_server: ``"P2PHANDSHAKE"`` (no server) or a metadata-server URL.
        device: device names for RDMA NICs or accelerators (``"mlx5_0"``, ``"npu:0"``).
        timeout_s: a transfer that has not completed after this long fails with
            :class:`~kvwire.TransferTimeoutError` (never a hang).
        max_descriptors_per_call: descriptors per engine call; larger plans are chunked.
        max_inflight_per_peer: descriptors outstanding to one peer across threads.
        verbose: let the engine's own logging through (quiet by default).
        options: backend-specific settings, strings only (documented per backend).
    """

    host: str = "127.0.0.1"
    protocol: str = "tcp"
    metadata_server: str = "P2PHANDSHAKE"
    device: str = ""
    timeout_s: float = 10.0
    max_descriptors_per_call: int = 1024
    max_inflight_per_peer: int = 1024
    verbose: bool = False
    options: Mapping[str, str] = field(default_factory=dict)

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
        for name in ("max_descriptors_per_call", "max_inflight_per_peer"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"BackendConfig.{name} must be an int, got {value!r}")
            if not 1 <= value <= _MAX_DESCRIPTORS_LIMIT:
                raise ConfigError(f"BackendConfig.{name} must be in [1, {_MAX_DESCRIPTORS_LIMIT}], got {value}")
        if self.max_inflight_per_peer < self.max_descriptors_per_call:
            raise ConfigError(
                "BackendConfig.max_inflight_per_peer must be >= max_descriptors_per_call, got "
                f"{self.max_inflight_per_peer} < {self.max_descriptors_per_call}"
            )
        if not isinstance(self.verbose, bool):
            raise ConfigError(f"BackendConfig.verbose must be a bool, got {self.verbose!r}")
        if not isinstance(self.options, Mapping):
            raise ConfigError(f"BackendConfig.options must be a mapping, got {type(self.options).__name__}")
        for key, value in self.options.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigError(f"BackendConfig.options must map str to str, got {key!r}: {value!r}")
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable fields (for handing the same settings to a child process)."""
        return {f.name: dict(self.options) if f.name == "options" else getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackendConfig:
        """Inverse of :meth:`to_dict`; unknown keys are a ConfigError naming them."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"BackendConfig: unknown field(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(data))

    def option(self, key: str, default: str) -> str:
        """A backend-specific option, or ``default``."""
        return self.options.get(key, default)
