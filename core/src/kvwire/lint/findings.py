"""Lint findings: one override that has drifted from the method it overrides, with both signatures and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["RULES", "Caller", "LintFinding", "LintRule"]

LintRule = Literal["override-missing-parameter", "override-required-parameter", "override-missing-keyword"]

#: Every rule id, in the order findings of one override are listed.
RULES: tuple[LintRule, ...] = ("override-missing-parameter", "override-required-parameter", "override-missing-keyword")


@dataclass(frozen=True)
class Caller:
    """A call ``self.<method>(...)`` in a base class: the calling method and where the call is."""

    caller: str
    file: str
    line: int


@dataclass(frozen=True)
class LintFinding:
    """One way ``subclass.method`` fails the callers of ``base_class.method``."""

    rule: LintRule
    subclass: str
    method: str
    file: str
    line: int
    base_class: str
    base_file: str
    base_line: int
    parameter: str
    message: str
    base_signature: str
    override_signature: str
    fix: str
    callers: tuple[Caller, ...] = ()

    def render(self) -> str:
        """Multi-line text for the CLI."""
        return (
            f"[{self.rule}] {self.subclass}.{self.method} at {self.file}:{self.line} overriding "
            f"{self.base_class}.{self.method} at {self.base_file}:{self.base_line}: {self.message}\n"
            f"    base:     {self.base_signature}\n"
            f"    override: {self.override_signature}\n"
            f"    fix:      {self.fix}"
        )

    def to_dict(self) -> dict[str, Any]:
        """Every field, always (``callers`` is an empty list for the signature rules)."""
        fields = {name: getattr(self, name) for name in self.__dataclass_fields__ if name != "callers"}
        fields["callers"] = [{"caller": c.caller, "file": c.file, "line": c.line} for c in self.callers]
        return fields

    def __str__(self) -> str:
        return self.render()
