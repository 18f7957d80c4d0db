"""Classifying a failed write: Mooncake returns ``-1`` for every failure, so the code alone says nothing.

Dead peer, frozen peer, remote range outside the peer's memory and queue
overflow all return ``-1``. A failure is told apart by how long it took (the
engine's own deadline, or the Python one) and by ``send_probe``, the engine's
reachability RPC (0, or ``-102`` ``ERR_SOCKET``), and becomes
:class:`~kvwire.PeerUnreachableError`, :class:`~kvwire.TransferTimeoutError` or
:class:`~kvwire.TransferError`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from concurrent.futures import TimeoutError as FutureTimeoutError
from typing import Final

from kvwire.errors import PeerUnreachableError, TransferError, TransferTimeoutError
from kvwire_mooncake.engine.binding import ENGINE_ERROR_CODES
from kvwire_mooncake.engine.dispatch import Chunk, Outcome
from kvwire_mooncake.engine.environment import engine_timeout_s
from kvwire_mooncake.engine.slots import Slots
from kvwire_mooncake.engine.workers import Workers

__all__ = ["PROBE_WAIT_S", "classify", "probe"]

#: Longest wait for a probe after a fast failure (the probe of a frozen peer blocks 60 s).
PROBE_WAIT_S: Final = 1.0


def probe(slots: Slots, workers: Workers, session_id: str, wait_s: float) -> tuple[bool, int | None]:
    """``(supported, code)`` of ``send_probe`` through the current sender, waited for at most ``wait_s``.

    ``code`` is None when the engine has no ``send_probe`` or the peer did not
    answer in time (a frozen peer keeps a probe blocked for 60 s: it finishes in
    its worker thread, unwaited, and only then releases the engine).
    """
    with slots.lock:
        send_probe = getattr(slots.sender.engine, "send_probe", None)
        if send_probe is None:
            return False, None
        slot = slots.pin()

    def run() -> int:
        try:
            return int(send_probe(session_id))
        finally:
            slots.release(slot)

    try:
        fut = workers.submit(run)
    except RuntimeError:
        slots.release(slot)
        return True, None
    try:
        return True, fut.result(timeout=wait_s)
    except FutureTimeoutError:
        return True, None


def classify(
    session_id: str,
    outcome: Outcome,
    nfailed: int,
    nbytes: Mapping[Chunk, int],
    *,
    timeout_s: float,
    probe: Callable[[float], tuple[bool, int | None]],
    worked_before: bool,
    no_renewal: str | None = None,
) -> tuple[TransferError, bool]:
    """The exception for a failed chunk, and whether renewing the sending engine may recover the session.

    ``probe(wait_s)`` is :func:`probe` for the session. A session looks broken
    for good when its peer answers probes and it ``worked_before`` through the
    engine that failed; then renewal is advised, unless ``no_renewal`` says why
    it is not possible (appended to the message instead).
    """
    a, b = outcome.chunk
    what = f"write of {b - a} descriptor(s), {nbytes[outcome.chunk]} bytes, to {session_id}"
    if nfailed > 1:
        what += f" (and {nfailed - 1} more call(s))"
    if outcome.rc is None:
        message = (
            f"{what} did not complete within {outcome.elapsed:.1f} s (config.timeout_s = {timeout_s:g}); "
            "the call is still inside the engine; new writes to the peer wait for it to return"
        )
        return TransferTimeoutError(message, peer=session_id), False
    rc = outcome.rc
    engine_s = engine_timeout_s()
    if outcome.elapsed >= engine_s - 0.05:
        message = (
            f"{what} failed with code {rc} after {outcome.elapsed:.1f} s: the peer did not acknowledge or "
            f"make progress within the engine's {engine_s:g} s deadline (frozen or overloaded peer)"
        )
        return TransferTimeoutError(message, code=rc, peer=session_id), False
    wait_s = min(PROBE_WAIT_S, timeout_s)
    probe_supported, probe_rc = probe(wait_s)
    if probe_supported and probe_rc is None:
        message = (
            f"{what} failed with code {rc}, and the peer accepted a probe connection but did not answer "
            f"within {wait_s:g} s"
        )
        return TransferTimeoutError(message, code=rc, peer=session_id), False
    if probe_rc is not None and probe_rc != 0:
        message = (
            f"peer {session_id} is unreachable: {what} failed with code {rc} and a probe failed with "
            f"{probe_rc} ({ENGINE_ERROR_CODES.get(probe_rc, 'unknown')}); is the process alive and the "
            "session id its current endpoint?"
        )
        return PeerUnreachableError(message, code=probe_rc, peer=session_id), False
    message = (
        f"{what} failed with code {rc} although the peer answers: most likely a destination range outside "
        "the peer's registered memory (the engine then rejects the whole call), or a peer restarted on the "
        "same endpoint"
    )
    broken = probe_rc == 0 and worked_before
    if broken and no_renewal is not None:
        message += f"; writes to it worked before through this engine, so the session may be broken: {no_renewal}"
    return TransferError(message, code=rc, peer=session_id), broken and no_renewal is None
