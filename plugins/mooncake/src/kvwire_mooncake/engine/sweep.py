"""Dead peers found without being told: a periodic probe of the peers the sending engine wrote to.

Mooncake keeps pooled connections to every peer it wrote to until the engine is
destroyed (see ``MooncakeEngine.forget_peer``). A host that never calls
``remove_peer`` for a receiver that died would keep them for ever; so every
:data:`SWEEP_INTERVAL_S` a thread probes each such peer (``send_probe``, a TCP
connection to its handshake port) and forgets the ones that refuse: they count
toward recycling the sending engine as forgotten ones do. A peer that does not
answer in time (frozen, or slow) is left alone.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any, Final

__all__ = ["PROBE_WAIT_S", "SWEEP_INTERVAL_S", "Sweeper"]

#: Seconds between two sweeps.
SWEEP_INTERVAL_S: Final = 30.0
#: Seconds one probe of a sweep is waited for.
PROBE_WAIT_S: Final = 1.0

_log = logging.getLogger(__name__)


class Sweeper:
    """Calls ``sweep()`` (a bound method, held weakly) every ``interval_s`` until closed or its object is gone."""

    def __init__(self, sweep: Callable[[], Any], name: str, interval_s: float = SWEEP_INTERVAL_S) -> None:
        self._sweep = weakref.WeakMethod(sweep)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-sweep", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            sweep = self._sweep()
            if sweep is None:
                return
            try:
                sweep()
            except Exception:  # the engine is closing, or a probe failed oddly: the next sweep tries again
                _log.debug("sweeping dead Mooncake peers failed", exc_info=True)
            del sweep

    def close(self) -> None:
        """Stop (idempotent); waits for a sweep in progress."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
