"""Transfer planning: the address arithmetic every backend shares (see :mod:`kvwire.planning.planner`).

Names re-exported for readers of ``kvwire.planning``; the core imports from the defining module.
"""

from kvwire.planning.head_slicing import needs_head_slicing, tp_aware, tp_mismatch
from kvwire.planning.plan import TransferPlan
from kvwire.planning.planner import check_peer_shape, plan_request, plan_transfer
from kvwire.spec.request import TransferRequest

__all__ = [
    "TransferPlan",
    "TransferRequest",
    "check_peer_shape",
    "needs_head_slicing",
    "plan_request",
    "plan_transfer",
    "tp_aware",
    "tp_mismatch",
]
