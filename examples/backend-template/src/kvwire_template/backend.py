"""The ``template`` backend: a :class:`kvwire.TransportBackend` over a :class:`kvwire.Transport`.

The base implements every spec hook (layouts, refusal of undeclared features,
planning with every bounds check, all-or-nothing registration); a transport
supplies only the engine-facing operations. This one copies bytes between
endpoints of one process with ``memmove``: replace :class:`TemplateTransport`'s
body with your engine's calls (and declare ``interprocess`` once it reaches
other processes). Import heavy engine modules in ``__init__``, never at module
import, so ``kvwire check`` can validate the backend on any machine.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
import weakref

import kvwire

__all__ = ["TemplateBackend", "TemplateTransport"]

_endpoints: weakref.WeakValueDictionary[str, TemplateTransport] = weakref.WeakValueDictionary()
_ids = itertools.count(1)
_lock = threading.Lock()


class TemplateTransport(kvwire.Transport):
    """Registered memory of one endpoint, and a write that copies a plan's descriptors into a peer's."""

    def __init__(self, config: kvwire.BackendConfig) -> None:
        self.regions = kvwire.RegionSet()  # registered ranges, with a vectorised range check
        with _lock:
            self._endpoint = f"template://{next(_ids)}"
            _endpoints[self._endpoint] = self

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def register_memory(self, base: int, nbytes: int) -> None:
        self.regions.add(base, nbytes)

    def unregister_memory(self, base: int) -> None:
        self.regions.remove(base)

    def write(self, session_id: str, plan: kvwire.TransferPlan) -> None:
        peer = _endpoints.get(session_id)
        if peer is None:
            raise kvwire.PeerUnreachableError(f"template endpoint {session_id!r} is not in this process")
        self.regions.check(plan.src, plan.length)  # an engine would refuse unregistered memory itself
        peer.regions.check(plan.dst, plan.length, names=("dst", "length"), where=f"memory of peer {session_id!r}")
        for src, dst, length in zip(plan.src.tolist(), plan.dst.tolist(), plan.length.tolist(), strict=True):
            ctypes.memmove(dst, src, length)

    def close(self) -> None:
        with _lock:
            if _endpoints.get(self._endpoint) is self:
                del _endpoints[self._endpoint]
        self.regions.clear()


class TemplateBackend(kvwire.TransportBackend):
    """Declare the spec version whose features you honour, and only the capabilities you implement."""

    spec_version = "1.5"
    capabilities = frozenset({"layer_ids", "mha", "mla", "host_memory"})

    def open_transport(self, config: kvwire.BackendConfig) -> TemplateTransport:
        return TemplateTransport(config)


def _static_check(backend: TemplateBackend) -> kvwire.BackendProtocol:
    """Never called: `mypy --strict` fails here, before anything is installed, if a hook drifts from the spec."""
    return backend
