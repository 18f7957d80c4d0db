"""The short path for backend authors: :class:`Transport` (the engine's operations) and
:class:`TransportBackend` (every spec hook, implemented once over them), with the registered-memory
checks and the per-send telemetry they share."""

from kvwire.transport.backend import TransportBackend
from kvwire.transport.interface import RawWriter, Transport
from kvwire.transport.regions import RegionSet

__all__ = ["RawWriter", "RegionSet", "Transport", "TransportBackend"]
