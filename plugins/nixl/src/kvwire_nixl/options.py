"""``NixlOptions``: the NIXL backend's keys in ``BackendConfig.options``, parsed and checked.

``progress``
    ``"kvwire"`` (default): NIXL's UCX progress thread is off; a kvwire thread
    progresses the agent's UCX worker every ``progress_interval_ms`` (a peer's
    first contact needs this side to answer), and a write progresses it itself
    while it waits. ``"nixl"``: NIXL's own progress thread, which NIXL 1.5's
    Python API starts with a poll delay of 0, so it keeps a core busy.
``progress_interval_ms``
    How often the kvwire progress thread runs, 0.1..1000 (default 2).
``num_threads``
    NIXL's UCX thread pool, 0..64 (default 0): a write of at least 1024
    descriptors is split over this many NIXL threads, each with its own UCX
    worker (they sleep when idle). With 0 the calling thread does the work;
    over UCX's shared-memory transport (``cma``) the whole copy then happens
    inside NIXL's post. On a 2-vCPU host the copy is memory-bound and 2 threads
    measured no faster.
``streams``
    How many kvwire posting threads, each bound to its own UCX worker (NIXL's
    ``num_workers``), share one write: ``"auto"`` (default: 2 where at least 2
    CPUs are usable, else 1) or an int 1..64. A write of at least
    ``streams`` x 4 MiB is split into that many byte-balanced chunks of its
    descriptor tables, posted from the threads at once; over ``cma`` each
    posting thread performs its chunk's copy, so 2 streams use 2 cores. With
    more than 1 the agent runs in ``NIXL_THREAD_SYNC_RW`` (UCX workers in
    multi-thread mode).

Values may be strings (the ``kvwire`` CLI passes strings). Every error is a
:class:`kvwire.ConfigError` naming ``BackendConfig.options['<key>']``.
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass
from typing import Final, Literal

import kvwire

__all__ = ["NixlOptions"]

_PROGRESS: Final = ("kvwire", "nixl")
_INTERVAL_RANGE: Final = (0.1, 1000.0)
_MAX_THREADS: Final = 64
_MAX_STREAMS: Final = 64
_AUTO_STREAMS: Final = 2


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def _key(name: str) -> str:
    return f"BackendConfig.options[{name!r}]"


def _number(name: str, value: object, low: float, high: float) -> float:
    """``value`` (a number or a decimal string) as a float in ``[low, high]``."""
    number: object = value
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, float)) or math.isnan(number):
        raise kvwire.ConfigError(f"{_key(name)} must be a number, got {value!r:.60}")
    if not low <= number <= high:
        raise kvwire.ConfigError(f"{_key(name)} must be in [{low}, {high}], got {number}")
    return float(number)


def _count(name: str, value: object, high: int) -> int:
    """``value`` (an int or a string of digits) as an int in ``[0, high]``."""
    number = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= high:
        raise kvwire.ConfigError(f"{_key(name)} must be an int in [0, {high}], got {value!r:.60}")
    return number


def _streams(value: object) -> int:
    """``"auto"``, an int or a string of digits, as an int in ``[1, 64]``."""
    if value == "auto":
        return max(1, min(_AUTO_STREAMS, _usable_cpus()))
    number = int(value) if isinstance(value, str) and value.strip().isdigit() else value
    if isinstance(number, bool) or not isinstance(number, int) or not 1 <= number <= _MAX_STREAMS:
        raise kvwire.ConfigError(
            f"{_key('streams')} must be 'auto' or an int in [1, {_MAX_STREAMS}], got {value!r:.60}"
        )
    return number


@dataclass(frozen=True)
class NixlOptions:
    """The parsed options (see the module docstring)."""

    progress: Literal["kvwire", "nixl"] = "kvwire"
    progress_interval_ms: float = 2.0
    num_threads: int = 0
    streams: int = 1  # resolved: from_config turns "auto" into a number

    @classmethod
    def from_config(cls, config: kvwire.BackendConfig) -> NixlOptions:
        known = ("progress", "progress_interval_ms", "num_threads", "streams")
        for key in config.options:
            if key not in known:
                close = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise kvwire.ConfigError(f"{_key(key)} is not an option of the nixl backend{hint} (known: {known})")
        progress = config.options.get("progress", "kvwire")
        if progress not in _PROGRESS:
            raise kvwire.ConfigError(f"{_key('progress')} must be one of {_PROGRESS}, got {progress!r:.60}")
        interval = _number("progress_interval_ms", config.options.get("progress_interval_ms", 2.0), *_INTERVAL_RANGE)
        threads = _count("num_threads", config.options.get("num_threads", 0), _MAX_THREADS)
        streams = _streams(config.options.get("streams", "auto"))
        return cls("nixl" if progress == "nixl" else "kvwire", float(interval), threads, streams)
