"""The host releases kvwire's integrations are written and tested for, and what happens on another one.

kvwire's sglang plugin subclasses sglang's Mooncake manager and its vLLM connector implements vLLM's
``KVConnectorBase_V1``: both follow those hosts' internals, which change between releases. On a release
not listed in :data:`SUPPORTED`, the integration refuses to start with the reason, unless the operator
names what to do instead with ``KVWIRE_<HOST>_UNSUPPORTED``:

``fallback`` (sglang only)
    start without kvwire: sglang's own Mooncake path carries the KV, and one warning says so;
``try``
    use kvwire anyway (untested: any drift in the host's internals is the operator's risk).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from importlib.metadata import PackageNotFoundError, version
from typing import Final, Literal

from kvwire.errors import ConfigError

__all__ = ["SUPPORTED", "UnsupportedHostError", "host_decision", "setting_name"]

#: Each host's releases kvwire is tested against (``make test-all``), oldest first, as ``importlib.metadata``
#: spells them. vLLM 0.32.0 is the previous minor release; its ``KVConnectorBase_V1`` lacks three methods 0.33.0
#: added (``supports_sleep_mode``, ``unregister_kv_caches``, ``restore_kv_caches``), none of which kvwire's
#: connector overrides.
SUPPORTED: Final[Mapping[str, tuple[str, ...]]] = {"sglang": ("0.5.23",), "vllm": ("0.32.0", "0.33.0")}
_CHOICES: Final[Mapping[str, tuple[str, ...]]] = {"sglang": ("fallback", "try"), "vllm": ("try",)}

Decision = Literal["use", "fallback", "try"]


class UnsupportedHostError(ConfigError):
    """The host's release is not one kvwire supports, and no ``KVWIRE_<HOST>_UNSUPPORTED`` choice was made."""


def setting_name(host: str) -> str:
    """``KVWIRE_SGLANG_UNSUPPORTED`` for ``sglang``."""
    return f"KVWIRE_{host.upper()}_UNSUPPORTED"


def host_decision(host: str, found: str | None = None, env: Mapping[str, str] | None = None) -> Decision:
    """``"use"`` on a supported release, else the operator's ``fallback`` or ``try``, else
    :class:`UnsupportedHostError` naming the release found, those supported and the setting.

    ``found`` defaults to the installed distribution's version (``"not installed"`` when there is none).
    """
    supported = SUPPORTED[host]
    if found is None:
        try:
            found = version(host)
        except PackageNotFoundError:
            found = "not installed"
    if found in supported:
        return "use"
    var, choices = setting_name(host), _CHOICES[host]
    raw = (os.environ if env is None else env).get(var, "").strip()
    if raw in choices:
        return "try" if raw == "try" else "fallback"
    if raw:
        raise UnsupportedHostError(f"${var}={raw!r} is not one of {', '.join(choices)}")
    what = {"fallback": "fallback (run without kvwire)", "try": "try (use kvwire untested)"}
    raise UnsupportedHostError(
        f"{host} {found} is not a release kvwire supports (tested: {', '.join(supported)}); install "
        f"{host}=={supported[-1]}, or set {var} to " + " or ".join(what[c] for c in choices)
    )
