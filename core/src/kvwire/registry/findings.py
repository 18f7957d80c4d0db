"""Validation findings: one drift of one backend from the spec, fully explained."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

__all__ = ["Finding", "BackendOrigin", "Rule", "render_findings"]

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

    @property
    def subject(self) -> str:
        """``backend 'x' (dist 1.0, entry point m:C), hook h`` (and where the hook is inherited from)."""
        origin = BackendOrigin(self.backend, self.distribution, self.version, self.entry_point)
        inherited = "" if self.defined_in is None else f" ({self.where})"
        return f"{origin.describe()}, hook {self.hook}{inherited}"

    def render(self) -> str:
        """Multi-line text for logs and the CLI."""
        return (
            f"[{self.rule}] {self.subject}: {self.message}\n"
            f"    spec: {self.spec_signature}\n"
            f"    impl: {self.impl_signature}\n"
            f"    fix:  {self.fix}"
        )

    def __str__(self) -> str:
        return self.render()


def render_findings(findings: Iterable[Finding]) -> str:
    """Findings as text, each pair of signatures printed once.

    Findings of one backend's hook that compare the same two signatures (a hook whose parameters
    are all keyword-only has one finding per parameter) are one block: the subject, ``spec:`` and
    ``impl:`` once, then each rule, message and fix. A finding alone reads as :meth:`Finding.render`.
    """
    groups: dict[tuple[str, str, str], list[Finding]] = {}
    for finding in findings:
        groups.setdefault((finding.subject, finding.spec_signature, finding.impl_signature), []).append(finding)
    blocks: list[str] = []
    for (subject, spec, impl), group in groups.items():
        if len(group) == 1:
            blocks.append(group[0].render())
            continue
        lines = [f"{subject}: {len(group)} findings", f"    spec: {spec}", f"    impl: {impl}"]
        for finding in group:
            lines += [f"    [{finding.rule}] {finding.message}", f"        fix:  {finding.fix}"]
        blocks.append("\n".join(lines))
    return "\n".join(blocks)
