"""The KV layout: the buffers that hold a process's KV cache, their parts, and their wire forms.

Names re-exported for readers of ``kvwire.layout``; the core imports from the defining module.
"""

from kvwire.layout.buffers import ADDRESS_LIMIT, HeadLayout, KVBuffer, LayoutError, MemoryKind, Role
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer import PeerDescription

__all__ = [
    "ADDRESS_LIMIT",
    "HeadLayout",
    "KVBuffer",
    "KVLayout",
    "LayoutError",
    "MemoryKind",
    "PeerDescription",
    "Role",
]
