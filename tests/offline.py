"""What a test does when the package index cannot be reached: skip, naming it, except in CI, where it fails.

A skipped install test in CI would be a green run that checked nothing; ``.ci/run``
exports ``CI=true`` so that an unreachable index is a red run with the reason.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

__all__ = ["index_unreachable"]


def index_unreachable(detail: str) -> NoReturn:
    """Skip (``package index unreachable: ...`` in the summary), or fail when ``CI=true``."""
    reason = f"package index unreachable: {detail}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: an install test may not skip)", pytrace=False)
    pytest.skip(reason)
