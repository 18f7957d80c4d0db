"""The engines one :class:`MooncakeEngine` drives, their registrations, pinning and teardown.

The *primary* engine receives and gives the endpoint; the *sender* writes. They
are the same engine until a broken session is recovered by a fresh sending
engine (the primary keeps receiving, so the endpoint never changes). An engine
is destroyed only once it is retired and no call uses it: a call past its
deadline may still be inside it. An engine the host handed in (not *owned*) is
never destroyed: only the memory kvwire registered with it is unregistered.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field

from kvwire.errors import InvalidTransferError, TransferError
from kvwire_mooncake.engine.binding import ENGINE_ERROR_CODES, TransferEngineLike

__all__ = ["Slot", "Slots"]


@dataclass(eq=False)
class Slot:
    """One engine and the calls using it (``users``); the engine is None once destroyed."""

    engine: TransferEngineLike | None
    owned: bool = True  # created by kvwire: closed and dropped when destroyed
    users: int = 0
    retired: bool = False
    registered: set[int] = field(default_factory=set)
    succeeded: set[str] = field(default_factory=set)  # sessions written to successfully through this engine
    forgotten: set[str] = field(default_factory=set)  # of those, the ones forget_peer dropped since


class Slots:
    """The primary and the sending :class:`Slot`; ``lock`` is the wrapper's state lock, which guards them."""

    def __init__(self, lock: threading.Lock, engine: TransferEngineLike, *, owned: bool) -> None:
        self.lock = lock
        self.primary = Slot(engine, owned)
        self.sender = self.primary

    def pin(self) -> Slot:
        """The current sender, marked in use; the caller holds the lock and later calls :meth:`release`."""
        slot = self.sender
        slot.users += 1
        return slot

    def release(self, slot: Slot) -> None:
        with self.lock:
            slot.users -= 1
            destroy = slot.retired and slot.users == 0
        if destroy:
            self._destroy(slot)

    @contextmanager
    def borrow(self) -> Iterator[TransferEngineLike]:
        """The current sending engine, pinned for the block (it is not destroyed under it)."""
        with self.lock:
            slot = self.pin()
        try:
            engine = slot.engine
            if engine is None:
                raise TransferError("MooncakeEngine is closed")
            yield engine
        finally:
            self.release(slot)

    def live(self) -> list[Slot]:
        slots = [self.primary] if self.sender is self.primary else [self.primary, self.sender]
        return [s for s in slots if s.engine is not None]

    def register(self, ptr: int, nbytes: int) -> None:
        """Register the range with every live engine, all or nothing.

        InvalidTransferError for Mooncake's -7 (overlaps a range registered by
        someone else), TransferError(code=...) for any other refusal.
        """
        done: list[Slot] = []
        for slot in self.live():
            assert slot.engine is not None
            rc = int(slot.engine.register_memory(ptr, nbytes))
            if rc != 0:
                for other in done:
                    assert other.engine is not None
                    other.engine.unregister_memory(ptr)
                    other.registered.discard(ptr)
                message = (
                    f"Mooncake register_memory({ptr:#x}, {nbytes}) returned {rc} "
                    f"({ENGINE_ERROR_CODES.get(rc, 'unknown')})"
                )
                raise InvalidTransferError(message) if rc == -7 else TransferError(message, code=rc)
            slot.registered.add(ptr)
            done.append(slot)

    def unregister(self, ptr: int) -> None:
        """Unregister the range from every live engine that has it; TransferError with the first failure."""
        failures: list[int] = []
        for slot in self.live():
            assert slot.engine is not None
            if ptr in slot.registered:
                slot.registered.discard(ptr)
                rc = int(slot.engine.unregister_memory(ptr))
                if rc != 0:
                    failures.append(rc)
        if failures:
            rc = failures[0]
            name = ENGINE_ERROR_CODES.get(rc, "unknown")
            raise TransferError(f"Mooncake unregister_memory({ptr:#x}) returned {rc} ({name})", code=rc)

    def install_sender(self, slot: Slot) -> None:
        """Make ``slot`` the sender; the previous sender is retired unless it is the primary."""
        with self.lock:
            old, self.sender = self.sender, slot
        if old is not self.primary:
            self.retire(old)

    def retire(self, slot: Slot) -> None:
        """No new calls use ``slot``; its engine is destroyed now or when its last call returns."""
        with self.lock:
            slot.retired = True
            destroy = slot.users == 0
        if destroy:
            self._destroy(slot)

    def retire_all(self) -> None:
        for slot in {id(s): s for s in (self.sender, self.primary)}.values():
            self.retire(slot)

    @staticmethod
    def filled(engine: TransferEngineLike, regions: tuple[tuple[int, int], ...], purpose: str) -> Slot:
        """A new slot for ``engine`` with every range of ``regions`` registered; the engine is destroyed on failure.

        Raises TransferError(code=...) naming ``purpose`` if a registration is refused.
        """
        slot = Slot(engine)
        try:
            for ptr, size in regions:
                rc = int(engine.register_memory(ptr, size))
                if rc != 0:
                    raise TransferError(f"{purpose}: register_memory({ptr:#x}, {size}) returned {rc}", code=rc)
                slot.registered.add(ptr)
        except BaseException:
            Slots.destroy_unused(slot)
            raise
        return slot

    @staticmethod
    def destroy_unused(slot: Slot) -> None:
        """Destroy a slot that never served a call (a renewal that failed half-way)."""
        Slots._destroy(slot)

    @staticmethod
    def _destroy(slot: Slot) -> None:
        """Unregister the slot's memory; close and drop an owned engine (Mooncake's destructor takes ~0.5-1 s).

        Mooncake's binding has no ``close``; an engine that has one (such as
        :class:`~kvwire_mooncake.engine_double.HostMemoryEngine`, which leaves its
        process-wide registry) is closed. A host's engine is left open. Failures
        are swallowed: the slot is out of use and the caller is tearing down.
        """
        engine, slot.engine = slot.engine, None
        if engine is None:
            return
        try:
            for ptr in sorted(slot.registered):
                with suppress(Exception):
                    engine.unregister_memory(ptr)
            slot.registered.clear()
            close = getattr(engine, "close", None)
            if slot.owned and callable(close):
                with suppress(Exception):
                    close()
        finally:
            del engine
