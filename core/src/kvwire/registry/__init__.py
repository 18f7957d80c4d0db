"""Backends in: discovery of entry points, loading, validation against the spec, isolation for ``kvwire check``.

Import from the defining module; the public names are also in ``kvwire``.
"""
