"""``MooncakeTransport``: kvwire's :class:`~kvwire.Transport` over a :class:`MooncakeEngine`.

The ``mooncake``, ``hisparse`` and ``ascend`` backends are
:class:`kvwire.TransportBackend` subclasses that open this transport; the spec
hooks, layouts and planning are the core base's, the engine's sharp edges are
:class:`~kvwire_mooncake.engine.MooncakeEngine`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from kvwire import BackendConfig, Notification, TransferPlan, Transport, TransportTuning
from kvwire_mooncake.engine import MooncakeEngine
from kvwire_mooncake.raw import raw_write

__all__ = ["MooncakeTransport"]


class MooncakeTransport(Transport):
    """Registers and writes through one :class:`MooncakeEngine`; offers the raw extension."""

    tuning = TransportTuning(staged_writes=True)  # ~25 µs per descriptor over TCP: head slices are staged

    def __init__(self, config: BackendConfig, *, engine_factory: Callable[[], Any] | None = None) -> None:
        self.engine = MooncakeEngine(config, engine_factory=engine_factory)
        self.busy = self.engine.busy

    @property
    def endpoint(self) -> str:
        return self.engine.endpoint

    def register_memory(self, base: int, nbytes: int) -> None:
        self.engine.register(base, nbytes)

    def unregister_memory(self, base: int) -> None:
        self.engine.unregister(base)

    def write(self, session_id: str, plan: TransferPlan) -> None:
        self.engine.write(session_id, plan.src, plan.dst, plan.length)  # checks local sources first

    def submit(self, session_id: str, plan: TransferPlan, notification: bytes | None) -> Future[None]:
        """The write (then the notification), queued behind earlier ones to the peer (``MooncakeEngine.submit``)."""
        engine = self.engine

        def job() -> None:
            engine.write(session_id, plan.src, plan.dst, plan.length)
            if notification is not None:
                engine.notify(session_id, notification)

        return engine.submit(session_id, job)

    def notify(self, session_id: str, message: bytes) -> None:
        self.engine.notify(session_id, message)

    def poll_notifications(self) -> list[Notification]:
        return [Notification(sender, message) for sender, message in self.engine.notifications()]

    def raw_write(self, session_id: str, plan: TransferPlan) -> None:
        """The bare engine call on the plan's arrays (the ``raw_write`` extension)."""
        raw_write(self.engine, session_id, plan.src, plan.dst, plan.length)

    def forget_peer(self, session_id: str) -> None:
        self.engine.forget_peer(session_id)

    def close(self) -> None:
        self.engine.close()
