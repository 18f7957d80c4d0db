"""Validation findings: one drift of one backend from the spec, fully explained."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Finding", "BackendOrigin", "Rule"]

Rule = Literal[
    "missing-parameter",
    "unknown-parameter",
    "parameter-order",
    "parameter-kind",
    "default-mismatch",
    "annotation-mismatch",
    "var-args",
    "unknown-hook",
    "missing-hook",
    "spec-version",
    "constructor",
    "capabilities",
    "missing-method",
    "transport-class",
]


@dataclass(frozen=True)
class BackendOrigin:
    """Where a backend comes from: its name, distribution, version and entry point."""

    name: str
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None

    def describe(self) -> str:
        dist = f"{self.distribution} {self.version}" if self.distribution else "registered at runtime"
        where = f", entry point {self.entry_point}" if self.entry_point else ""
        return f"backend {self.name!r} ({dist}{where})"


@dataclass(frozen=True)
class Finding:
    """One way a backend differs from the spec, with both signatures and the fix."""

    backend: str
    distribution: str | None
    version: str | None
    entry_point: str | None
    hook: str
    rule: Rule
    message: str
    spec_signature: str
    impl_signature: str
    fix: str
    defined_in: str | None = None

    @property
    def where(self) -> str:
        """Whether the hook is new in the backend class or inherited, and from which parent."""
        return "this class" if self.defined_in is None else f"inherited from {self.defined_in}"

    def render(self) -> str:
        """Multi-line text for logs and the CLI."""
        origin = BackendOrigin(self.backend, self.distribution, self.version, self.entry_point)
        inherited = "" if self.defined_in is None else f" ({self.where})"
        return (
            f"[{self.rule}] {origin.describe()}, hook {self.hook}{inherited}: {self.message}\n"
            f"    spec: {self.spec_signature}\n"
            f"    impl: {self.impl_signature}\n"
            f"    fix:  {self.fix}"
        )

    def __str__(self) -> str:
        return self.render()
