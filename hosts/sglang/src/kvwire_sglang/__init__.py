"""kvwire inside a stock sglang: everything kvwire does there, in one distribution (``kvwire-sglang``).

- :mod:`~kvwire_sglang.plugin`: the sglang plugin (``SGLANG_PLUGINS=kvwire``) that puts kvwire's manager in
  place of sglang's ``MooncakeKVManager``;
- :mod:`~kvwire_sglang.manager`: the manager mixin that ties the pieces below into sglang's own class;
- :mod:`~kvwire_sglang.send`: ``send_kvcache`` with sglang's parameter list and status codes;
- :mod:`~kvwire_sglang.layout`: ``KVArgs`` as a :class:`~kvwire.KVLayout`, sglang's layer ids;
- :mod:`~kvwire_sglang.registration`: the layout frame a decode adds to sglang's registration;
- :mod:`~kvwire_sglang.cpu`: the ``kvwire_cpu`` plugin, sglang's PD path on a CPU-only server.

Nothing here imports sglang at import time (the plugins do, when sglang calls them).
"""

from kvwire_sglang.layout import layer_ids_from_sglang, layout_from_kv_args
from kvwire_sglang.manager import KvwireManagerMixin
from kvwire_sglang.registration import layout_frame, layout_from_frames
from kvwire_sglang.send import STATUS_CODES, KvwireSendMixin, SglangSender, status_of

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
