"""NIXL backend for kvwire: the transport vLLM and Dynamo use, written against kvwire's public API only.

Importing this package never imports NIXL; the backend does, when it is created.
"""

from kvwire_nixl.backend import NixlBackend

__all__ = ["NixlBackend"]
