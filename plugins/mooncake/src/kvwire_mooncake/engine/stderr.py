"""Capturing file descriptor 2 around engine creation, which is the only way to silence it.

The engine logs from C++ straight to fd 2 and always prints a few lines when
one is created, whatever ``MC_LOG_LEVEL`` says. fd 2 is process-wide, so the
capture is used only when ``BackendConfig.process_settings`` is on (and not
``verbose``), and captures are serialised across threads.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Final

__all__ = ["captured_stderr"]

_GLOG_LINE: Final = re.compile(
    r"^(?:[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ [^\]]+\] |WARNING: Logging before InitGoogleLogging)"
)

#: Held for the whole window in which fd 2 is redirected (dup, dup2, restore, write-back):
#: two overlapping windows (two engines created at once) would restore each other's temp
#: file and leave fd 2 pointing at a deleted file. Reentrant, so an engine factory that
#: itself creates an engine cannot deadlock.
_STDERR_LOCK: Final = threading.RLock()


@contextmanager
def captured_stderr(enabled: bool) -> Iterator[list[str]]:
    """Capture file descriptor 2 for the block; yields a list that receives the engine's lines.

    Lines in glog's format are kept out of the terminal (and handed to the
    caller, for an error message); anything else written meanwhile, such as
    another thread's traceback, is written back to fd 2 afterwards. fd 2 is
    always restored. With ``enabled`` False nothing is touched.
    """
    lines: list[str] = []
    if not enabled:
        yield lines
        return
    with _STDERR_LOCK:
        try:
            sys.stderr.flush()
            saved = os.dup(2)
        except (OSError, ValueError, AttributeError):
            yield lines
            return
        try:
            with tempfile.TemporaryFile() as tmp:
                os.dup2(tmp.fileno(), 2)
                try:
                    yield lines
                finally:
                    with suppress(OSError, ValueError, AttributeError):
                        sys.stderr.flush()
                    os.dup2(saved, 2)
                    tmp.seek(0)
                    other: list[str] = []
                    for line in tmp.read().decode(errors="replace").splitlines(keepends=True):
                        (lines if _GLOG_LINE.match(line) else other).append(line.rstrip("\n"))
                    if other:
                        with suppress(OSError):
                            os.write(2, ("\n".join(other) + "\n").encode())
        finally:
            os.close(saved)
