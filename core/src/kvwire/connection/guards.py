"""What the Connection checks around a backend: middleware at connect, and what a backend raises.

A middleware may only wrap spec hooks; anything a backend raises that is not a
kvwire error reaches the caller as :class:`kvwire.BackendError`, chained.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager

from kvwire.errors import BackendError, ConfigError, KvwireError
from kvwire.spec.history import CURRENT
from kvwire.spec.hooks import spec_hooks
from kvwire.spec.pluggy_project import IMPL_ATTR

__all__ = ["as_backend_error", "backend_errors", "check_middleware"]


def check_middleware(obj: object, what: str) -> None:
    """A middleware may only wrap spec hooks (``wrapper=True``) and take spec arguments."""
    hooks = spec_hooks(CURRENT)
    marked = [n for n in dir(obj) if getattr(getattr(obj, n, None), IMPL_ATTR, None) is not None]
    if not marked:
        raise ConfigError(f"{what} ({type(obj).__name__}) has no @kvwire.hookimpl(wrapper=True) method")
    for name in marked:
        func = getattr(obj, name)
        if name not in hooks:
            close = difflib.get_close_matches(name, list(hooks), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"{what} ({type(obj).__name__}): {name!r} is not a kvwire hook{hint}")
        opts = getattr(func, IMPL_ATTR)
        if not (opts.get("wrapper") or opts.get("hookwrapper")):
            raise ConfigError(
                f"{what} ({type(obj).__name__}).{name} must be declared @kvwire.hookimpl(wrapper=True): "
                "a plain implementation would answer instead of the backend"
            )
        allowed = {p.name for p in hooks[name].params}
        params = list(inspect.signature(func).parameters)
        unknown = [p for p in params if p not in allowed]
        if unknown:
            raise ConfigError(
                f"{what} ({type(obj).__name__}).{name} takes {unknown}, not arguments of hook {name!r} "
                f"({', '.join(sorted(allowed)) or 'none'})"
            )


def as_backend_error(exc: BaseException, name: str, where: str) -> BaseException:
    """``exc`` if it is a kvwire error (or not an Exception/SystemExit), else a BackendError chained to it."""
    if isinstance(exc, KvwireError) or not isinstance(exc, (Exception, SystemExit)):
        return exc
    wrapped = BackendError(
        f"backend {name!r} raised {type(exc).__name__} in {where}: {exc} (backends must raise kvwire errors; "
        "the original is chained)"
    )
    wrapped.__cause__ = exc
    return wrapped


@contextmanager
def backend_errors(name: str, where: str) -> Iterator[None]:
    """Let kvwire errors through; wrap anything else a backend raises (SystemExit included) in BackendError."""
    try:
        yield
    except KvwireError:
        raise
    except (Exception, SystemExit) as exc:
        raise as_backend_error(exc, name, where) from exc
