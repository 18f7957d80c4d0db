"""The build backend of the repository root, which is a workspace, not a distribution.

``pip install .`` at the root would otherwise fail with setuptools' "multiple top-level
packages in a flat-layout" error; every hook here stops with what to install instead.
"""

from __future__ import annotations

from typing import NoReturn

MESSAGE = (
    "kvwire: the repository root is a workspace, not a distribution. Install the core and the backends "
    "you need from their directories, e.g. `pip install ./core ./plugins/mooncake` (`make setup` installs "
    "them all, editable), or build their wheels and sdists with `make dist` and install from dist/ "
    "(README.md, Install)."
)


def _refuse(*args: object, **kwargs: object) -> NoReturn:
    raise SystemExit(MESSAGE)


get_requires_for_build_wheel = get_requires_for_build_sdist = get_requires_for_build_editable = _refuse
prepare_metadata_for_build_wheel = prepare_metadata_for_build_editable = _refuse
build_wheel = build_sdist = build_editable = _refuse
