"""Is an Ascend NPU runtime usable here? Answered without importing torch_npu.

Importing torch_npu (or even having it installed next to torch) without CANN
breaks ``import torch`` itself, so detection only looks at metadata, module
specs and the CANN environment.
"""

from __future__ import annotations

import ctypes.util
import importlib.util
import os

__all__ = ["npu_unavailable_reason"]

_CANN_ENV = ("ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME", "ASCEND_OPP_PATH")


def npu_unavailable_reason() -> str | None:
    """Why NPU transfers cannot run here, or None when torch_npu, CANN and the engine are present."""
    missing = []
    if importlib.util.find_spec("torch_npu") is None:
        missing.append("torch_npu is not installed (pip install 'kvwire-ascend[npu]' on an Ascend host)")
    if not any(os.environ.get(name) for name in _CANN_ENV) and ctypes.util.find_library("ascendcl") is None:
        missing.append("CANN is not set up (no libascendcl, ASCEND_HOME_PATH unset: source set_env.sh)")
    if importlib.util.find_spec("mooncake") is None:
        missing.append("no Mooncake engine with the Ascend transport (mooncake-transfer-engine-npu)")
    return "; ".join(missing) or None
