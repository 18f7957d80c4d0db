"""``TransferRequest``: the arguments of one send that planning reads, carried as one object.

The request holds fields and the names of the features they use; it never
plans (:func:`kvwire.planning.planner.plan_request` does). A
:class:`kvwire.Connection` hands the one object it checked to the backend's
hook through :func:`handing`, so a :class:`kvwire.TransportBackend` neither
rebuilds it nor recomputes what was computed on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.spec.capabilities import parameters_for
from kvwire.spec.history import PARAMETER_FEATURES

__all__ = ["TransferRequest", "handing"]


@dataclass(frozen=True)
class TransferRequest:
    """What planning reads of one ``send_kvcache`` call (all but ``session_id`` and ``executor``).

    Backends built on :class:`kvwire.TransportBackend` hand the request on as one
    object, so a parameter added to the spec is threaded through in one place.
    """

    prefill_kv_indices: NDArray[np.integer[Any]]
    dst_kv_ptrs: Sequence[int]
    dst_kv_indices: NDArray[np.integer[Any]]
    dst_layer_ids: Sequence[int] | None = None
    dst_device_kv_indices: NDArray[np.integer[Any]] | None = None
    dst_kv_item_len: int | None = None
    dst_attn_tp_size: int | None = None

    def arguments(self) -> dict[str, Any]:
        """The fields by name, the very objects (for a ``send_kvcache`` call by keyword)."""
        return {name: getattr(self, name) for name in _REQUEST_FIELDS}

    def features(self) -> frozenset[str]:
        """The features this request uses: a non-None argument for a parameter bound to a feature."""
        return self._features

    @cached_property
    def _features(self) -> frozenset[str]:
        return frozenset(f for p, f in PARAMETER_FEATURES.items() if getattr(self, p, None) is not None)

    @classmethod
    def received(cls, **arguments: Any) -> TransferRequest:
        """The request a :class:`kvwire.Connection` is handing to this hook call, when ``arguments`` are its
        very objects (a middleware that replaced one gets a new request); else a new one from ``arguments``.

        pluggy passes a hook's arguments one by one; this keeps one request object (and
        what was computed on it, features and plan) from the Connection to the backend.
        """
        handed = _HANDED.get()
        if handed is not None and all(getattr(handed, name) is value for name, value in arguments.items()):
            return handed
        return cls(**arguments)

    @staticmethod
    def parameters_for(features: Iterable[str]) -> list[str]:
        """The parameters that need ``features``, in spec order (:func:`kvwire.spec.capabilities.parameters_for`)."""
        return parameters_for(features)


_REQUEST_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TransferRequest))


_HANDED: ContextVar[TransferRequest | None] = ContextVar("kvwire_handed_request", default=None)


@contextmanager
def handing(request: TransferRequest) -> Iterator[None]:
    """While the block runs, :meth:`TransferRequest.received` on this thread finds ``request``."""
    token = _HANDED.set(request)
    try:
        yield
    finally:
        _HANDED.reset(token)
