"""The ``kvwire`` command: validate backends, print the spec, lint a host's source, move a KV cache.

Exit status of every subcommand: 0 success, 1 a failed check (drift, findings,
an unverified transfer), 2 a usage or runtime error (one line, no traceback).
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import math
import os
import platform
import sys
import textwrap
from collections.abc import Sequence

from kvwire.config import resolve_config
from kvwire.errors import ConfigError, KvwireError
from kvwire.registry.findings import render_findings
from kvwire.registry.installed import VersionAction, install_problems, versions
from kvwire.registry.isolation import DEFAULT_TIMEOUT, check_isolated
from kvwire.registry.loading import BackendInfo
from kvwire.registry.manager import Registry, allow_list_error, installed_backends
from kvwire.stdout import take_stdout

__all__ = ["main"]

_SIGPIPE_EXIT = 128 + 13  # what a shell reports for a process ended by SIGPIPE
_INTERRUPTED_EXIT = 128 + 2  # and for one ended by SIGINT (Ctrl-C)


_WIDTH = 100  # the check table fits this many columns: long notes and capabilities wrap (findings do not)


def _wrapped(line: str, indent: str = "    ", *, long_words: bool = False) -> list[str]:
    """``line`` under ``indent``, wrapped at :data:`_WIDTH` with continuation lines indented 4 more
    (``long_words``: a word longer than a line is broken too, as a module path may be)."""
    own = line[: len(line) - len(line.lstrip())]
    return textwrap.wrap(
        line.lstrip(),
        width=_WIDTH,
        initial_indent=indent + own,
        subsequent_indent=indent + own + "    ",
        break_long_words=long_words,
        break_on_hyphens=False,
    ) or [indent + own]


def _unavailable(info: BackendInfo) -> str | None:
    """Why a backend that loads cannot transfer on this host (its ``availability()``), or None."""
    if info.runtime is None or info.runtime == "available":
        return None
    return info.runtime.removeprefix("unavailable: ")


def _available(info: BackendInfo) -> str:
    if info.runtime is None:
        return "-"  # not asked: the backend did not load
    return "no" if _unavailable(info) else "yes"


#: The widest the backend, distribution and version cells get (the rest of a row takes at most 46 columns).
_CELL = (22, 20, 8)


def _fit(text: str, width: int) -> str:
    """``text``, or its first ``width - 1`` characters and an ellipsis (the row's notes then give it in full)."""
    return text if len(text) <= width else text[: width - 1] + "\u2026"


def _check_table(infos: Sequence[BackendInfo], verbose: bool = False) -> str:
    headers = ("backend", "distribution", "version", "spec", "status", "submit", "available")
    rows = [
        (
            _fit(i.name, _CELL[0]),
            _fit(i.distribution or "(runtime)", _CELL[1]),
            _fit(i.version or "-", _CELL[2]),
            i.spec_version or "-",
            i.status,
            i.submission or "-",
            _available(i),
        )
        for i in infos
    ]
    widths = [max(len(h), *(len(r[c]) for r in rows)) if rows else len(h) for c, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    for info, row in zip(infos, rows):
        lines.append("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
        notes = [info.runtime] if _unavailable(info) else []
        cut = [
            (what, full)
            for what, full, cell in zip(
                ("backend", "distribution", "version"), (info.name, info.distribution or "", info.version or ""), row
            )
            if full and cell != full
        ]
        for what, full in cut:  # a cell cut to fit: in full below the row, wrapped
            lines.extend(_wrapped(f"{what}: {full}", long_words=True))
        if info.error and info.status != "drift":
            notes.append(info.error)
        if verbose and info.status not in ("blocked", "duplicate", "import-error", "timeout"):
            notes.append(f"capabilities: {', '.join(sorted(info.capabilities)) or 'none'}")
        for note in notes:
            lines.extend(_wrapped(note or ""))
        if info.findings:  # not wrapped: a signature or a fix is one line, to search for and to copy
            lines.extend("    " + line for line in render_findings(info.findings).splitlines())
    return "\n".join(lines)


def _cmd_check(args: argparse.Namespace) -> int:
    logging.getLogger("kvwire").addHandler(logging.NullHandler())  # the report below says it all, once
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise ConfigError(f"--timeout must be a finite number of seconds > 0, got {args.timeout:g}")
    allow = None
    if args.backends is not None:
        allow = [n.strip() for n in args.backends.split(",") if n.strip()]
        if not allow:
            raise ConfigError(
                f"--backends {args.backends!r} names no backend; give backend names separated by commas "
                f"(installed: {', '.join(installed_backends()) or 'none'}), or leave it out to check all of them"
            )
    resolve_config()  # the configuration every entry point reads: a bad value is this check's error too
    registry = Registry(allow=allow, policy="quarantine")
    unknown = registry.unknown_allowed()
    infos = check_isolated(registry, args.timeout)  # each backend in a child: a plugin cannot take the check down
    if allow is not None:  # --backends X: a report on X only, not a "blocked" row for every other one
        infos = [i for i in infos if i.status != "blocked"]
    if args.json:
        print(json.dumps([i.to_dict() for i in infos], indent=2))
    else:
        nothing = "no backend --backends names is installed" if allow is not None else "no kvwire backends installed"
        print(_check_table(infos, args.verbose) if infos else nothing)
    passing = ("ok",) if args.strict else ("ok", "adapted")
    failed = [i for i in infos if i.status != "blocked" and i.status not in passing]
    # --require-available: a backend that loads but whose availability() gives a reason cannot transfer here
    unavailable = [i for i in infos if args.require_available and i.status in passing and _unavailable(i)]
    if not args.json:
        total = len([i for i in infos if i.status != "blocked"]) + len(unknown)
        passed = total - len(failed) - len(unavailable) - len(unknown)
        flags = [f for f, on in (("--strict", args.strict), ("--require-available", args.require_available)) if on]
        print(f"\n{passed}/{total} allowed backend(s) pass" + (f" ({' '.join(flags)})" if flags else ""))
    for info in unavailable:
        where = f"{info.distribution} {info.version}" if info.distribution else "registered at runtime"
        print(
            f"kvwire check: error: backend {info.name!r} ({where}) loads but cannot transfer on this host "
            f"(--require-available): {_unavailable(info)}",
            file=sys.stderr,
        )
    if unknown:
        source = "--backends" if allow is not None else registry.allow_source
        print(f"kvwire check: error: {allow_list_error(source, unknown, installed_backends())}", file=sys.stderr)
    problems = install_problems()  # e.g. two Mooncake engine wheels that overwrite each other's files
    for problem in problems:
        print(f"kvwire check: error: {problem}", file=sys.stderr)
    return 1 if failed or unavailable or unknown or problems else 0


def _cmd_config(args: argparse.Namespace) -> int:
    resolved = resolve_config(args.file)
    if args.json:
        print(json.dumps(resolved.to_dict(), indent=2))
    else:
        print("\n".join(resolved.lines()))
    return 0


def _cmd_versions(args: argparse.Namespace) -> int:
    data = versions()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    known = data["spec_known"]
    lines = [
        f"kvwire {data['kvwire']}",
        f"backend spec {data['spec']} (loads backends of spec {known[0]} to {known[-1]})",
        f"python {platform.python_version()} ({sys.executable})",
    ]
    backends: dict[str, dict[str, str | None]] = data["backends"]
    if backends:
        width = max(map(len, backends))
        lines.append("installed backends (from metadata; none is imported, `kvwire check` validates them):")
        lines += [
            f"  {name.ljust(width)}  {b['distribution'] or '-'} {b['version'] or ''}".rstrip()
            for name, b in backends.items()
        ]
    else:
        lines.append("no kvwire backends installed")
    print("\n".join(lines))
    return 0


class _PlainHelp(argparse.HelpFormatter):
    """Help without reST markup: the descriptions and help strings come from docstrings (``x`` reads as x)."""

    def _format_text(self, text: str) -> str:
        return super()._format_text(_plain(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return _plain(super()._expand_help(action))


def _plain(text: str) -> str:
    return text.replace("``", "")


#: name -> (help, description, module with ``add_arguments(parser)`` and ``run(args) -> int``)
_SUBCOMMANDS: dict[str, tuple[str, str, str]] = {
    "spec": (
        "print the backend hook spec of a version, or what changed between two",
        "Print every hook's signature, the capabilities and the version history of the backend spec "
        "(--at for an older one, --diff OLD NEW for the changes, --json for tools). Exit status: 0, or 2 "
        "for an unknown version.",
        "kvwire.cli.spec_command",
    ),
    "bench": (
        "move a realistic KV cache between a prefill and a decode process",
        "The main job: allocate a model preset's KV pools on a prefill and a decode side (a local child, or "
        "--role decode on another machine), send fragmented requests through a backend, verify the target pages "
        "and their guard pages on the decode side, and print throughput, latency and the compared modes. Exit "
        "status: 0 verified, 1 a verification failed, 2 usage or transfer error.",
        "kvwire.benchmark.run",
    ),
    "lint": (
        "find overrides whose signature drifted from the method they override, in a source tree (ast only)",
        "Read a Python source tree with ast (nothing is imported) and report every override that does not accept "
        "a parameter of the method it overrides, and every keyword a call through self. in the base passes that "
        "an override lacks. Exit status: 0 no finding, 1 findings, 2 usage error.",
        "kvwire.lint.cli",
    ),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvwire", description=__doc__, formatter_class=_PlainHelp)
    parser.add_argument("--version", action=VersionAction)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser(
        "check",
        help="validate every installed backend against the hook spec",
        description="Import, validate and ask the availability of every installed (allowed) backend, each in an "
        "isolated child process with a time limit. Exit status: 0 every allowed backend is ok (or adapted, "
        "without --strict; and available, with --require-available), 1 one is not, or an allow-listed name is "
        "not installed, or two Mooncake engine wheels are installed; 2 usage error.",
        formatter_class=_PlainHelp,
    )
    check.add_argument("--json", action="store_true", help="print a JSON list of backends")
    check.add_argument("--strict", action="store_true", help="fail on 'adapted' backends too")
    check.add_argument(
        "--require-available",
        action="store_true",
        help="fail on a backend that loads but cannot transfer on this host (its availability() gives a reason)",
    )
    check.add_argument("--verbose", "-v", action="store_true", help="list each backend's capabilities")
    check.add_argument("--backends", default=None, help="comma-separated allow-list (default: $KVWIRE_BACKENDS)")
    check.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"time limit of each backend's import, validation and availability() (default: {DEFAULT_TIMEOUT:g})",
    )
    check.set_defaults(func=_cmd_check)
    config = sub.add_parser(
        "config",
        help="print the configuration kvwire resolves here, and where each value came from",
        description="The BackendConfig that kvwire.connect(), kvwire bench, the sglang plugin and the vLLM "
        "connector start from: the defaults, under the config file (--file, else $KVWIRE_CONFIG), under the "
        "KVWIRE_* variables (each host's own settings then go above these). Each value is shown with its source. "
        "Exit status: 0, or 2 for a bad value (the error names the variable or the file).",
        formatter_class=_PlainHelp,
    )
    config.add_argument("--file", default=None, metavar="PATH", help="a .toml or .json file (default: $KVWIRE_CONFIG)")
    config.add_argument("--json", action="store_true", help="print {config, sources} as JSON")
    config.set_defaults(func=_cmd_config)
    report = sub.add_parser(
        "versions",
        help="print kvwire's, the spec's, Python's and every installed backend's version",
        description="The long form of kvwire --version: the core, the backend spec and the spec versions it "
        "loads, the Python interpreter, and each installed backend's distribution and version, read from "
        "metadata (nothing is imported; kvwire check validates them). Exit status: 0.",
        formatter_class=_PlainHelp,
    )
    report.add_argument("--json", action="store_true", help="print JSON for tools")
    report.set_defaults(func=_cmd_versions)
    for name, (summary, description, module) in _SUBCOMMANDS.items():
        command = sub.add_parser(name, help=summary, description=description, formatter_class=_PlainHelp)
        handler = importlib.import_module(module)
        handler.add_arguments(command)
        command.set_defaults(func=handler.run)
    return parser


def console() -> int:
    """The ``kvwire`` command's process entry (console script, ``python -m kvwire``): :func:`main`, with what
    libraries write to fd 1 sent to stderr (:func:`kvwire.stdout.take_stdout`), so the command's own output
    (a ``--json`` document, a table) is all that reaches stdout."""
    out = sys.stdout
    line = 1 if out.line_buffering else -1  # a terminal's stdout stays line-buffered
    sys.stdout = open(take_stdout(), "w", buffering=line, encoding=out.encoding, errors=out.errors)  # noqa: SIM115
    return main()


def main(argv: Sequence[str] | None = None) -> int:
    """The ``kvwire`` command on ``argv`` (default: the process's arguments), in this process: tests and
    embedders call it; :func:`console` is the process entry."""
    args = _parser().parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()
    except KvwireError as exc:  # bad arguments, a missing backend, a failed transfer: one line, no traceback
        print(f"kvwire {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or a plugin imported in this process raising it: one line, no traceback
        print(f"kvwire {args.command}: interrupted", file=sys.stderr)
        return _INTERRUPTED_EXIT
    except BrokenPipeError:  # the reader left (`kvwire check --json | head -1`): stop quietly, as SIGPIPE would
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the interpreter's last flush has somewhere to go
        os.close(devnull)
        return _SIGPIPE_EXIT
    return code
