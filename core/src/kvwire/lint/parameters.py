"""``override-missing-parameter`` and ``override-required-parameter``: the override's signature against its base's.

A parameter of the base must be accepted the same way: by name, and by
position where the base takes it by position (``*args``/``**kwargs`` accept any
positional/keyword); a default of the base must stay a default; and the
override must not require a parameter the base does not have (unless the
base's ``*args``/``**kwargs`` could pass it).
"""

from __future__ import annotations

from collections.abc import Iterator

from kvwire.lint.findings import LintFinding
from kvwire.lint.pair import Pair
from kvwire.lint.signature import Kind, Param, Signature

__all__ = ["signature_findings"]


def _after(sig: Signature, index: int) -> str:
    if index:
        return f", after `{sig.positional[index - 1].name}`"
    return f", after `{sig.params[0].name}`" if sig.implicit else ", as its first parameter"


def signature_findings(pair: Pair) -> Iterator[LintFinding]:
    """The findings of the two signature rules, parameters in the base's order, then the override's extra ones."""
    sig, base_sig = pair.sig, pair.base_sig
    slots = sig.positional
    for index, bp in enumerate(base_sig.positional):
        slot = slots[index] if index < len(slots) else None
        yield from _positional(pair, index, bp, slot)
    for bp in base_sig.explicit:
        if bp.kind != "keyword-only":
            continue
        param = sig.named(bp.name)
        if param is not None and param.by_keyword:
            yield from _default(pair, bp, param)
        elif not sig.has("**kwargs"):
            where = "positional-only in the override" if param is not None else "missing"
            fix = (
                f"move `{bp.name}` after the `/` in"
                if param is not None
                else f"add keyword-only `{bp.declaration()}` to"
            )
            yield pair.finding(
                "override-missing-parameter",
                bp.name,
                f"keyword-only parameter `{bp.name}` of the base is {where} (a caller passing it gets a TypeError)",
                f"{fix} {pair.target}",
            )
    yield from _extra_required(pair)


def _positional(pair: Pair, index: int, bp: Param, slot: Param | None) -> Iterator[LintFinding]:
    sig, target = pair.sig, pair.target
    if bp.kind == "positional-only":
        if slot is None and not sig.has("*args"):
            yield pair.finding(
                "override-missing-parameter",
                bp.name,
                f"positional-only parameter `{bp.name}` (argument {index + 1}) of the base has no place in the "
                "override (a caller passing it gets a TypeError)",
                f"add `{bp.declaration()}` to {target}{_after(pair.base_sig, index)}",
            )
        elif slot is not None:
            yield from _default(pair, bp, slot)
        return
    named = sig.named(bp.name)
    if named is not None and named.kind == "positional-only":
        yield pair.finding(
            "override-missing-parameter",
            bp.name,
            f"parameter `{bp.name}` is positional-only in the override "
            f"(a caller passing `{bp.name}=` gets a TypeError)",
            f"move `{bp.name}` after the `/` in {target}",
        )
        return
    if named is None and not sig.has("**kwargs"):
        instead = f"; the override has `{slot.name}` in its place" if slot is not None else ""
        fix = (
            f"rename `{slot.name}` to `{bp.name}` in {target}"
            if slot is not None
            else (f"add `{bp.declaration()}` to {target}{_after(pair.base_sig, index)}")
        )
        yield pair.finding(
            "override-missing-parameter",
            bp.name,
            f"parameter `{bp.name}` of the base is missing{instead} (a caller passing `{bp.name}=` gets a TypeError)",
            fix,
        )
        return
    if named is None and slot is None and sig.has("*args"):
        return  # `*args` takes it by position, `**kwargs` by keyword
    if slot is None or slot is not named:
        yield _misplaced(pair, index, bp, named, slot)
    if named is not None:
        yield from _default(pair, bp, named)


def _misplaced(pair: Pair, index: int, bp: Param, named: Param | None, slot: Param | None) -> LintFinding:
    """A parameter the override accepts by keyword, where a positional caller's value does not reach it."""
    sig, target = pair.sig, pair.target
    if named is None:
        where = f"taken only through `**{_star(sig, '**kwargs')}` in the override"
    elif named.kind == "keyword-only":
        where = "keyword-only in the override"
    else:
        where = f"argument {sig.positional.index(named) + 1} of the override"
    if slot is not None:
        lands = f"sets `{slot.name}` instead"
    elif sig.has("*args"):
        lands = f"goes into `*{_star(sig, '*args')}`"
    else:
        lands = "gets a TypeError"
    if named is not None and named.positional:
        fix = f"order the parameters of {target} as the base's: ({', '.join(p.name for p in pair.base_sig.positional)})"
    else:
        fix = f"declare `{bp.declaration()}` in {target}{_after(pair.base_sig, index)}, before any `*`"
    return pair.finding(
        "override-missing-parameter",
        bp.name,
        f"parameter `{bp.name}` is argument {index + 1} of the base but {where} "
        f"(a caller passing it as argument {index + 1} {lands})",
        fix,
    )


def _star(sig: Signature, kind: Kind) -> str:
    return next(p.name for p in sig.params if p.kind == kind)


def _default(pair: Pair, bp: Param, param: Param) -> Iterator[LintFinding]:
    if bp.has_default and not param.has_default:
        fixed = Param(param.name, param.kind, param.annotation, bp.default).declaration()
        yield pair.finding(
            "override-required-parameter",
            bp.name,
            f"parameter `{bp.name}` has a default in the base but none in the override "
            "(a caller leaving it out gets a TypeError)",
            f"give it the base's default in {pair.target}: `{fixed}`",
        )


def _extra_required(pair: Pair) -> Iterator[LintFinding]:
    sig, base_sig = pair.sig, pair.base_sig
    known = {p.name for p in base_sig.explicit}
    for index, param in enumerate(sig.positional):
        covered = index < len(base_sig.positional) or base_sig.has("*args") or base_sig.has("**kwargs")
        if not param.has_default and param.name not in known and not covered:
            yield _required_extra(pair, param)
    for param in sig.explicit:
        required = param.kind == "keyword-only" and not param.has_default and param.name not in known
        if required and not base_sig.has("**kwargs"):
            yield _required_extra(pair, param)


def _required_extra(pair: Pair, param: Param) -> LintFinding:
    return pair.finding(
        "override-required-parameter",
        param.name,
        f"parameter `{param.name}` is required by the override but is not a parameter of the base "
        "(a caller following the base does not pass it: TypeError)",
        f"give `{param.name}` a default in {pair.target}, or add it to {pair.base.name}.{pair.sig.name}",
    )
