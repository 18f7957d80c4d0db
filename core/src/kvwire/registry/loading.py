"""Loading one backend: import its entry point, validate the class, probe its runtime.

Shared by the in-process :class:`kvwire.Registry` and the isolated check
child (:mod:`kvwire.registry.isolation`), so both report a backend the same way. A
backend whose import raises anything but ``KeyboardInterrupt`` (``SystemExit``
included) is recorded as ``import-error``: a plugin must never end the process
that merely looked at it.
"""

from __future__ import annotations

import difflib
import importlib
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any, Literal

from kvwire.errors import ConfigError
from kvwire.registry.findings import BackendOrigin, Finding
from kvwire.registry.validator import Status, validate_backend

__all__ = [
    "MODULE_PATH_DISTRIBUTION",
    "BackendInfo",
    "Phase",
    "dist_of",
    "did_you_mean",
    "is_module_path",
    "load_backend",
    "load_module_path",
    "module_of",
    "split_module_path",
]

log = logging.getLogger("kvwire")

#: The ``distribution`` of a backend loaded by ``module.path:ClassName`` (no distribution installed it).
MODULE_PATH_DISTRIBUTION = "loaded by module path"
_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_MODULE_PATH = re.compile(rf"({_DOTTED}):({_DOTTED})")

#: What a load is doing: reported by the isolated child so a hang or a crash names its phase.
Phase = Literal["import", "validate", "availability"]


@dataclass(frozen=True)
class BackendInfo:
    """What the registry knows of one backend: origin, status, and why."""

    name: str
    distribution: str | None
    version: str | None
    entry_point: str | None
    status: Status
    spec_version: str | None = None
    declared_spec_version: str | None = None
    capabilities: frozenset[str] = frozenset()
    findings: tuple[Finding, ...] = ()
    error: str | None = None
    runtime: str | None = None
    cls: type | None = field(default=None, repr=False, compare=False)

    @property
    def usable(self) -> bool:
        """True when the backend validated (``ok`` or ``adapted``)."""
        return self.status in ("ok", "adapted") and self.cls is not None

    @property
    def origin(self) -> BackendOrigin:
        return BackendOrigin(self.name, self.distribution, self.version, self.entry_point)

    def reason(self) -> str:
        """One line saying why the backend is (not) usable."""
        if self.status == "drift":
            rules = sorted({f.rule for f in self.findings})
            return f"drift: {len(self.findings)} finding(s) ({', '.join(rules)})"
        if self.error:
            return f"{self.status}: {self.error}"
        return self.status

    @property
    def submission(self) -> str | None:
        """How ``submit_kvcache`` runs: ``"native"`` (the backend's hook), ``"core"`` (the core's pool), or None."""
        if self.status not in ("ok", "adapted"):
            return None
        return "native" if "submit" in self.capabilities else "core"

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "entry_point": self.entry_point,
            "status": self.status,
            "spec_version": self.spec_version,
            "declared_spec_version": self.declared_spec_version,
            "capabilities": sorted(self.capabilities),
            "submit": self.submission,
            "error": self.error,
            "runtime": self.runtime,
            # True or False once availability() was asked (the backend loaded), else None
            "available": None if self.runtime is None else self.runtime == "available",
            "findings": [
                {
                    "hook": f.hook,
                    "rule": f.rule,
                    "message": f.message,
                    "fix": f.fix,
                    "spec_signature": f.spec_signature,
                    "impl_signature": f.impl_signature,
                    "defined_in": f.defined_in,
                }
                for f in self.findings
            ],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BackendInfo:
        """The inverse of :meth:`to_dict` (the class itself stays in the process that imported it)."""
        origin = (data["name"], data["distribution"], data["version"], data["entry_point"])
        findings = tuple(
            Finding(
                *origin,
                f["hook"],
                f["rule"],
                f["message"],
                f["spec_signature"],
                f["impl_signature"],
                f["fix"],
                f["defined_in"],
            )
            for f in data["findings"]
        )
        return cls(
            *origin,
            data["status"],
            data["spec_version"],
            data["declared_spec_version"],
            frozenset(data["capabilities"]),
            findings,
            data["error"],
            data["runtime"],
        )


