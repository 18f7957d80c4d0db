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
    """Register the replacement (sglang calls this; it imports sglang's Mooncake manager module)."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvwire.compat.sglang import KvwireManagerMixin

    missing = [name for name in _NEEDED if not hasattr(MooncakeKVManager, name)]
    if missing:  # another sglang than the one the mixin was written for: leave sglang as it is, and say so
        logging.getLogger("kvwire.compat.sglang").error(
            "kvwire-sglang: this sglang's MooncakeKVManager has no %s (kvwire-sglang needs sglang 0.5.23's); "
            "kvwire is NOT used, sglang's own Mooncake path is",
            ", ".join(missing),
        )
        return

    class KvwireKVManager(KvwireManagerMixin, MooncakeKVManager):  # type: ignore[misc]
        """sglang's Mooncake KV manager with its ``send_kvcache`` through kvwire."""

    KvwireKVManager.__module__ = __name__
    KvwireKVManager.__qualname__ = "KvwireKVManager"
    HookRegistry.register(TARGET, KvwireKVManager, HookType.REPLACE)
