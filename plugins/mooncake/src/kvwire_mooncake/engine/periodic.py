"""``Periodic``: a daemon thread calling one method every few seconds: the wrapper's background chores.

Two chores use it: draining the engine's notification queue into the bounded
inbox (:class:`.notify.Received`) and probing the peers the sending engine wrote
to, so that dead ones are forgotten without ``remove_peer``
(``MooncakeEngine.sweep_dead_peers``). The method is held weakly: a dropped
owner ends the thread, as do :meth:`Periodic.close` and the method returning
``False``. A call that raises is logged and tried again next time.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["Periodic"]

_log = logging.getLogger(__name__)


class Periodic:
    """Calls ``method()`` (a bound method, held weakly) every ``interval_s`` until stopped (module docstring)."""

    def __init__(self, method: Callable[[], Any], name: str, interval_s: float) -> None:
        self._method = weakref.WeakMethod(method)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            method = self._method()
            if method is None:
                return  # its owner was dropped
            try:
                if method() is False:
                    return
            except Exception:  # the engine is going away, or its binding failed: try again next time
                _log.debug("%s failed", self._thread.name, exc_info=True)
            del method

    def close(self) -> None:
        """Stop (idempotent); waits for a call in progress."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
