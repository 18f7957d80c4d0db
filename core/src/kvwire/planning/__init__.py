"""Transfer planning: the address arithmetic every backend shares (see :mod:`kvwire.planning.planner`).

Import from the defining module; the public names are also in ``kvwire``.
"""