def dist_of(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    """(distribution name, version) of an entry point, from metadata alone."""
    dist = ep.dist
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


def module_of(entry_point: str | None) -> str:
    """The module part of ``module:attr``."""
    return (entry_point or "?").split(":", 1)[0].strip()


def did_you_mean(name: str, choices: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` for the closest of ``choices``, or ``""``."""
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _raised(exc: BaseException, where: str) -> str:
    """The error text of a plugin's exception; a non-``Exception`` one says why it was caught."""
    if isinstance(exc, Exception):
        return f"{type(exc).__name__}: {exc}"
    why = "must not exit the process" if isinstance(exc, SystemExit) else "must raise only Exception subclasses"
    return f"{exc!r} raised {where} (a backend {why})"


def _runtime_of(cls: Any) -> str:
    """``"available"`` or ``"unavailable: <reason>"`` from the optional ``availability()`` classmethod.

    A backend whose runtime (hardware, engine wheel) may be missing defines
    ``availability() -> str | None`` returning the reason, found without heavy imports.
    """
    probe = getattr(cls, "availability", None)
    if not callable(probe):
        return "available"
    try:
        reason = probe()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a broken probe is reported, not raised (SystemExit included)
        return f"unavailable: availability() raised {_raised(exc, 'in availability()')}"
    return "available" if reason is None else f"unavailable: {reason}"


def _no_phase(phase: Phase) -> None:
    """Default phase callback: nothing to report in-process."""


def load_backend(
    name: str,
    ep: metadata.EntryPoint,
    dist: str | None,
    version: str | None,
    phase: Callable[[Phase], None] = _no_phase,
) -> BackendInfo:
    """Import ``ep``, validate its class and probe its runtime; never raises for a bad backend.

    ``phase`` is called before each step, so an isolated child can say where it hung or died.
    """
    phase("import")
    try:
        cls = ep.load()
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # one plugin's import must not stop the others, nor end the process
        log.warning("kvwire: backend %r (%s %s) failed to import: %r", name, dist, version, exc)
        return BackendInfo(name, dist, version, ep.value, "import-error", error=_raised(exc, "at import"))
    return validated(name, cls, BackendOrigin(name, dist, version, ep.value), phase)


def validated(name: str, cls: Any, origin: BackendOrigin, phase: Callable[[Phase], None] = _no_phase) -> BackendInfo:
    """Validate an imported backend class (and probe its runtime when it validates)."""
    phase("validate")
    try:
        result = validate_backend(cls, origin)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a validator bug (or a hostile class attribute) must not take the others down
        log.error("kvwire: validating backend %r raised %r", name, exc)
        return BackendInfo(
            name,
            origin.distribution,
            origin.version,
            origin.entry_point,
            "import-error",
            error=f"validation raised {_raised(exc, 'while validating')}",
        )
    runtime = None
    if result.status != "drift":
        phase("availability")
        runtime = _runtime_of(cls)
    info = BackendInfo(
        name,
        origin.distribution,
        origin.version,
        origin.entry_point,
        result.status,
        result.spec_version,
        result.declared_spec_version,
        result.capabilities,
        result.findings,
        runtime=runtime,
        cls=cls if isinstance(cls, type) else None,
    )
    if result.findings:
        log.warning(
            "kvwire: backend %r drifts from the spec:\n%s", name, "\n".join(f.render() for f in result.findings)
        )
    return info


def is_module_path(name: str) -> bool:
    """Whether a backend name is a ``module.path:ClassName`` (entry-point names have no colon)."""
    return ":" in name


def split_module_path(name: str) -> tuple[str, str]:
    """``("module.path", "ClassName")``, or a ConfigError saying how to write one."""
    match = _MODULE_PATH.fullmatch(name)
    if match is None:
        raise ConfigError(
            f"backend {name!r} is not a valid module path: write module.path:ClassName "
            "(dotted Python names, one colon), or an installed backend's name"
        )
    return match.group(1), match.group(2)


def load_module_path(name: str, phase: Callable[[Phase], None] = _no_phase) -> BackendInfo:
    """Import ``module.path:ClassName`` and validate the class as :func:`load_backend` does an entry point.

    Never raises for a bad backend: an import that raises, or a missing
    attribute, is an ``import-error`` whose error says which.
    """
    try:
        module_name, attr = split_module_path(name)
    except ConfigError as exc:  # an allow-listed name scanned: reported, not raised
        return BackendInfo(name, MODULE_PATH_DISTRIBUTION, None, name, "import-error", error=str(exc))
    phase("import")
    try:
        module = importlib.import_module(module_name)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # as for an entry point: the process goes on
        log.warning("kvwire: backend module %r failed to import: %r", module_name, exc)
        error = f"importing module {module_name!r} raised {_raised(exc, 'at import')}"
        return BackendInfo(name, MODULE_PATH_DISTRIBUTION, None, name, "import-error", error=error)
    where = getattr(module, "__file__", None)
    version = f"from {where}" if where else "from a module without a file"
    obj: Any = module
    for i, part in enumerate(attr.split(".")):
        owner = ".".join([module_name, *attr.split(".")[:i]])
        try:
            obj = getattr(obj, part)
        except KeyboardInterrupt:
            raise
        except AttributeError:
            hint = did_you_mean(part, [n for n in dir(obj) if not n.startswith("_")])
            error = f"module {module_name!r} imported, but {owner!r} has no attribute {part!r}{hint}"
            return BackendInfo(name, MODULE_PATH_DISTRIBUTION, version, name, "import-error", error=error)
        except BaseException as exc:  # a module __getattr__ that raises
            error = f"getting {part!r} from {owner!r} raised {_raised(exc, 'at import')}"
            return BackendInfo(name, MODULE_PATH_DISTRIBUTION, version, name, "import-error", error=error)
    return validated(name, obj, BackendOrigin(name, MODULE_PATH_DISTRIBUTION, version, name), phase)
