"""An override paired with the method it overrides, and the finding about them."""

from __future__ import annotations

from dataclasses import dataclass

from kvwire.lint.classes import ClassInfo
from kvwire.lint.findings import Caller, LintFinding, LintRule
from kvwire.lint.signature import Function, Signature

__all__ = ["Pair"]


@dataclass(frozen=True)
class Pair:
    """An override and the method it overrides (the nearest definition in the subclass's MRO)."""

    cls: ClassInfo
    base: ClassInfo
    function: Function
    base_function: Function
    sig: Signature
    base_sig: Signature

    @property
    def target(self) -> str:
        return f"{self.cls.name}.{self.sig.name}"

    def finding(
        self, rule: LintRule, param: str, message: str, fix: str, callers: tuple[Caller, ...] = ()
    ) -> LintFinding:
        return LintFinding(
            rule=rule,
            subclass=self.cls.name,
            method=self.sig.name,
            file=self.cls.module.display,
            line=self.function.lineno,
            base_class=self.base.name,
            base_file=self.base.module.display,
            base_line=self.base_function.lineno,
            parameter=param,
            message=message,
            base_signature=self.base_sig.text,
            override_signature=self.sig.text,
            fix=fix,
            callers=callers,
        )
