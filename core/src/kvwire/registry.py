"""Backend discovery and registration: entry points in, validated backends out.

Entry points of the group ``kvwire.backends`` are read once per process. A
backend that is not allowed is never imported; one that fails to import is
isolated (recorded with its error); two distributions claiming one name are
both refused; every imported class goes through the validator. The policy
decides what drift means: ``strict`` makes it a start-up error, ``quarantine``
leaves the drifted backend out, loudly.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from importlib import metadata
from typing import Any, Literal

from kvwire.capabilities import FEATURE_DISTRIBUTIONS, FEATURES
from kvwire.config import BackendConfig
from kvwire.connection import Connection
from kvwire.errors import (
    BackendDriftError,
    BackendLoadError,
    ConfigError,
    DuplicateBackendError,
    UnsupportedFeatureError,
)
from kvwire.findings import Finding, PluginOrigin
from kvwire.markers import ENTRY_POINT_GROUP
from kvwire.validator import Status, validate_backend

__all__ = ["BackendInfo", "Policy", "Registry", "connect", "default_registry", "register_backend"]

log = logging.getLogger("kvwire")

Policy = Literal["strict", "quarantine"]
_POLICIES: tuple[Policy, ...] = ("strict", "quarantine")
ALLOW_ENV = "KVWIRE_BACKENDS"
POLICY_ENV = "KVWIRE_POLICY"


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
    def origin(self) -> PluginOrigin:
        return PluginOrigin(self.name, self.distribution, self.version, self.entry_point)

    def reason(self) -> str:
        """One line saying why the backend is (not) usable."""
        if self.status == "drift":
            rules = sorted({f.rule for f in self.findings})
            return f"drift: {len(self.findings)} finding(s) ({', '.join(rules)})"
        if self.error:
            return f"{self.status}: {self.error}"
        return self.status

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
            "error": self.error,
            "runtime": self.runtime,
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


@cache
def _entry_points(group: str) -> tuple[metadata.EntryPoint, ...]:
    """The group's entry points, read once per process (each read walks every distribution)."""
    return tuple(metadata.entry_points(group=group))


def _allow_from_env() -> frozenset[str] | None:
    raw = os.environ.get(ALLOW_ENV, "").strip()
    if not raw:
        return None
    return frozenset(n.strip() for n in raw.split(",") if n.strip())


def _policy_from_env() -> Policy:
    raw = os.environ.get(POLICY_ENV, "strict").strip() or "strict"
    if raw not in _POLICIES:
        raise ConfigError(f"{POLICY_ENV} must be one of {_POLICIES}, got {raw!r}")
    return raw


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
    except Exception as exc:  # a broken probe is reported, not raised
        return f"unavailable: availability() raised {type(exc).__name__}: {exc}"
    return "available" if reason is None else f"unavailable: {reason}"


def _dist_of(ep: metadata.EntryPoint) -> tuple[str | None, str | None]:
    dist = ep.dist
    if dist is None:
        return None, None
    return dist.metadata["Name"], dist.version


