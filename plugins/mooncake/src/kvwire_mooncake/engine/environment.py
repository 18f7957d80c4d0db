"""Mooncake's ``MC_*`` environment variables: read as the engine reads them, set only when allowed.

The engine takes its timeouts and log level from the process environment, so
setting them is a process-wide side effect. :func:`prepare_environment` is
called only when ``BackendConfig.process_settings`` is on and kvwire creates
the engine itself; it never overrides a value the user set.
:func:`engine_timeout_s` only reads (it tells a failure the engine ended by its
own deadline apart from a fast one).
"""

from __future__ import annotations

import math
import os
import threading

from kvwire.config import BackendConfig

__all__ = ["engine_timeout_s", "prepare_environment"]

#: The values this module put into ``os.environ``: a value equal to ours was not set by the user.
_OWN_ENV: dict[str, str] = {}
_ENV_LOCK = threading.Lock()


def _env_seconds(name: str, default: int) -> int:
    """An integer-seconds variable as Mooncake parses it (``atoi``, values <= 0 mean the default)."""
    try:
        value = int(os.environ.get(name, ""))
    except ValueError:
        return default
    return value if value > 0 else default


def _set_env(name: str, value: int, *, lower_only: bool) -> None:
    """Set ``name`` unless the user did; with ``lower_only``, only ever lower our own earlier value."""
    current = os.environ.get(name)
    if current is not None and _OWN_ENV.get(name) != current:
        return  # the user's
    if current is not None and lower_only and _env_seconds(name, 0) <= value:
        return
    if current != str(value):
        os.environ[name] = _OWN_ENV[name] = str(value)


def engine_timeout_s() -> float:
    """Seconds after which the engine itself fails a write to a silent peer (the stricter TCP deadline).

    Read from the environment as Mooncake reads it (30 s when unset), whoever set it.
    """
    return float(min(_env_seconds("MC_TCP_STATUS_TIMEOUT_SEC", 30), _env_seconds("MC_TCP_PROGRESS_TIMEOUT_SEC", 30)))


def prepare_environment(config: BackendConfig) -> None:
    """Set Mooncake's environment from ``config``, never overriding a value the user set.

    Process-wide: callers do so only with ``config.process_settings``. Where and
    when Mooncake reads each variable (0.3.13 binary and source):

    * ``MC_LOG_LEVEL``: once per process, when ``mooncake.engine`` is imported
      (later changes are ignored). Set to ``ERROR`` unless ``config.verbose``.
    * ``MC_HANDSHAKE_CONNECT_TIMEOUT``: once per process, at import (default 5 s);
      bounds ``connect()`` of the handshake to an unroutable address.
    * ``MC_TRANSFER_TIMEOUT``: when a ``TransferEngine`` is constructed; bound on a
      whole batch (plus 1 s per GiB), clamped to >= 5 s (default 30 s). Set per
      engine to ``ceil(timeout_s)``.
    * ``MC_TCP_STATUS_TIMEOUT_SEC`` / ``MC_TCP_PROGRESS_TIMEOUT_SEC``: at every
      transfer; deadlines for the peer's acknowledgement and for payload progress
      (default 30 s each). These end a write to a frozen peer. Set to 80% of
      ``timeout_s`` (>= 1 s) so the engine gives up, and frees the call, before the
      Python-side deadline. Process-wide: with several engines the strictest wins.
    """
    with _ENV_LOCK:
        if not config.verbose and "MC_LOG_LEVEL" not in os.environ:
            os.environ["MC_LOG_LEVEL"] = _OWN_ENV["MC_LOG_LEVEL"] = "ERROR"
        engine_s = max(1, int(config.timeout_s * 0.8))
        _set_env("MC_HANDSHAKE_CONNECT_TIMEOUT", engine_s, lower_only=True)
        _set_env("MC_TCP_STATUS_TIMEOUT_SEC", engine_s, lower_only=True)
        _set_env("MC_TCP_PROGRESS_TIMEOUT_SEC", engine_s, lower_only=True)
        _set_env("MC_TRANSFER_TIMEOUT", max(5, math.ceil(config.timeout_s)), lower_only=False)
