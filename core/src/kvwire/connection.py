"""``Connection``: one backend instance behind pluggy, with the spec's guarantees.

Every call goes through ``pm.hook.<name>(...)`` with every argument by keyword.
Before ``send_kvcache`` reaches the backend, non-None arguments for features it
lacks (or that its older spec version lacks: the adapted mode) are refused
with :class:`UnsupportedFeatureError`, so nothing is silently dropped.
"""

from __future__ import annotations

import difflib
import inspect
import weakref
from collections.abc import Sequence
from concurrent.futures import Executor
from types import TracebackType
from typing import Any

import numpy as np
import pluggy
from numpy.typing import NDArray

from kvwire.config import BackendConfig
from kvwire.errors import BackendError, ConfigError, UnsupportedFeatureError
from kvwire.layout import KVLayout
from kvwire.markers import IMPL_ATTR, PROJECT_NAME
from kvwire.spec import CURRENT, BackendSpec, spec_hooks

__all__ = ["Connection"]

_MEMORY_FEATURES = {"host": "host_memory", "device": "device_memory"}


def _check_middleware(obj: object, what: str) -> None:
    """A middleware may only wrap spec hooks (``wrapper=True``) and take spec arguments."""
    hooks = spec_hooks(CURRENT)
    marked = [n for n in dir(obj) if getattr(getattr(obj, n, None), IMPL_ATTR, None) is not None]
    if not marked:
        raise ConfigError(f"{what} ({type(obj).__name__}) has no @kvwire.hookimpl(wrapper=True) method")
    for name in marked:
        func = getattr(obj, name)
        if name not in hooks:
            close = difflib.get_close_matches(name, list(hooks), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{what} ({type(obj).__name__}): {name!r} is not a kvwire hook{hint}")
        opts = getattr(func, IMPL_ATTR)
        if not (opts.get("wrapper") or opts.get("hookwrapper")):
            raise ConfigError(
                f"{what} ({type(obj).__name__}).{name} must be declared @kvwire.hookimpl(wrapper=True): "
                "a plain implementation would answer instead of the backend"
            )
        allowed = {p.name for p in hooks[name].params}
        params = list(inspect.signature(func).parameters)
        unknown = [p for p in params if p not in allowed]
        if unknown:
            raise ConfigError(
                f"{what} ({type(obj).__name__}).{name} takes {unknown}, not arguments of hook {name!r} "
                f"({', '.join(sorted(allowed)) or 'none'})"
            )


class Connection:
    """A live backend. Create it with :func:`kvwire.connect`; close it (or use ``with``)."""

    def __init__(
        self,
        name: str,
        cls: type | None,
        capabilities: frozenset[str],
        config: BackendConfig,
        *,
        middleware: Sequence[object] = (),
        spec_version: str = "",
    ) -> None:
        if cls is None:
            raise BackendError(f"backend {name!r} has no class to instantiate")
        if not isinstance(config, BackendConfig):
            raise ConfigError(f"config must be a kvwire.BackendConfig, got {type(config).__name__}")
        self.name = name
        self.capabilities = capabilities
        self.spec_version = spec_version
        self.config = config
        for i, extra in enumerate(middleware):  # before the backend exists: a bad wrapper leaks nothing
            _check_middleware(extra, f"middleware[{i}]")
        self._pm = pluggy.PluginManager(PROJECT_NAME)
        self._pm.add_hookspecs(BackendSpec)
        self.backend: Any = cls(config)
        self._pm.register(self.backend, name=name)
        for i, extra in enumerate(middleware):
            self._pm.register(extra, name=f"{name}.middleware[{i}]")
        self._hook = self._pm.hook
        # A dropped connection still unregisters its memory (stale registrations break later ones).
        self._finalizer = weakref.finalize(self, self._hook.close)

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise BackendError(f"connection to backend {self.name!r} is closed")

    def _require(self, feature: str, why: str) -> None:
        if feature not in self.capabilities:
            raise UnsupportedFeatureError(
                f"backend {self.name!r} (spec {self.spec_version}) does not support {feature!r}, "
                f"needed for {why}; nothing was sent"
            )

    def register_kv_buffers(self, layout: KVLayout) -> None:
        """Register the local KV memory (checked against the backend's capabilities first)."""
        self._check_open()
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a kvwire.KVLayout, got {type(layout).__name__}")
        self._check_layout(layout, "the local layout")
        self._hook.register_kv_buffers(layout=layout)

    def _check_layout(self, layout: KVLayout, what: str) -> None:
        self._require(layout.attention, f"{what} ({layout.attention.upper()} buffers)")
        for kind, feature in _MEMORY_FEATURES.items():
            if layout.has_memory(kind):  # type: ignore[arg-type]
                self._require(feature, f"{what} ({kind} buffers)")

    def endpoint(self) -> str:
        """The id a peer passes as ``session_id`` to reach this endpoint."""
        self._check_open()
        result = self._hook.endpoint()
        if not isinstance(result, str):
            raise BackendError(f"backend {self.name!r}: endpoint() returned {result!r}, expected a str")
        return result

    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        """Tell the backend a peer's layout (as the peer published it) before sending to it."""
        self._check_open()
        if not isinstance(session_id, str) or not session_id:
            raise ConfigError(f"session_id must be a non-empty str, got {session_id!r}")
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a kvwire.KVLayout, got {type(layout).__name__}")
        self._check_layout(layout, f"peer {session_id!r}")
        self._hook.add_peer(session_id=session_id, layout=layout)

    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None = None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
    ) -> int:
        """Send pages to a peer; returns the bytes moved (see :class:`kvwire.BackendSpec`)."""
        self._check_open()
        if dst_layer_ids is not None:
            self._require("layer_ids", "dst_layer_ids")
        if dst_device_kv_indices is not None:
            self._require("device_kv_indices", "dst_device_kv_indices")
        moved = self._hook.send_kvcache(
            session_id=session_id,
            prefill_kv_indices=prefill_kv_indices,
            dst_kv_ptrs=dst_kv_ptrs,
            dst_kv_indices=dst_kv_indices,
            executor=executor,
            dst_layer_ids=dst_layer_ids,
            dst_device_kv_indices=dst_device_kv_indices,
        )
        if isinstance(moved, bool) or not isinstance(moved, (int, np.integer)):
            raise BackendError(
                f"backend {self.name!r}: send_kvcache returned {moved!r}; the spec requires the bytes moved "
                "(an int) and failures raised as kvwire.TransferError"
            )
        return int(moved)

    def close(self) -> None:
        """Close the backend (idempotent)."""
        self._finalizer()

    def __enter__(self) -> Connection:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<kvwire.Connection backend={self.name!r} spec={self.spec_version} closed={not self._finalizer.alive}>"
