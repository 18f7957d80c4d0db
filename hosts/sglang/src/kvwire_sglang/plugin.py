"""The sglang general plugin: sglang's ``MooncakeKVManager`` replaced by one that sends through kvwire.

sglang 0.5.23 runs every installed entry point of the group
``sglang.srt.plugins`` early in each of its processes (``load_plugins``), limited
to the names in ``SGLANG_PLUGINS`` when that is set, then applies the hooks the
plugins registered. :func:`register` registers a class ``REPLACE`` of
``sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager`` by
``KvwireKVManager``, a subclass (``isinstance`` keeps working): sglang's
``get_kv_class`` imports the manager from that module on every call, and
``apply_hooks`` rebinds the names other modules imported, so the prefill and
the decode build kvwire's manager wherever they build sglang's.
"""

from __future__ import annotations

import logging
from typing import Final

__all__ = ["TARGET", "register"]

#: The class sglang builds for ``--disaggregation-transfer-backend mooncake``.
TARGET: Final = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"
#: The methods of sglang's manager the mixin hooks into (sglang 0.5.23): without them no peer would ever be added.
_NEEDED: Final = (
    "init_engine",
    "build_receiver_registration_message",
    "_make_worker_recv",
    "_publish_peer_registration",
)


def register() -> None:
    """Register the replacement (sglang calls this; it imports sglang's Mooncake manager module).

    On an sglang release kvwire does not support (:mod:`kvwire.hosts.host_range`), the process stops
    with the reason (``SystemExit``: sglang's plugin loader logs and swallows an ``Exception``), unless
    ``KVWIRE_SGLANG_UNSUPPORTED`` is ``fallback`` (sglang's own path) or ``try`` (kvwire anyway).
    """
    from kvwire.hosts.host_range import UnsupportedHostError, host_decision

    log = logging.getLogger("kvwire.sglang")
    try:
        decision = host_decision("sglang")
    except UnsupportedHostError as exc:
        log.error("kvwire-sglang: %s", exc)
        raise SystemExit(f"kvwire-sglang: {exc}") from None
    if decision == "fallback":
        log.warning("kvwire-sglang: unsupported sglang, KVWIRE_SGLANG_UNSUPPORTED=fallback: kvwire is NOT used")
        return

    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvwire_sglang import KvwireManagerMixin

    missing = [name for name in _NEEDED if not hasattr(MooncakeKVManager, name)]
    if missing:  # only with KVWIRE_SGLANG_UNSUPPORTED=try: this sglang lacks what the mixin hooks into
        raise SystemExit(
            f"kvwire-sglang: this sglang's MooncakeKVManager has no {', '.join(missing)} (kvwire-sglang needs "
            "sglang 0.5.23's); set KVWIRE_SGLANG_UNSUPPORTED=fallback to run on sglang's own Mooncake path"
        )

    class KvwireKVManager(KvwireManagerMixin, MooncakeKVManager):  # type: ignore[misc]
        """sglang's Mooncake KV manager with its ``send_kvcache`` through kvwire."""

    KvwireKVManager.__module__ = __name__
    KvwireKVManager.__qualname__ = "KvwireKVManager"
    HookRegistry.register(TARGET, KvwireKVManager, HookType.REPLACE)
