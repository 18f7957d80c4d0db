"""The pluggy markers of the ``kvwire`` project: decorate hookspecs and hookimpls."""

from __future__ import annotations

import pluggy

PROJECT_NAME = "kvwire"
ENTRY_POINT_GROUP = "kvwire.backends"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: The attribute pluggy's marker sets on a decorated function.
IMPL_ATTR = f"{PROJECT_NAME}_impl"
