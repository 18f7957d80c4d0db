"""Backend discovery and registration: entry points in, validated backends out.

Entry points of the group ``kvwire.backends`` are read once per process, from
metadata alone: listing backends, spotting two distributions that claim one
name, and applying the allow-list import nothing. A backend is imported only
when it is asked for (:meth:`Registry.get`, so ``connect("local")`` imports
``local`` alone) or when every allowed one is (:meth:`Registry.scan`). One that
fails to import, even by raising ``SystemExit``, is isolated (recorded with its
error); every imported class goes through the validator. The policy decides
what drift means: ``strict`` makes it a start-up error, ``quarantine`` leaves
the drifted backend out, loudly. An allow-list naming a backend that is not
installed is an error, with the closest installed name suggested.

A name of the form ``module.path:ClassName`` is a backend no distribution
installed: its module is imported when it is asked for, with the same isolation
and the same validator. When an allow-list is set it must name that exact
string (docs/configuration.md).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Sequence
from functools import cache
from importlib import metadata
from typing import Literal

from kvwire.config import BackendConfig
from kvwire.connection import Connection
from kvwire.errors import (
    BackendDriftError,
    BackendImportError,
    BackendLoadError,
    ConfigError,
    DuplicateBackendError,
    UnsupportedFeatureError,
)
from kvwire.process_wide import ProcessWide
from kvwire.registry.findings import BackendOrigin
from kvwire.registry.loading import (
    MODULE_PATH_DISTRIBUTION,
    BackendInfo,
    did_you_mean,
    dist_of,
    is_module_path,
    load_backend,
    load_module_path,
    module_of,
    split_module_path,
    validated,
)
from kvwire.spec.capabilities import FEATURE_DISTRIBUTIONS, FEATURES
from kvwire.spec.pluggy_project import ENTRY_POINT_GROUP

__all__ = [
    "BackendInfo",
    "Entry",
    "Policy",
    "Registry",
    "allow_list_error",
    "connect",
    "default_registry",
    "installed_backends",
    "register_backend",
]

log = logging.getLogger("kvwire")

Policy = Literal["strict", "quarantine"]
_POLICIES: tuple[Policy, ...] = ("strict", "quarantine")
ALLOW_ENV = "KVWIRE_BACKENDS"
POLICY_ENV = "KVWIRE_POLICY"

#: One installed backend as metadata knows it: a final verdict (blocked, duplicate) or the entry point to import.
Entry = BackendInfo | metadata.EntryPoint


@cache
def _entry_points(group: str) -> tuple[metadata.EntryPoint, ...]:
    """The group's entry points, read once per process (each read walks every distribution)."""
    return tuple(metadata.entry_points(group=group))


def installed_backends(group: str = ENTRY_POINT_GROUP) -> list[str]:
    """The names of the installed backends, sorted; from metadata, nothing is imported."""
    return sorted({ep.name for ep in _entry_points(group)})


def allow_list_error(source: str, unknown: Iterable[str], installed: Sequence[str]) -> str:
    """The message for an allow-list naming backends that are not installed."""
    names = ", ".join(f"{n!r}{did_you_mean(n, installed)}" for n in sorted(unknown))
    return (
        f"{source} names backend(s) that are not installed: {names}; installed: {', '.join(installed) or 'none'}. "
        "Fix the spelling, or install the backend's distribution"
    )


def _allow_from_env() -> frozenset[str] | None:
    raw = os.environ.get(ALLOW_ENV, "").strip()
    if not raw:
        return None
    names = frozenset(n.strip() for n in raw.split(",") if n.strip())
    if not names:
        raise ConfigError(
            f"${ALLOW_ENV}={raw!r} names no backend; list backend names separated by commas "
            f"(installed: {', '.join(installed_backends()) or 'none'}), or unset it to allow every installed backend"
        )
    return names


def _policy_from_env() -> Policy:
    raw = os.environ.get(POLICY_ENV, "strict").strip() or "strict"
    if raw not in _POLICIES:
        raise ConfigError(f"{POLICY_ENV} must be one of {_POLICIES}, got {raw!r}")
    return raw


