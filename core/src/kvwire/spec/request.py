"""``TransferRequest``: the arguments of one send that planning reads, carried as one object.

The request holds fields and the names of the features they use; it never
plans (:func:`kvwire.planning.planner.plan_request` does). A
:class:`kvwire.Connection` hands the one object it checked to the backend's
hook through :func:`handing`, so a :class:`kvwire.TransportBackend` neither
rebuilds it nor recomputes what was computed on it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Executor
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from functools import cached_property, update_wrapper
from typing import Any, TypeVar

import numpy as np
from numpy.typing import NDArray

from kvwire.spec.capabilities import parameters_for
from kvwire.spec.history import PARAMETER_FEATURES
from kvwire.spec.protocol import BackendProtocol

__all__ = ["SEND_PARAMETERS", "SendCall", "TransferRequest", "check_request_fields", "handing", "send_signature"]

F = TypeVar("F", bound=Callable[..., Any])


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

# -- the send_kvcache parameter list, read from its one declaration (BackendProtocol) -------------

_SEND = inspect.signature(BackendProtocol.send_kvcache)

#: ``send_kvcache``'s parameters in spec order (without ``self``), as :class:`kvwire.BackendProtocol` declares them.
SEND_PARAMETERS: tuple[str, ...] = tuple(_SEND.parameters)[1:]


def check_request_fields(request_fields: Sequence[str], send_parameters: Sequence[str]) -> None:
    """ImportError unless the request's fields are ``send_kvcache``'s parameters but session_id and executor."""
    expected = [p for p in send_parameters if p not in ("session_id", "executor")]
    if list(request_fields) != expected:
        raise ImportError(
            f"TransferRequest's fields {tuple(request_fields)} must be send_kvcache's parameters but "
            f"session_id and executor, in spec order: {tuple(expected)}; add a new parameter to both "
            "(kvwire/spec/protocol.py and kvwire/spec/request.py)"
        )


check_request_fields(_REQUEST_FIELDS, SEND_PARAMETERS)


@dataclass(frozen=True)
class SendCall:
    """One ``send_kvcache`` call: where, on which executor, and the request."""

    session_id: str
    executor: Executor | None
    request: TransferRequest

    @classmethod
    def bind(cls, args: tuple[Any, ...], kwargs: dict[str, Any]) -> SendCall:
        """The call from its arguments as ``send_kvcache``'s signature binds them (TypeError as Python gives it).

        pluggy passes every argument positionally, in spec order: that is a ``zip``. Any other
        call is bound by the declared signature, defaults included.
        """
        if not kwargs and len(args) == len(SEND_PARAMETERS):
            arguments = dict(zip(SEND_PARAMETERS, args, strict=True))
        else:
            bound = _SEND.bind(None, *args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            del arguments["self"]
        session_id, executor = arguments.pop("session_id"), arguments.pop("executor")
        return cls(session_id, executor, TransferRequest.received(**arguments))


def send_signature(func: F) -> F:
    """Give ``func`` (``def send_kvcache(self, *args, **kwargs)``) the spec's declared signature.

    ``inspect.signature`` and pluggy (which unwraps before reading a hook's parameter names) then
    see :class:`kvwire.BackendProtocol`'s ``send_kvcache``, so an implementation that binds its
    arguments with :meth:`SendCall.bind` never spells the parameter list out again: a parameter
    added to the spec reaches it with no edit.
    """
    update_wrapper(func, BackendProtocol.send_kvcache, assigned=(), updated=())
    return func


_HANDED: ContextVar[TransferRequest | None] = ContextVar("kvwire_handed_request", default=None)


@contextmanager
def handing(request: TransferRequest) -> Iterator[None]:
    """While the block runs, :meth:`TransferRequest.received` on this thread finds ``request``."""
    token = _HANDED.set(request)
    try:
        yield
    finally:
        _HANDED.reset(token)
