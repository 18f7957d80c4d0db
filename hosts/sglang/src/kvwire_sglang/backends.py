"""Which kvwire backend carries sglang's KV: kvwire-mooncake (or kvwire-hisparse) over sglang's own Mooncake
engine by default; any other installed backend, on an engine of its own, when :data:`BACKEND_ENV` names it."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Final

from kvwire.errors import KvwireError
from kvwire.registry.manager import default_registry

__all__ = ["BACKEND_ENV", "OVER_SGLANGS_ENGINE", "PLAIN_BACKEND", "SPLIT_BACKEND", "chosen_backend", "default_backend"]

#: The backend that serves every decode but a HiSparse one (kvwire-mooncake).
PLAIN_BACKEND: Final = "mooncake"
#: The same transport plus split host/device destinations (kvwire-hisparse), preferred when installed.
SPLIT_BACKEND: Final = "hisparse"
#: The backends that drive sglang's own Mooncake engine (they take it as ``options["engine"]``).
OVER_SGLANGS_ENGINE: Final = frozenset({PLAIN_BACKEND, SPLIT_BACKEND})
#: The variable naming the kvwire backend that carries sglang's KV (unset: :func:`default_backend`), e.g. ``nixl``
#: or a third party's installed backend; set it to the same value on the prefill and the decode servers.
BACKEND_ENV: Final = "KVWIRE_SGLANG_BACKEND"

log = logging.getLogger("kvwire.sglang")


def default_backend() -> str:
    """``hisparse`` when kvwire-hisparse is installed and allowed, else ``mooncake``.

    kvwire-hisparse is kvwire-mooncake's transport (the same options, the same engine) plus
    split host/device destinations (``dst_device_kv_indices``), which a HiSparse decode needs;
    so a prefill takes it whenever it can and serves both kinds of decode.
    """
    try:
        default_registry().get(SPLIT_BACKEND)
    except KvwireError as exc:
        log.info("kvwire: backend %r not usable (%s); using %r", SPLIT_BACKEND, exc, PLAIN_BACKEND)
        return PLAIN_BACKEND
    return SPLIT_BACKEND


def chosen_backend(env: Mapping[str, str] | None = None) -> tuple[str, bool]:
    """(the backend that carries sglang's KV, whether it drives sglang's own engine).

    :data:`BACKEND_ENV` when set (a name, or ``module:Class``), else :func:`default_backend`. ``mooncake``
    and ``hisparse`` drive sglang's Mooncake engine; any other backend opens its own.
    """
    name = (os.environ if env is None else env).get(BACKEND_ENV, "").strip()
    if not name:
        return default_backend(), True
    return name, name in OVER_SGLANGS_ENGINE
