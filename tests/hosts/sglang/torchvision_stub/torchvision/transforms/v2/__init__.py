"""Stub of torchvision.transforms.v2."""

from ..._stub import stubs
from .. import InterpolationMode  # noqa: F401
from . import functional  # noqa: F401

globals().update(
    stubs(
        __name__,
        "Compose",
        "Lambda",
        "Resize",
        "ToTensor",
        "ToImage",
        "ToDtype",
        "Normalize",
        "CenterCrop",
        "PILToTensor",
        "Pad",
    )
)
