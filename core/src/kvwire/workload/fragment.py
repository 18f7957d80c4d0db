"""Fragmented page allocations: the request shapes the bench and the contract kit send.

A request is a sequence of runs (consecutive page ids) whose lengths are
geometric with a chosen mean; each side places the same runs at shuffled,
non-touching places, so after coalescing a request's mean run is the chosen one
(when the page space is too tight for gaps, runs may touch).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from numpy.typing import NDArray

__all__ = ["RunShape", "fragmented_pages", "place", "run_lengths"]


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
    after each (so no two runs touch), then read back in request order. When
    ``space`` is too small for such gaps, the free pages are spread at random
    between the runs instead (some runs may then touch).
    """
    count = lengths.shape[0]
    pages = int(lengths.sum())
    if pages > space:
        raise ValueError(f"a space of {space} pages is too small for {count} runs of {pages} pages")
    order = rng.permutation(count)
    gaps = np.asarray(rng.integers(1, 4, size=count), dtype=np.int64)
    if pages + int(gaps.sum()) > space:
        gaps = np.asarray(rng.multinomial(space - pages, np.full(count, 1.0 / count)), dtype=np.int64)
    slot = lengths[order] + gaps
    starts_shuffled: NDArray[np.int64] = np.cumsum(slot) - slot
    starts = np.empty_like(starts_shuffled)
    starts[order] = starts_shuffled
    run_of_page = np.repeat(np.arange(lengths.shape[0]), lengths)
    offset_in_run = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    pages_out: NDArray[np.int64] = (starts[run_of_page] + offset_in_run).astype(np.int64)
    return pages_out


def fragmented_pages(
    rng: np.random.Generator, space: int, count: int, mean_run: int = 3, shape: RunShape = "geometric"
) -> NDArray[np.int32]:
    """``count`` distinct page ids (int32, as the spec passes them) out of ``space``, in scattered runs."""
    if not 0 <= count <= space:
        raise ValueError(f"count {count} must be in [0, space={space}]")
    if count == 0:
        return np.zeros(0, dtype=np.int32)
    return place(rng, run_lengths(rng, count, mean_run, shape), space).astype(np.int32)
