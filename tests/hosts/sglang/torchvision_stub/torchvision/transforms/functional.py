"""Stub of torchvision.transforms.functional: InterpolationMode (as in torchvision) and inert functions."""

from enum import Enum

from .._stub import stubs


class InterpolationMode(Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


globals().update(
    stubs(
        __name__,
        "pil_to_tensor",
        "to_tensor",
        "to_pil_image",
        "resize",
        "normalize",
        "center_crop",
        "crop",
        "pad",
        "rescale",
        "to_dtype",
        "convert_image_dtype",
        "hflip",
        "vflip",
        "rotate",
        "grayscale_to_rgb",
        "rgb_to_grayscale",
        "adjust_brightness",
    )
)
