"""``MooncakeOptions``: the Mooncake backend's keys in ``BackendConfig.options``, parsed and checked.

Keys (all optional):

``max_descriptors_per_call``
    Descriptors per engine call, 1..2048 (default 1024); longer writes are cut
    into calls of this size. Mooncake's TCP transport fails, and can break the
    session to that peer for good, beyond about 2060 outstanding descriptors.
``max_inflight_per_peer``
    Descriptors outstanding to one peer across all threads, 1..2048 (default
    1024), at least ``max_descriptors_per_call``.
``restrict_listeners``
    True (default) or False. Mooncake's handshake and TCP data listeners bind
    every interface whatever ``BackendConfig.host`` says; by default kvwire
    attaches a socket filter to the listeners of each engine it creates, so they
    accept connections only on the host's addresses (see the plugin's README,
    "Security"). False leaves them open on every interface (for NAT or
    port-forwarding set-ups, where peers reach an address that is not the
    host's). Never applies to a host's own ``engine``.
``engine``
    A Mooncake ``TransferEngine`` the host created and initialised itself, or
    None. kvwire then registers and writes through it and never creates, renews,
    or destroys an engine, nor touches the environment or fd 2 (see the
    plugin's README, "Embedding").
``host_registered``
    With ``engine`` only: True when the host has already registered the KV
    memory with its engine (sglang registers its pools itself). kvwire then
    records the layout's ranges for its own checks and never calls the engine's
    ``register_memory``/``unregister_memory`` (default False).

Integers may be given as decimal strings (the ``kvwire`` CLI passes strings)
and booleans are refused for them; ``restrict_listeners`` takes a bool or one of
the strings ``true``/``false``/``1``/``0``/``yes``/``no``/``on``/``off``. Every
error is a :class:`kvwire.ConfigError` naming ``BackendConfig.options['<key>']``.
"""

from __future__ import annotations

import difflib
import numbers
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Final

from kvwire.config import BackendConfig
from kvwire.errors import ConfigError

if TYPE_CHECKING:
    from kvwire_mooncake.engine.binding import TransferEngineLike

__all__ = ["MAX_DESCRIPTORS_LIMIT", "MooncakeOptions"]

#: Upper bound of both descriptor limits: Mooncake's TCP transport breaks beyond ~2060 queued per peer.
MAX_DESCRIPTORS_LIMIT: Final = 2048
_DECIMAL: Final = re.compile(r"[+-]?[0-9]+")
_TRUE: Final = frozenset({"true", "1", "yes", "on"})
_FALSE: Final = frozenset({"false", "0", "no", "off"})


def _key(name: str) -> str:
    return f"BackendConfig.options[{name!r}]"


def _as_int(name: str, value: object) -> int:
    """``value`` as an int in ``[1, MAX_DESCRIPTORS_LIMIT]``: an int, or a string of decimal digits."""
    if isinstance(value, str) and _DECIMAL.fullmatch(value.strip()):
        value = int(value.strip())
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ConfigError(f"{_key(name)} must be an int or a decimal string, got {type(value).__name__} {value!r}")
    number = int(value)
    if not 1 <= number <= MAX_DESCRIPTORS_LIMIT:
        raise ConfigError(f"{_key(name)} must be in [1, {MAX_DESCRIPTORS_LIMIT}], got {number}")
    return number


def _as_bool(name: str, value: object) -> bool:
    """``value`` as a bool: a bool, or one of the strings in ``_TRUE`` / ``_FALSE`` (any case)."""
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    if not isinstance(value, bool):
        raise ConfigError(f"{_key(name)} must be a bool or 'true'/'false', got {type(value).__name__} {value!r}")
    return value


def _check_engine(engine: object) -> None:
    """ConfigError unless ``engine`` has every method of TransferEngineLike (a callable attribute of that name)."""
    from kvwire_mooncake.engine.binding import ENGINE_METHODS  # not at import: kvwire_mooncake.engine imports us

    missing = [name for name in ENGINE_METHODS if not callable(getattr(engine, name, None))]
    if missing:
        raise ConfigError(
            f"{_key('engine')} must be an initialised Mooncake TransferEngine or None; "
            f"got {type(engine).__name__}, which lacks {', '.join(missing)}"
        )


@dataclass(frozen=True)
class MooncakeOptions:
    """The checked options; construct with :meth:`from_config` (direct construction checks the same)."""

    max_descriptors_per_call: int = 1024
    max_inflight_per_peer: int = 1024
    engine: TransferEngineLike | None = None
    restrict_listeners: bool = True
    host_registered: bool = False

    KEYS: ClassVar[tuple[str, ...]] = (
        "engine",
        "host_registered",
        "max_descriptors_per_call",
        "max_inflight_per_peer",
        "restrict_listeners",
    )

    def __post_init__(self) -> None:
        per_call = _as_int("max_descriptors_per_call", self.max_descriptors_per_call)
        inflight = _as_int("max_inflight_per_peer", self.max_inflight_per_peer)
        if inflight < per_call:
            raise ConfigError(
                f"{_key('max_inflight_per_peer')} must be >= max_descriptors_per_call, got {inflight} < {per_call}"
            )
        if self.engine is not None:
            _check_engine(self.engine)
        object.__setattr__(self, "max_descriptors_per_call", per_call)
        object.__setattr__(self, "max_inflight_per_peer", inflight)
        object.__setattr__(self, "restrict_listeners", _as_bool("restrict_listeners", self.restrict_listeners))
        host_registered = _as_bool("host_registered", self.host_registered)
        if host_registered and self.engine is None:
            raise ConfigError(
                f"{_key('host_registered')} applies to a host's own engine: pass BackendConfig.options['engine'] too"
            )
        object.__setattr__(self, "host_registered", host_registered)

    @classmethod
    def from_config(cls, config: BackendConfig) -> MooncakeOptions:
        """Parse ``config.options``; an unknown key is a ConfigError listing the known ones."""
        options: dict[str, Any] = dict(config.options)
        for name in sorted(options):
            if name not in cls.KEYS:
                close = difflib.get_close_matches(name, cls.KEYS, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                known = ", ".join(repr(k) for k in cls.KEYS)
                raise ConfigError(f"{_key(name)} is not a Mooncake option (known: {known}){hint}")
        return cls(**options)
