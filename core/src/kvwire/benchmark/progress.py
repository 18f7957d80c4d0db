"""What the bench is doing, on stderr: set-up steps as they happen, then progress through the requests.

stdout keeps only the result (the table, or the one JSON object of ``--json``).
On a terminal the requests show as a bar redrawn in place; elsewhere (a log, CI)
as a plain line at most every ``interval_s`` seconds and one at the end, so a
long run is never silent until its result.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

__all__ = ["Progress", "Steps"]

#: Seconds between two progress lines when stderr is not a terminal.
INTERVAL_S = 3.0


class Steps:
    """``step("allocating ...")`` writes ``kvwire bench: [  0.4 s] allocating ...`` to stderr, at once."""

    def __init__(self, stream: TextIO | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self._stream = stream
        self._clock = clock
        self.start = clock()

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def elapsed(self) -> float:
        return self._clock() - self.start

    def __call__(self, text: str) -> None:
        self.stream.write(f"kvwire bench: [{self.elapsed():5.1f} s] {text}\n")
        self.stream.flush()


class Progress:
    """Progress through ``total`` requests: a bar on a terminal, a plain line every few seconds elsewhere."""

    def __init__(
        self,
        total: int,
        steps: Steps,
        *,
        what: str = "requests",
        interval_s: float = INTERVAL_S,
        tty: bool | None = None,
    ) -> None:
        self.total, self.done, self.what = total, 0, what
        self.steps = steps
        self.interval_s = interval_s
        self.tty = steps.stream.isatty() if tty is None else tty
        self._last = steps.elapsed()
        self._ok = True

    def step(self, label: str) -> None:
        self.done += 1
        self._ok = self._ok and label == "verified"
        stream = self.steps.stream
        if self.tty:
            filled = int(30 * self.done / self.total)
            stream.write(f"\r  [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total} {label}   ")
            if self.done == self.total:
                stream.write("\n")
            stream.flush()
            return
        now = self.steps.elapsed()
        if self.done == self.total or now - self._last >= self.interval_s:
            self._last = now
            state = (
                ("all verified" if self.done == self.total else "all verified so far") if self._ok else "MISMATCH seen"
            )
            self.steps(f"{self.done}/{self.total} {self.what} done ({state})")
