"""Stub of torchvision.transforms: InterpolationMode and inert transform classes."""

from .._stub import stubs
from . import functional  # noqa: F401
from .functional import InterpolationMode  # noqa: F401

globals().update(
    stubs(
        __name__,
        "Compose",
        "Lambda",
        "Resize",
        "ToTensor",
        "ToPILImage",
        "Normalize",
        "CenterCrop",
        "RandomResizedCrop",
        "PILToTensor",
        "ConvertImageDtype",
        "Pad",
        "Grayscale",
        "RandomHorizontalFlip",
    )
)
