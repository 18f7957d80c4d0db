"""A native-submit backend over the local transport whose engine futures a test completes, and its fixtures.

Shared by the TransportBackend and submission tests: base-class guards are driven on subclasses called
directly (a Connection refuses first); the Connection's through a real registry. Ordering is fixed with
events, never with sleeps.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any

import numpy as np
from numpy.typing import NDArray

from kvwire import BackendConfig, KVLayout, TransferPlan
from kvwire.backends.local import LocalBackend, LocalTransport

PAGES = 8
PAGE_BYTES = 64


class EngineFuture(Future[None]):
    """An engine's future for one submitted write; records that someone asked to cancel it."""

    def __init__(self) -> None:
        super().__init__()
        self.cancel_asked = threading.Event()

    def cancel(self) -> bool:
        self.cancel_asked.set()
        return super().cancel()


class HeldTransport(LocalTransport):
    """The local transport with a non-blocking ``submit`` whose futures the test completes (``held``, in order)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[EngineFuture] = []

    def submit(self, session_id: str, plan: TransferPlan, notification: bytes | None) -> Future[None]:
        future = EngineFuture()
        self.held.append(future)
        return future


class HeldSubmit(LocalBackend):
    """The local backend, submitting natively through :class:`HeldTransport` (notifications too)."""

    capabilities = LocalBackend.capabilities | {"submit"}

    def open_transport(self, config: BackendConfig) -> HeldTransport:
        return HeldTransport()


class SubmitWithoutNotifications(HeldSubmit):
    """Submits natively, declares no notifications (its transport would carry them: only the base refuses)."""

    capabilities = frozenset({"submit", "mla", "host_memory"})


class Memory:
    """A source and a destination MLA buffer of ``PAGES`` pages, with the sender's and receiver's layouts."""

    def __init__(self) -> None:
        rng = np.random.default_rng(7)
        self.src, self.dst = rng.integers(0, 256, (2, PAGES, PAGE_BYTES), dtype=np.uint8)
        self.local, self.peer = KVLayout.mla([self.src]), KVLayout.mla([self.dst])
        self.ptrs = [int(self.dst.ctypes.data)]

    def pair(self, sender: Any, receiver: Any) -> str:
        """Register each side's layout and add the receiver as the sender's peer; the receiver's endpoint."""
        sender.register_kv_buffers(self.local)
        receiver.register_kv_buffers(self.peer)
        endpoint: str = receiver.endpoint()
        sender.add_peer(endpoint, self.peer)
        return endpoint


def ids(*pages: int) -> NDArray[np.int32]:
    return np.array(pages, np.int32)


def refusal(backend: str, why: str) -> str:
    return f"backend {backend} does not support 'notifications', needed for {why}; nothing was sent"
