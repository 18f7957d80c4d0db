"""``TransferRequest``: the arguments of one send that planning reads, carried as one object.

The flat, sglang-shaped ``send_kvcache`` is kvwire's public contract with its
hosts (validated, drift-checked); inside kvwire a send is
``send_request(session_id, request, executor)``. :class:`SendAdapter` below is
the one place where the first becomes the second, by keyword, so a parameter
added to the spec is added here once (field and adapter side by side) and
reaches every :class:`kvwire.TransportBackend`.

The request holds fields and the names of the features they use; it never
plans (:func:`kvwire.planning.planner.plan_request` does).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import MISSING, dataclass, fields
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire.spec.capabilities import parameters_for
from kvwire.spec.history import PARAMETER_FEATURES
from kvwire.spec.pluggy_project import hookimpl
from kvwire.spec.protocol import BackendProtocol

__all__ = ["SEND_PARAMETERS", "SendAdapter", "TransferRequest", "check_request_fields"]


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
        used = [f for p, f in PARAMETER_FEATURES.items() if getattr(self, p, None) is not None]
        return frozenset(used) if used else _NONE

    @staticmethod
    def parameters_for(features: Iterable[str]) -> list[str]:
        """The parameters that need ``features``, in spec order (:func:`kvwire.spec.capabilities.parameters_for`)."""
        return parameters_for(features)


class SendAdapter(ABC):
    """The spec's flat ``send_kvcache`` hook, adapted by keyword to :meth:`send_request` (the request as one argument).

    :class:`kvwire.TransportBackend` inherits it. Its signature is :class:`kvwire.BackendProtocol`'s
    (checked when this module is imported), so the validator and pluggy read the spec's parameters here.
    """

    @hookimpl
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int:
        """Write the pages ``prefill_kv_indices`` into the peer; return the bytes moved (see :meth:`send_request`)."""
        request = TransferRequest(
            prefill_kv_indices=prefill_kv_indices,
            dst_kv_ptrs=dst_kv_ptrs,
            dst_kv_indices=dst_kv_indices,
            dst_layer_ids=dst_layer_ids,
            dst_device_kv_indices=dst_device_kv_indices,
            dst_kv_item_len=dst_kv_item_len,
            dst_attn_tp_size=dst_attn_tp_size,
        )
        return self.send_request(session_id, request, executor)

    @abstractmethod
    def send_request(self, session_id: str, request: TransferRequest, executor: Executor | None = None) -> int:
        """Send ``request`` to the peer ``session_id``; return the bytes moved."""


_NONE: frozenset[str] = frozenset()
_REQUEST_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(TransferRequest))

# -- the send_kvcache parameter list, read from its one declaration (BackendProtocol) -------------

_SEND = inspect.signature(BackendProtocol.send_kvcache)

#: ``send_kvcache``'s parameters in spec order (without ``self``), as :class:`kvwire.BackendProtocol` declares them.
SEND_PARAMETERS: tuple[str, ...] = tuple(_SEND.parameters)[1:]


def check_request_fields(
    request_fields: Sequence[str],
    send_parameters: Sequence[str],
    field_defaults: dict[str, object] | None = None,
    send_defaults: dict[str, object] | None = None,
) -> None:
    """ImportError unless the request's fields are ``send_kvcache``'s parameters but session_id and executor,
    in spec order, with the same defaults (when both default maps are given)."""
    expected = [p for p in send_parameters if p not in ("session_id", "executor")]
    if list(request_fields) != expected:
        raise ImportError(
            f"TransferRequest's fields {tuple(request_fields)} must be send_kvcache's parameters but "
            f"session_id and executor, in spec order: {tuple(expected)}; add a new parameter to both "
            "(kvwire/spec/protocol.py and kvwire/spec/request.py)"
        )
    if field_defaults is not None and send_defaults is not None:
        for name in expected:
            if field_defaults.get(name, MISSING) != send_defaults.get(name, MISSING):
                raise ImportError(
                    f"TransferRequest.{name} defaults to {field_defaults.get(name, MISSING)!r} but send_kvcache's "
                    f"{name} to {send_defaults.get(name, MISSING)!r}: they must be the same "
                    "(kvwire/spec/protocol.py and kvwire/spec/request.py)"
                )


def _defaults(signature: inspect.Signature) -> dict[str, object]:
    return {n: p.default for n, p in signature.parameters.items() if p.default is not inspect.Parameter.empty}


check_request_fields(
    _REQUEST_FIELDS,
    SEND_PARAMETERS,
    {f.name: f.default for f in fields(TransferRequest) if f.default is not MISSING},
    _defaults(_SEND),
)
_ADAPTER = inspect.signature(SendAdapter.send_kvcache)
if _ADAPTER.replace(parameters=list(_ADAPTER.parameters.values())[1:]) != _SEND.replace(
    parameters=list(_SEND.parameters.values())[1:]
):  # the adapter is the hook every TransportBackend implements: its signature is the spec's
    raise ImportError(
        f"kvwire.SendAdapter.send_kvcache{_ADAPTER} must have BackendProtocol's signature "
        f"send_kvcache{_SEND} (but self): change both (kvwire/spec/protocol.py and kvwire/spec/request.py)"
    )
