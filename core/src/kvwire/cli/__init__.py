"""The ``kvwire`` command: ``check``, ``spec``, ``lint`` and ``bench`` (see :mod:`kvwire.cli.main`)."""

from kvwire.cli.main import main

__all__ = ["main"]
