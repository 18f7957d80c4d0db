"""Stub of torchvision.transforms.v2.functional (same inert names as transforms.functional)."""

from ...transforms.functional import *  # noqa: F403
from ...transforms.functional import InterpolationMode  # noqa: F401
