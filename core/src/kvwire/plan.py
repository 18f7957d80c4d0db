"""``TransferPlan``: the flat descriptors one request turns into (what a transport writes)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import InvalidTransferError

__all__ = ["TransferPlan", "frozen"]

_EMPTY_I64: Final[NDArray[np.int64]] = np.zeros(0, dtype=np.int64)
_EMPTY_I64.setflags(write=False)


def frozen(a: NDArray[np.int64]) -> NDArray[np.int64]:
    """``a``, made read-only."""
    a.setflags(write=False)
    return a


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """Flat descriptors: copy ``length[i]`` bytes from address ``src[i]`` to address ``dst[i]``.

    The arrays are int64 and read-only. ``descriptors_before`` is how many
    descriptors there would be if every page of every buffer pair were its own
    (the coalescing ratio is ``descriptors_before / len(plan)``). Equality is
    identity (the fields are arrays).
    """

    src: NDArray[np.int64]
    dst: NDArray[np.int64]
    length: NDArray[np.int64]
    descriptors_before: int

    def __post_init__(self) -> None:
        n = self.src.shape
        if self.src.ndim != 1 or self.dst.shape != n or self.length.shape != n:
            raise InvalidTransferError(
                f"TransferPlan: src, dst and length must be 1-D of equal length, got shapes "
                f"{self.src.shape}, {self.dst.shape}, {self.length.shape}"
            )

    def __len__(self) -> int:
        """Number of descriptors."""
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        """Total bytes the plan moves."""
        return int(self.length.sum())

    def chunks(self, max_descriptors: int) -> Iterator[TransferPlan]:
        """Consecutive slices of at most ``max_descriptors`` descriptors (views, no copies).

        For engines that cap the batch size. An empty plan yields no chunk.
        Each chunk keeps the whole plan's ``descriptors_before``. A bad
        ``max_descriptors`` raises here, not when the first chunk is taken.
        """
        if isinstance(max_descriptors, bool) or not isinstance(max_descriptors, (int, np.integer)):
            raise InvalidTransferError(
                f"max_descriptors must be an int, got {type(max_descriptors).__name__} {max_descriptors!r}"
            )
        if max_descriptors < 1:
            raise InvalidTransferError(f"max_descriptors must be >= 1, got {max_descriptors}")
        step = int(max_descriptors)
        return (  # checked above, now, not on the first next()
            TransferPlan(
                self.src[i : i + step], self.dst[i : i + step], self.length[i : i + step], self.descriptors_before
            )
            for i in range(0, len(self), step)
        )

    @classmethod
    def empty(cls) -> TransferPlan:
        """A plan with no descriptors (an empty request is valid)."""
        return cls(_EMPTY_I64, _EMPTY_I64, _EMPTY_I64, 0)

