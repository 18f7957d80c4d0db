"""sglang: its Mooncake KV manager with the KV sends through kvwire, nothing of sglang imported.

- :mod:`~kvwire.compat.sglang.send`: ``send_kvcache`` with sglang's parameter list and status codes;
- :mod:`~kvwire.compat.sglang.layout`: ``KVArgs`` as a :class:`~kvwire.KVLayout`, sglang's layer ids;
- :mod:`~kvwire.compat.sglang.registration`: the layout frame a decode adds to sglang's registration;
- :mod:`~kvwire.compat.sglang.manager`: the manager mixin that ties them into sglang's own class.

The ``kvwire-sglang`` distribution (``hosts/sglang``) selects it in a stock sglang.
"""

from kvwire.compat.sglang.layout import layer_ids_from_sglang, layout_from_kv_args
from kvwire.compat.sglang.manager import KvwireManagerMixin
from kvwire.compat.sglang.registration import layout_frame, layout_from_frames
from kvwire.compat.sglang.send import STATUS_CODES, KvwireSendMixin, SglangSender, status_of

__all__ = [
    "STATUS_CODES",
    "KvwireManagerMixin",
    "KvwireSendMixin",
    "SglangSender",
    "layer_ids_from_sglang",
    "layout_frame",
    "layout_from_frames",
    "layout_from_kv_args",
    "status_of",
]
