"""Fragmented page allocations: the request shapes the benchmarks send.

A request is a sequence of runs (consecutive page ids) whose lengths are
geometric with a chosen mean; each side places the same runs at shuffled,
non-touching places, so after coalescing a request's mean run is the chosen one.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray

__all__ = ["RunShape", "place", "run_lengths"]


RunShape = Literal["geometric", "fixed"]


def run_lengths(
    rng: np.random.Generator, pages: int, mean_run: int, shape: RunShape = "geometric"
) -> NDArray[np.int64]:
    """Run lengths adding up to ``pages``: geometric with mean ``mean_run`` (an allocator's
    free-list after churn: many short runs, a few long ones), or all exactly ``mean_run``."""
    if shape == "fixed":
        drawn: NDArray[np.int64] = np.full(pages, mean_run, dtype=np.int64)
    else:
        drawn = rng.geometric(1.0 / mean_run, size=pages).astype(np.int64)
    total = np.cumsum(drawn)
    k = int(np.searchsorted(total, pages))
    lengths: NDArray[np.int64] = drawn[: k + 1].copy()
    lengths[-1] -= int(total[k]) - pages
    return lengths


def place(rng: np.random.Generator, lengths: NDArray[np.int64], space: int) -> NDArray[np.int64]:
    """Page ids for runs of ``lengths``, each run contiguous, runs scattered over ``space`` pages.

    Runs are laid out in a shuffled order with a random gap of 1-3 free pages
    after each (so no two runs touch), then read back in request order.
    """
    order = rng.permutation(lengths.shape[0])
    gaps = rng.integers(1, 4, size=lengths.shape[0])
    slot = lengths[order] + gaps
    starts_shuffled = np.cumsum(slot) - slot
    if int(starts_shuffled[-1] + slot[-1]) > space:
        raise ValueError(
            f"a space of {space} pages is too small for {lengths.shape[0]} runs of {int(lengths.sum())} pages"
        )
    starts = np.empty_like(starts_shuffled)
    starts[order] = starts_shuffled
    run_of_page = np.repeat(np.arange(lengths.shape[0]), lengths)
    offset_in_run = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    return (starts[run_of_page] + offset_in_run).astype(np.int64)
