"""Reading a file that someone else named, without letting it hang or exhaust the process.

A path from a config variable or a scanned tree may be a FIFO (opening it waits
for a writer), a device that never ends (``/dev/zero``), or a huge file. The one
reader here opens without blocking, judges what was opened (not the name), and
reads at most ``limit`` bytes; ``kvwire lint`` and ``BackendConfig.from_sources``
both use it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["UnreadableFile", "read_regular_file"]


class UnreadableFile(Exception):
    """The file is not one this reader will read; ``str()`` says why (for the caller's own message)."""


def read_regular_file(path: Path | str, limit: int) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes.

    Raises :class:`UnreadableFile` for anything else (not a regular file, over ``limit``, or grown past
    it while read) and ``OSError`` when it cannot be opened at all.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO would otherwise wait here for a writer
    with open(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnreadableFile("not a regular file")
        if info.st_size > limit:
            raise UnreadableFile(f"{info.st_size} bytes, over the limit of {limit}")
        data = file.read(limit + 1)
        if len(data) > limit:  # grew since fstat
            raise UnreadableFile(f"over the limit of {limit} bytes")
    return data
