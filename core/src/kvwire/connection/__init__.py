"""``Connection``: one backend instance behind pluggy, with the spec's guarantees."""

from kvwire.connection.connection import Connection

__all__ = ["Connection"]
