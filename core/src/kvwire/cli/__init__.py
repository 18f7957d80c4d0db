"""The ``kvwire`` command: ``check``, ``spec``, ``lint`` and ``bench`` (see :mod:`kvwire.cli.main`)."""

from kvwire.cli.main import console, main

__all__ = ["console", "main"]
