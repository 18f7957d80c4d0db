"""``raw_write``: Mooncake's bare write call, for benchmarks that compare kvwire against it.

Kept out of :class:`~kvwire_mooncake.engine.MooncakeEngine`, which offers only
:meth:`~kvwire_mooncake.engine.MooncakeEngine.borrow` for it: none of the
wrapper's checks, threads, deadlines or recovery apply here.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import NDArray

from kvwire.errors import TransferError
from kvwire_mooncake.engine import MooncakeEngine

__all__ = ["raw_write"]


def raw_write(
    engine: MooncakeEngine,
    session_id: str,
    src: NDArray[np.int64],
    dst: NDArray[np.int64],
    length: NDArray[np.int64],
) -> None:
    """Write through ``engine``'s current sending engine with nothing around the call.

    Sequential ``batch_transfer_sync_write`` calls of ``max_descriptors_per_call``
    descriptors (one unchunked call beyond ~2060 would break the session), in
    the caller's thread, no deadline. A non-zero code raises
    ``TransferError(code=rc)``; so does a closed engine.
    """
    step = engine.options.max_descriptors_per_call
    with engine.borrow() as raw:
        for i in range(0, len(src), step):
            j = i + step
            rc = int(
                raw.batch_transfer_sync_write(session_id, src[i:j].tolist(), dst[i:j].tolist(), length[i:j].tolist())
            )
            if rc != 0:
                raise TransferError(
                    f"batch_transfer_sync_write to {session_id} returned {rc}", code=rc, peer=session_id
                )
