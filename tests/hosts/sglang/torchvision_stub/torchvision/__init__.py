"""Inert torchvision stub for kvwire's CPU-only sglang test venv (tests/hosts/sglang/).

PyPI only offers CUDA builds of torchvision, which fail next to a CPU torch. sglang (and transformers,
once torchvision is importable) import torchvision at module level; the disaggregation code under test
never calls it. The submodules define the names imported at module level; calling any of them raises
NotImplementedError.
"""

__version__ = "0.0.0+kvwire.stub"

from . import io, transforms  # noqa: F401  (real torchvision exposes both as attributes)
