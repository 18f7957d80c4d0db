"""``ConnectorSettings``: the connector's keys in vLLM's ``kv_connector_extra_config``, parsed and checked.

``backend`` (required)
    The kvwire backend's name (``"mooncake"``, ``"nixl"``, or any installed one): the connection is
    made, and the backend validated, when the worker registers its KV cache.
``backend_options`` (``{}``)
    The backend's own keys (:attr:`kvwire.BackendConfig.options`).
``host`` (``"127.0.0.1"``), ``protocol`` (``"tcp"``), ``device`` (``""``)
    :class:`kvwire.BackendConfig`'s fields of the same names.
``transfer_timeout_s`` (``10``)
    :attr:`kvwire.BackendConfig.timeout_s`: a transfer that has not completed by then fails.
``side_channel_host`` (``"127.0.0.1"``), ``side_channel_port`` (``5710``)
    Where a prefill worker of TP rank ``r`` listens for the decode's registrations
    (``side_channel_port + r``). A non-loopback host needs the shared control key
    (``KVWIRE_CONTROL_KEY``, :mod:`kvwire.control.auth`) on both sides.
``lease_s`` (``30``)
    How long a prefill keeps a finished request's blocks for a decode that never asks for them.
``load_timeout_s`` (``30``)
    How long a decode waits for a request's blocks after registering them; past it the request's
    blocks are reported by ``get_block_ids_with_load_errors`` (and vLLM frees them). It must exceed
    ``transfer_timeout_s`` by more than a second: a prefill starts a write only if it ends before then.

``host``, ``protocol``, ``device``, ``transfer_timeout_s`` and ``backend_options`` left out of the extra config
come from kvwire's configuration (``$KVWIRE_CONFIG``, ``KVWIRE_*``; docs/configuration.md), then the defaults
above; ``backend_options`` given here merge over the options set there, key by key.

Every error is a :class:`kvwire.ConfigError` naming ``kv_connector_extra_config['<key>']`` and the fix. A key
the connector does not read is not an error (a deployment may share one extra config between connectors),
but it is logged as a warning naming the key, the closest known one and the keys read.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kvwire.config import BackendConfig, ResolvedConfig, check_seconds, resolve_config
from kvwire.errors import ConfigError

__all__ = ["DEFAULT_SIDE_CHANNEL_PORT", "ConnectorSettings", "EngineSide"]

log = logging.getLogger("kvwire.hosts.vllm")

DEFAULT_SIDE_CHANNEL_PORT: Final = 5710
_KEYS: Final = frozenset(
    {
        "backend",
        "backend_options",
        "host",
        "protocol",
        "device",
        "transfer_timeout_s",
        "side_channel_host",
        "side_channel_port",
        "lease_s",
        "load_timeout_s",
    }
)


def _key(name: str) -> str:
    return f"kv_connector_extra_config[{name!r}]"


def _text(extra: Mapping[str, Any], name: str, default: str) -> str:
    value = extra.get(name, default)
    if not isinstance(value, str):
        raise ConfigError(f"{_key(name)} must be a string, got {type(value).__name__} {value!r}")
    return value


def _seconds(extra: Mapping[str, Any], name: str, default: float) -> float:
    return check_seconds(extra.get(name, default), _key(name))


@dataclass(frozen=True)
class ConnectorSettings:
    """The parsed ``kv_connector_extra_config`` (see the module docstring for each key)."""

    backend: str
    backend_config: BackendConfig
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    lease_s: float = 30.0
    load_timeout_s: float = 30.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    #: ``backend_config`` and where each value came from (the extra config is "argument ...").
    resolved: ResolvedConfig | None = None

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        """Parse vLLM's ``kv_connector_extra_config``; ConfigError naming the key for anything wrong."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config must be a dict, got {type(extra).__name__}")
        for key in sorted(map(str, set(extra) - _KEYS)):
            close = difflib.get_close_matches(key, _KEYS, n=1)
            log.warning(
                "kvwire: kv_connector_extra_config[%r] is not read by kvwire's connector%s; it reads %s "
                "(a backend's own keys go in 'backend_options')",
                key,
                f" (did you mean {close[0]!r}?)" if close else "",
                sorted(_KEYS),
            )
        backend = extra.get("backend")
        if not isinstance(backend, str) or not backend:
            raise ConfigError(
                f'{_key("backend")} must name a kvwire backend (e.g. "mooncake" or "nixl"), got {backend!r}'
            )
        options = extra.get("backend_options", {})
        if not isinstance(options, Mapping):
            raise ConfigError(f"{_key('backend_options')} must be a dict, got {type(options).__name__}")
        port = extra.get("side_channel_port", DEFAULT_SIDE_CHANNEL_PORT)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ConfigError(f"{_key('side_channel_port')} must be a TCP port 1..65535, got {port!r}")
        # vLLM's keys over kvwire's configuration ($KVWIRE_CONFIG, KVWIRE_*) over the defaults
        resolved = resolve_config(
            host=_text(extra, "host", "127.0.0.1") if "host" in extra else None,
            protocol=_text(extra, "protocol", "tcp") if "protocol" in extra else None,
            device=_text(extra, "device", "") if "device" in extra else None,
            timeout_s=_seconds(extra, "transfer_timeout_s", 10.0) if "transfer_timeout_s" in extra else None,
            options=dict(options) if "backend_options" in extra else None,
        )
        config = resolved.config
        load_timeout_s = _seconds(extra, "load_timeout_s", 30.0)
        if load_timeout_s <= config.timeout_s + 1.0:
            raise ConfigError(
                f"{_key('load_timeout_s')} = {load_timeout_s:g} must exceed {_key('transfer_timeout_s')} = "
                f"{config.timeout_s:g} by more than 1 s: a prefill starts a write only if it ends (or fails) "
                "before the decode stops waiting; raise load_timeout_s or lower transfer_timeout_s"
            )
        return cls(
            backend=backend,
            backend_config=config,
            side_channel_host=_text(extra, "side_channel_host", "127.0.0.1") or "127.0.0.1",
            side_channel_port=port,
            lease_s=_seconds(extra, "lease_s", 30.0),
            load_timeout_s=load_timeout_s,
            extra=dict(extra),
            resolved=resolved,
        )


@dataclass(frozen=True)
class EngineSide:
    """What a connector knows of its engine: the settings, its TP size, its role and the model's KV heads.

    ``total_kv_heads`` is the model's (vLLM's ``model_config.get_total_num_kv_heads()``), or None when
    unknown: then only prefills of this engine's TP size are served. ``mla`` (``model_config.use_mla``):
    the KV cache is MLA's latent, the same on every TP rank, so the KV heads do not matter across TP sizes.
    """

    settings: ConnectorSettings
    tp_size: int
    producer: bool
    consumer: bool
    total_kv_heads: int | None = None
    mla: bool = False