class Registry:
    """The set of backends one process can use.

    Args:
        allow: backend names that may be imported (None: ``$KVWIRE_BACKENDS``,
            or every installed backend when that is unset or empty).
        policy: ``"strict"`` (drift raises :class:`BackendDriftError` at load) or
            ``"quarantine"`` (drifted backends are left out and logged).
            None: ``$KVWIRE_POLICY``, default ``strict``.
        group: the entry-point group to discover (tests may use their own).
    """

    def __init__(
        self,
        allow: Iterable[str] | None = None,
        policy: Policy | None = None,
        *,
        group: str = ENTRY_POINT_GROUP,
    ) -> None:
        if policy is not None and policy not in _POLICIES:
            raise ConfigError(f"policy must be one of {_POLICIES}, got {policy!r}")
        if isinstance(allow, str):
            raise ConfigError(f"allow must be a collection of backend names, not the string {allow!r}")
        self.allow: frozenset[str] | None = frozenset(allow) if allow is not None else _allow_from_env()
        self.policy: Policy = policy if policy is not None else _policy_from_env()
        self.group = group
        self._infos: dict[str, BackendInfo] | None = None
        self._lock = threading.RLock()

    # -- discovery -----------------------------------------------------------

    def scan(self) -> list[BackendInfo]:
        """Discover, import (allowed only) and validate every backend; never raises for a bad one."""
        with self._lock:
            if self._infos is None:
                self._infos = self._discover()
            return list(self._infos.values())

    def _discover(self) -> dict[str, BackendInfo]:
        by_name: dict[str, list[metadata.EntryPoint]] = {}
        for ep in _entry_points(self.group):
            by_name.setdefault(ep.name, []).append(ep)
        infos: dict[str, BackendInfo] = {}
        for name in sorted(by_name):
            eps = sorted(by_name[name], key=lambda ep: _dist_of(ep)[0] or "")
            if len(eps) > 1 and (self.allow is None or name in self.allow):
                dists = [f"{d or '?'} {v or ''}".strip() for d, v in map(_dist_of, eps)]
                infos[name] = self._duplicate(name, eps, dists)
                continue
            infos[name] = self._load(name, eps[0])
        return infos

    def _duplicate(self, name: str, eps: Sequence[metadata.EntryPoint], dists: Sequence[str]) -> BackendInfo:
        message = (
            f"backend name {name!r} is claimed by {len(eps)} distributions: {', '.join(dists)} "
            f"(entry points {', '.join(ep.value for ep in eps)}); uninstall all but one"
        )
        log.error("kvwire: %s", message)
        return BackendInfo(name, ", ".join(dists), None, ", ".join(ep.value for ep in eps), "duplicate", error=message)

    def _load(self, name: str, ep: metadata.EntryPoint) -> BackendInfo:
        dist, version = _dist_of(ep)
        if self.allow is not None and name not in self.allow:
            return BackendInfo(
                name,
                dist,
                version,
                ep.value,
                "blocked",
                error=f"not in the allow-list ({', '.join(sorted(self.allow)) or 'empty'})",
            )
        try:
            cls = ep.load()
        except Exception as exc:  # an import error in one plugin must not stop the others
            log.warning("kvwire: backend %r (%s %s) failed to import: %r", name, dist, version, exc)
            return BackendInfo(name, dist, version, ep.value, "import-error", error=f"{type(exc).__name__}: {exc}")
        return self._validated(name, cls, PluginOrigin(name, dist, version, ep.value))

    def _validated(self, name: str, cls: Any, origin: PluginOrigin) -> BackendInfo:
        try:
            result = validate_backend(cls, origin)
        except Exception as exc:  # a validator bug must not take the other backends down
            log.error("kvwire: validating backend %r raised %r", name, exc)
            return BackendInfo(
                name,
                origin.distribution,
                origin.version,
                origin.entry_point,
                "import-error",
                error=f"validation raised {type(exc).__name__}: {exc}",
            )
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
            runtime=_runtime_of(cls) if result.status != "drift" else None,
            cls=cls if isinstance(cls, type) else None,
        )
        if result.findings:
            log.warning(
                "kvwire: backend %r drifts from the spec:\n%s", name, "\n".join(f.render() for f in result.findings)
            )
        return info

    def load(self) -> list[BackendInfo]:
        """:meth:`scan`, then apply the policy: under ``strict`` any drift raises."""
        infos = self.scan()
        if self.policy == "strict":
            findings = [f for info in infos if info.status == "drift" for f in info.findings]
            if findings:
                raise BackendDriftError(findings)
        return infos

    # -- runtime registration -------------------------------------------------

    def register(self, name: str, cls: type) -> BackendInfo:
        """Register a backend class at runtime; it is validated like an installed one.

        Raises :class:`DuplicateBackendError` if the name is taken, and under the
        ``strict`` policy :class:`BackendDriftError` if the class drifts (under
        ``quarantine`` it is recorded as drifted and left out).
        """
        if not isinstance(name, str) or not name:
            raise ConfigError(f"name must be a non-empty str, got {name!r}")
        with self._lock:
            infos = {i.name: i for i in self.scan()}
            if name in infos:
                taken = infos[name]
                owner = taken.distribution or "a runtime registration"
                raise DuplicateBackendError(
                    f"backend name {name!r} is already taken by {owner} ({taken.entry_point or taken.cls}); "
                    "register under another name"
                )
            module = getattr(cls, "__module__", "?")
            qualname = getattr(cls, "__qualname__", repr(cls))
            info = self._validated(name, cls, PluginOrigin(name, None, None, f"{module}:{qualname}"))
            if info.status == "drift" and self.policy == "strict":
                raise BackendDriftError(info.findings)
            assert self._infos is not None
            self._infos[name] = info
            return info

    # -- lookup ---------------------------------------------------------------

    def get(self, name: str) -> BackendInfo:
        """The usable backend ``name``, or :class:`BackendLoadError` saying why not."""
        infos = {i.name: i for i in self.load()}
        info = infos.get(name)
        if info is not None and info.usable:
            return info
        reason = "is not installed" if info is None else f"is not available ({info.reason()})"
        raise BackendLoadError(f"backend {name!r} {reason}. {self._listing(infos.values())}")

    @staticmethod
    def _listing(infos: Iterable[BackendInfo]) -> str:
        infos = list(infos)
        ok = [f"{i.name} ({i.distribution or 'runtime'} {i.version or ''}".rstrip() + ")" for i in infos if i.usable]
        bad = [f"{i.name} ({i.reason()})" for i in infos if not i.usable]
        text = f"Available: {', '.join(ok) or 'none'}."
        if bad:
            text += f" Not available: {'; '.join(bad)}."
        return text

    def supporting(self, features: Iterable[str]) -> list[BackendInfo]:
        """Usable backends that declare every feature in ``features``."""
        wanted = frozenset(features)
        return [i for i in self.load() if i.usable and wanted <= i.capabilities]

    def connect(
        self,
        name: str,
        config: BackendConfig | None = None,
        *,
        features: Iterable[str] = (),
        middleware: Sequence[object] = (),
    ) -> Connection:
        """Instantiate backend ``name`` behind a :class:`Connection`.

        ``features`` are required: a backend lacking one fails here (start-up),
        with the installed backends that do support it named.
        """
        wanted = frozenset(features)
        unknown = sorted(wanted - set(FEATURES))
        if unknown:
            raise ConfigError(f"features: unknown feature(s) {unknown}; known: {', '.join(FEATURES)}")
        info = self.get(name)
        lacking = sorted(wanted - info.capabilities)
        if lacking:
            others = [f"{i.name} ({i.distribution or 'runtime'})" for i in self.supporting(wanted)]
            hint = (
                f"backends that support them: {', '.join(others)}" if others else "no installed backend supports them"
            )
            providers = sorted({FEATURE_DISTRIBUTIONS[f] for f in lacking if f in FEATURE_DISTRIBUTIONS})
            if providers and not others:
                hint += f" (install {', '.join(providers)})"
            raise UnsupportedFeatureError(
                f"backend {name!r} ({info.distribution or 'runtime'}, spec {info.spec_version}) does not support "
                f"required feature(s) {lacking}; {hint}"
            )
        return Connection(
            info.name,
            info.cls,
            info.capabilities,
            config or BackendConfig(),
            middleware=middleware,
            spec_version=info.spec_version or "",
        )


_default: Registry | None = None
_default_lock = threading.Lock()


def default_registry() -> Registry:
    """The process-wide registry (allow-list and policy from the environment)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = Registry()
        return _default


def register_backend(name: str, cls: type) -> BackendInfo:
    """Register a third-party backend class at runtime in the default registry."""
    return default_registry().register(name, cls)


def connect(
    name: str,
    config: BackendConfig | None = None,
    *,
    features: Iterable[str] = (),
    middleware: Sequence[object] = (),
) -> Connection:
    """Connect through the default registry (see :meth:`Registry.connect`)."""
    return default_registry().connect(name, config, features=features, middleware=middleware)
