"""``kvwire lint PATH [--json] [--select METHOD[,METHOD]]``: exit 0 without findings, 1 with, 2 on usage errors."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from kvwire.errors import ConfigError
from kvwire.lint import lint_tree

__all__ = ["add_arguments", "main", "run"]


def _methods(text: str) -> frozenset[str]:
    names = frozenset(n.strip() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("expected one or more method names, comma-separated")
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a directory of Python source (or one .py file); read, never imported")
    parser.add_argument("--json", action="store_true", help="print a JSON list of findings")
    parser.add_argument(
        "--select", type=_methods, default=None, metavar="METHOD[,METHOD]", help="only check these method names"
    )


def _warn(message: str) -> None:
    print(f"kvwire lint: warning: {message}", file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """Lint ``args.path``; print the findings (text or ``--json``); return the exit code."""
    try:
        findings = lint_tree(args.path, args.select, warn=_warn)
    except ConfigError as exc:
        print(f"kvwire lint: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([f.to_dict() for f in findings], indent=2))
    elif findings:
        for finding in findings:
            print(finding.render(), end="\n\n")
        overrides = len({(f.file, f.line) for f in findings})
        print(f"{len(findings)} finding(s) in {overrides} override(s)")
    else:
        print("no override drift found")
    sys.stdout.flush()
    return 1 if findings else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kvwire.lint``: the same as ``kvwire lint``."""
    parser = argparse.ArgumentParser(prog="kvwire lint", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))