class Registry:
    """The set of backends one process can use.

    Args:
        allow: backend names that may be imported (None: ``$KVWIRE_BACKENDS``,
            or every installed backend when that is unset or empty). Naming a
            backend that is not installed makes :meth:`get` and :meth:`load` fail.
            A ``module.path:ClassName`` backend is allowed only by its exact
            string when an allow-list is set (and always when none is).
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
        self.allow_source = "allow" if allow is not None else f"${ALLOW_ENV}"
        self.policy: Policy = policy if policy is not None else _policy_from_env()
        self.group = group
        self._catalog: dict[str, Entry] | None = None
        self._loaded: dict[str, BackendInfo] = {}
        self._runtime: dict[str, BackendInfo] = {}
        self._paths: dict[str, BackendInfo] = {}  # module-path backends, by their module.path:ClassName
        self._lock = threading.RLock()

    # -- discovery -----------------------------------------------------------

    def entries(self) -> dict[str, Entry]:
        """Every installed backend by name, sorted, from metadata alone (nothing is imported)."""
        with self._lock:
            if self._catalog is None:
                self._catalog = self._read_catalog()
            return dict(self._catalog)

    def _read_catalog(self) -> dict[str, Entry]:
        by_name: dict[str, list[metadata.EntryPoint]] = {}
        for ep in _entry_points(self.group):
            by_name.setdefault(ep.name, []).append(ep)
        catalog: dict[str, Entry] = {}
        for name in sorted(by_name):
            eps = sorted(by_name[name], key=lambda ep: dist_of(ep)[0] or "")
            allowed = self.allow is None or name in self.allow
            if len(eps) > 1 and allowed:
                catalog[name] = self._duplicate(name, eps)
            elif not allowed:
                dist, version = dist_of(eps[0])
                listed = ", ".join(sorted(self.allow or ())) or "empty"
                error = f"not in the allow-list ({listed})"
                catalog[name] = BackendInfo(name, dist, version, eps[0].value, "blocked", error=error)
            else:
                catalog[name] = eps[0]
        return catalog

    @staticmethod
    def _duplicate(name: str, eps: Sequence[metadata.EntryPoint]) -> BackendInfo:
        dists = [f"{d or '?'} {v or ''}".strip() for d, v in map(dist_of, eps)]
        message = (
            f"backend name {name!r} is claimed by {len(eps)} distributions: {', '.join(dists)} "
            f"(entry points {', '.join(ep.value for ep in eps)}); uninstall all but one"
        )
        log.error("kvwire: %s", message)
        return BackendInfo(name, ", ".join(dists), None, ", ".join(ep.value for ep in eps), "duplicate", error=message)

    def unknown_allowed(self) -> list[str]:
        """Names in the allow-list that are neither installed nor registered at runtime (module paths aside)."""
        if self.allow is None:
            return []
        return sorted(n for n in self.allow - set(self.entries()) - set(self._runtime) if not is_module_path(n))

    def _check_allow_list(self) -> None:
        unknown = self.unknown_allowed()
        if unknown:
            raise BackendLoadError(allow_list_error(self.allow_source, unknown, installed_backends(self.group)))

    def _resolve(self, name: str, entry: Entry) -> BackendInfo:
        if isinstance(entry, BackendInfo):
            return entry
        if name not in self._loaded:
            self._loaded[name] = load_backend(name, entry, *dist_of(entry))
        return self._loaded[name]

    def scan(self) -> list[BackendInfo]:
        """Import (allowed only) and validate every backend in this process; never raises for a bad one.

        A plugin that hangs or kills the process at import cannot be survived
        in-process: ``kvwire check`` runs each one in a child (:mod:`kvwire.registry.isolation`).
        """
        with self._lock:
            infos = [self._resolve(name, entry) for name, entry in self.entries().items()]
            paths = set(self._paths) | {n for n in self.allow or () if is_module_path(n)}
            return infos + list(self._runtime.values()) + [self._load_path(n) for n in sorted(paths)]

    def _load_path(self, name: str) -> BackendInfo:
        if name not in self._paths:
            self._paths[name] = load_module_path(name)
        return self._paths[name]

    def _module_path(self, name: str) -> BackendInfo:
        """A ``module.path:ClassName`` backend, imported once if the allow-list lets it."""
        split_module_path(name)  # a malformed name is the caller's mistake: ConfigError
        if self.allow is not None and name not in self.allow:
            listed = ", ".join(sorted(self.allow)) or "empty"
            raise BackendLoadError(
                f"module-path backend {name!r} is not allowed: the allow-list ({self.allow_source}: {listed}) does "
                f"not name it; add the exact string {name!r} to {self.allow_source}, or leave the allow-list unset"
            )
        self._check_allow_list()
        return self._load_path(name)

    def load(self) -> list[BackendInfo]:
        """:meth:`scan`, then apply the policy: under ``strict`` any drift raises.

        An allow-list naming a backend that is not installed raises :class:`BackendLoadError` first.
        """
        self._check_allow_list()
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
            taken = self._runtime[name] if name in self._runtime else self.entries().get(name)
            if taken is not None:
                if isinstance(taken, BackendInfo):
                    owner, where = taken.distribution or "a runtime registration", taken.entry_point or taken.cls
                else:
                    owner, where = dist_of(taken)[0] or "?", taken.value
                raise DuplicateBackendError(
                    f"backend name {name!r} is already taken by {owner} ({where}); register under another name"
                )
            module = getattr(cls, "__module__", "?")
            qualname = getattr(cls, "__qualname__", repr(cls))
            info = validated(name, cls, BackendOrigin(name, None, None, f"{module}:{qualname}"))
            if info.status == "drift" and self.policy == "strict":
                raise BackendDriftError(info.findings)
            self._runtime[name] = info
            return info

    # -- lookup ---------------------------------------------------------------

    def get(self, name: str) -> BackendInfo:
        """The usable backend ``name``, or :class:`BackendLoadError` saying why not.

        Only ``name``'s entry point is imported; the other installed backends are
        listed from metadata. Under ``strict`` a drifted ``name`` raises :class:`BackendDriftError`.
        """
        with self._lock:
            entries = self.entries()
            if name in self._runtime:
                info = self._runtime[name]
            elif name in entries:
                self._check_allow_list()
                info = self._resolve(name, entries[name])
            elif is_module_path(name):
                info = self._module_path(name)
            else:
                hint = did_you_mean(name, [*entries, *self._runtime])
                raise BackendLoadError(f"backend {name!r} is not installed{hint}. {self._listing()}")
            if info.usable:
                return info
            if info.status == "drift" and self.policy == "strict":
                raise BackendDriftError(info.findings)
            if info.status == "import-error" and info.distribution == MODULE_PATH_DISTRIBUTION:
                raise BackendImportError(
                    f"backend {name!r} ({MODULE_PATH_DISTRIBUTION}) cannot be loaded: {info.error}. Fix the module "
                    "or the module path (is its directory on sys.path?); the other backends are unaffected"
                )
            if info.status == "import-error":
                raise BackendImportError(
                    f"{info.origin.describe()} failed to import: {info.error}. Fix or reinstall "
                    f"{info.distribution or 'it'} (module {module_of(info.entry_point)}), or uninstall it; "
                    "the other backends are unaffected"
                )
            raise BackendLoadError(f"backend {name!r} is not available ({info.reason()}). {self._listing()}")

    def _listing(self) -> str:
        """Usable (or installed, not yet imported) backends, then the others with why."""
        ok: list[str] = []
        bad: list[str] = []
        known: list[Entry] = [self._loaded.get(n, e) for n, e in self.entries().items()]
        for entry in [*known, *self._runtime.values(), *self._paths.values()]:
            if isinstance(entry, metadata.EntryPoint):
                dist, version = dist_of(entry)
                ok.append(f"{entry.name} ({dist or '?'} {version or ''}".rstrip() + ")")
            elif entry.usable:
                ok.append(f"{entry.name} ({entry.distribution or 'runtime'} {entry.version or ''}".rstrip() + ")")
            else:
                bad.append(f"{entry.name} ({entry.reason()})")
        text = f"Available: {', '.join(ok) or 'none'}."
        if bad:
            text += f" Not available: {'; '.join(bad)}."
        return text

    def supporting(self, features: Iterable[str]) -> list[BackendInfo]:
        """Usable backends that declare every feature in ``features`` (imports every allowed backend)."""
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

        ``config`` None: :meth:`BackendConfig.from_sources` (``$KVWIRE_CONFIG`` and ``KVWIRE_*``
        variables over the defaults); a config given is used as it is.

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
            BackendConfig.from_sources() if config is None else config,
            middleware=middleware,
            spec_version=info.spec_version or "",
        )


_default: ProcessWide[Registry] = ProcessWide(Registry)


def default_registry() -> Registry:
    """The process-wide registry (allow-list and policy from the environment)."""
    return _default.get()


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
