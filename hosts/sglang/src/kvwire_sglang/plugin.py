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

from typing import Final

__all__ = ["TARGET", "register"]

#: The class sglang builds for ``--disaggregation-transfer-backend mooncake``.
TARGET: Final = "sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager"


def register() -> None:
    """Register the replacement (sglang calls this; it imports sglang's Mooncake manager module)."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVManager
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kvwire.compat.sglang import KvwireManagerMixin

    class KvwireKVManager(KvwireManagerMixin, MooncakeKVManager):  # type: ignore[misc]
        """sglang's Mooncake KV manager with its ``send_kvcache`` through kvwire."""

    KvwireKVManager.__module__ = __name__
    KvwireKVManager.__qualname__ = "KvwireKVManager"
    HookRegistry.register(TARGET, KvwireKVManager, HookType.REPLACE)
