"""Stub of torchvision.io: ImageReadMode (same members and values as torchvision) and inert readers."""

from enum import Enum

from ._stub import stubs


class ImageReadMode(Enum):
    UNCHANGED = 0
    GRAY = 1
    GRAY_ALPHA = 2
    RGB = 3
    RGB_ALPHA = 4
    RGBA = RGB_ALPHA


globals().update(
    stubs(
        __name__,
        "decode_image",
        "read_image",
        "decode_jpeg",
        "decode_png",
        "read_file",
        "read_video",
        "read_video_timestamps",
        "VideoReader",
        "write_video",
    )
)
