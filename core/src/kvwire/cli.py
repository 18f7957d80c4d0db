"""The ``kvwire`` command: ``check`` validates installed backends; ``bench`` moves a KV cache."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from kvwire.errors import KvwireError
from kvwire.registry import BackendInfo, Registry

__all__ = ["main"]


def _check_table(infos: Sequence[BackendInfo]) -> str:
    headers = ("backend", "distribution", "version", "spec", "status", "capabilities")
    rows = [
        (
            i.name,
            i.distribution or "(runtime)",
            i.version or "-",
            i.spec_version or "-",
            i.status,
            ",".join(sorted(i.capabilities)) or "-",
        )
        for i in infos
    ]
    widths = [max(len(h), *(len(r[c]) for r in rows)) if rows else len(h) for c, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for info, row in zip(infos, rows):
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        notes = [info.runtime] if info.runtime and info.runtime != "available" else []
        if info.error and info.status != "drift":
            notes.append(info.error)
        for note in notes:
            lines.append(f"    {note}")
        for finding in info.findings:
            lines.extend("    " + line for line in finding.render().splitlines())
    return "\n".join(lines)


def _cmd_check(args: argparse.Namespace) -> int:
    logging.getLogger("kvwire").addHandler(logging.NullHandler())  # the report below says it all, once
    allow = [n.strip() for n in args.backends.split(",") if n.strip()] if args.backends else None
    registry = Registry(allow=allow, policy="quarantine")
    infos = registry.scan()
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
    else:
        print(_check_table(infos) if infos else "no kvwire backends installed")
    passing = ("ok",) if args.strict else ("ok", "adapted")
    failed = [i for i in infos if i.status != "blocked" and i.status not in passing]
    if not args.json:
        total = len([i for i in infos if i.status != "blocked"])
        print(f"\n{total - len(failed)}/{total} allowed backend(s) pass" + (" (--strict)" if args.strict else ""))
    return 1 if failed else 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwire", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate every installed backend against the hook spec")
    check.add_argument("--json", action="store_true", help="print a JSON list of backends")
    check.add_argument("--strict", action="store_true", help="fail on 'adapted' backends too")
    check.add_argument("--backends", default=None, help="comma-separated allow-list (default: $KVWIRE_BACKENDS)")
    check.set_defaults(func=_cmd_check)
    bench = sub.add_parser("bench", help="move a realistic KV cache between a prefill and a decode process")
    from kvwire.benchmark.run import add_arguments, run

    add_arguments(bench)
    bench.set_defaults(func=run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``kvwire`` console script."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except KvwireError as exc:  # bad arguments, a missing backend, a failed transfer: one line, no traceback
        print(f"kvwire {args.command}: error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    return code
