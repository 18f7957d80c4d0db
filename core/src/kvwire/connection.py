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
from collections.abc import Iterator, Sequence
from concurrent.futures import Executor
from contextlib import contextmanager
from types import TracebackType
from typing import Any

import numpy as np
import pluggy
from numpy.typing import NDArray

from kvwire.capabilities import MEMORY_FEATURES
from kvwire.config import BackendConfig
from kvwire.errors import BackendError, ConfigError, InvalidTransferError, KvwireError, UnsupportedFeatureError
from kvwire.layout import KVLayout
from kvwire.markers import IMPL_ATTR, PROJECT_NAME
from kvwire.planning import TransferPlan, TransferRequest, check_peer_shape, needs_head_slicing
from kvwire.spec import CURRENT, BackendSpec, spec_hooks

__all__ = ["Connection"]


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


@contextmanager
def _backend_errors(name: str, where: str) -> Iterator[None]:
    """Let kvwire errors through; wrap anything else a backend raises (SystemExit included) in BackendError."""
    try:
        yield
    except KvwireError:
        raise
    except (Exception, SystemExit) as exc:
        raise BackendError(
            f"backend {name!r} raised {type(exc).__name__} in {where}: {exc} (backends must raise kvwire errors; "
            "the original is chained)"
        ) from exc


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
        with _backend_errors(name, "its constructor"):
            self.backend: Any = cls(config)
        self._local: KVLayout | None = None
        self._peers: dict[str, KVLayout] = {}
        self._pm.register(self.backend, name=name)
        for i, extra in enumerate(middleware):
            self._pm.register(extra, name=f"{name}.middleware[{i}]")
        self._hook = self._pm.hook
        # A dropped connection still unregisters its memory (stale registrations break later ones).
        self._finalizer = weakref.finalize(self, self._hook.close)

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise BackendError(f"connection to backend {self.name!r} is closed")

    def _require(self, features: frozenset[str], why: str) -> None:
        lacking = sorted(features - self.capabilities)
        if lacking:
            raise UnsupportedFeatureError(
                f"backend {self.name!r} (spec {self.spec_version}) does not support {', '.join(map(repr, lacking))}, "
                f"needed for {why}; nothing was sent"
            )

    def register_kv_buffers(self, layout: KVLayout) -> None:
        """Register the local KV memory (checked against the backend's capabilities first)."""
        self._check_open()
        if not isinstance(layout, KVLayout):
            raise ConfigError(f"layout must be a kvwire.KVLayout, got {type(layout).__name__}")
        self._check_layout(layout, "the local layout")
        for session_id, peer in self._peers.items():
            self._check_pair(layout, peer, session_id)
        self._local = None
        self._call("register_kv_buffers", layout=layout)
        self._local = layout

    def _check_layout(self, layout: KVLayout, what: str) -> None:
        self._require(frozenset({layout.attention}), f"{what} ({layout.attention.upper()} buffers)")
        for kind in sorted({b.memory for b in layout.buffers}):
            self._require(frozenset({MEMORY_FEATURES[kind]}), f"{what} ({kind} buffers)")

    def _check_pair(self, local: KVLayout, peer: KVLayout, session_id: str) -> None:
        """Different attention TP sizes on the two sides need head slicing (checked before the first send)."""
        if needs_head_slicing(local, peer):
            self._require(
                frozenset({"head_slicing"}),
                f"peer {session_id!r}: attention TP size {local.attn_tp_size} here, {peer.attn_tp_size} there",
            )

    def endpoint(self) -> str:
        """The id a peer passes as ``session_id`` to reach this endpoint."""
        self._check_open()
        result = self._call("endpoint")
        if not isinstance(result, str) or not result:
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
        if self._local is not None:
            self._check_pair(self._local, layout, session_id)
        self._call("add_peer", session_id=session_id, layout=layout)
        self._peers[session_id] = layout

    def remove_peer(self, session_id: str) -> None:
        """Forget a peer: its layout here and in the backend, and the engine's per-peer resources.

        Idempotent. A backend of spec < 1.4 (adapted) has no ``remove_peer`` hook:
        only the connection's own record is dropped, and the backend keeps what it
        holds for the peer until it is closed.
        """
        self._check_open()
        if not isinstance(session_id, str) or not session_id:
            raise ConfigError(f"session_id must be a non-empty str, got {session_id!r}")
        self._call("remove_peer", session_id=session_id)
        self._peers.pop(session_id, None)

    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None = None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int:
        """Send pages to a peer; returns the bytes moved (see :class:`kvwire.BackendSpec`).

        Arguments for features the backend lacks are refused, and the caller's
        ``dst_kv_item_len`` / ``dst_attn_tp_size`` are checked against the peer's
        layout here, for every backend (an adapted one never receives them).
        """
        self._check_open()
        if not isinstance(session_id, str) or not session_id:
            raise InvalidTransferError(f"session_id must be a non-empty str, got {type(session_id).__name__}")
        request = TransferRequest(
            prefill_kv_indices,
            dst_kv_ptrs,
            dst_kv_indices,
            dst_layer_ids,
            dst_device_kv_indices,
            dst_kv_item_len,
            dst_attn_tp_size,
        )
        used = request.features()
        if used:
            self._require(used, ", ".join(TransferRequest.parameters_for(used)))
        peer = self._peers.get(session_id)
        if (dst_kv_item_len is not None or dst_attn_tp_size is not None) and self._local and peer:
            check_peer_shape(self._local, peer, dst_layer_ids, dst_kv_item_len, dst_attn_tp_size)
        moved = self._call("send_kvcache", session_id=session_id, executor=executor, **request.arguments())
        if isinstance(moved, bool) or not isinstance(moved, (int, np.integer)) or moved < 0:
            raise BackendError(
                f"backend {self.name!r}: send_kvcache returned {moved!r}; the spec requires the bytes moved "
                "(an int >= 0) and failures raised as kvwire.TransferError"
            )
        return int(moved)

    def _call(self, hook: str, **kwargs: Any) -> Any:
        """``pm.hook.<hook>(**kwargs)``; a non-kvwire exception becomes BackendError naming the backend."""
        with _backend_errors(self.name, hook):
            return getattr(self._hook, hook)(**kwargs)

    def raw_write(self, session_id: str, plan: TransferPlan) -> None:
        """The backend's bare engine call on ``plan`` (capability ``raw_write``), for benchmarks.

        No checks beyond the engine's own: ``plan`` must come from
        :func:`kvwire.plan_transfer` between the registered layout and this peer's.
        """
        self._check_open()
        self._require(frozenset({"raw_write"}), "raw_write")
        if not isinstance(plan, TransferPlan):
            raise ConfigError(f"plan must be a kvwire.TransferPlan, got {type(plan).__name__}")
        with _backend_errors(self.name, "raw_write"):
            self.backend.raw_write(session_id, plan)

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
