"""Keeping a process's stdout for what it promises: replies on a control channel, a JSON document, a table.

A backend's engine or a plugin may write to file descriptor 1 directly (UCX prints its errors there under
NIXL; a plugin may ``print`` at import), and one such line between two replies, or inside ``--json``
output, is a line the reader cannot parse. :func:`take_stdout` keeps a private duplicate of fd 1 for the
process's own output and points fd 1 at stderr, where such output belongs. It changes the process's
descriptors for good: only a process's entry point calls it (a control-channel child, the isolation
child, the ``kvwire`` command), never code that tests or embedders call in their own process.
"""

from __future__ import annotations

import os
import sys

__all__ = ["take_stdout"]


def take_stdout() -> int:
    """A private duplicate of fd 1 (the process's real stdout); fd 1 itself goes to stderr from now on."""
    sys.stdout.flush()
    kept = os.dup(1)
    os.dup2(2, 1)
    return kept
