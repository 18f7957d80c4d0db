"""Gather ``BackendConfig`` fields from a file, the environment and arguments, in one precedence.

Lowest first: each field's default < the file (the ``path`` argument, else
``$KVWIRE_CONFIG``) < ``KVWIRE_*`` environment variables < explicit arguments.
``options`` merge key by key in the same order. Every value is type-checked
where it is read, so an error names the key and the file (or variable, or argument).
This module knows only field names and defaults (it never imports ``kvwire.config``).
"""

from __future__ import annotations

import difflib
import importlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from kvwire.errors import ConfigError
from kvwire.files import UnreadableFile, read_regular_file

__all__ = ["CONFIG_ENV", "OPTIONS_ENV", "OPTION_PREFIX", "Gathered", "env_name", "gather", "option_value"]

log = logging.getLogger("kvwire")

CONFIG_ENV = "KVWIRE_CONFIG"
#: A config file larger than this is refused (settings are a few lines; a bigger file is a wrong path).
MAX_CONFIG_BYTES = 1 << 20
OPTIONS_ENV = "KVWIRE_OPTIONS"
OPTION_PREFIX = "KVWIRE_OPTION_"
#: ``KVWIRE_*`` variables read by other parts of kvwire: never a misspelt config variable.
OTHER_ENV = frozenset(
    {
        CONFIG_ENV,
        "KVWIRE_BACKENDS",
        "KVWIRE_POLICY",
        "KVWIRE_SGLANG_PYTHON",
        "KVWIRE_TEST_CACHE",
        "KVWIRE_SGLANG_UNSUPPORTED",
        "KVWIRE_SGLANG_BACKEND",
        "KVWIRE_VLLM_UNSUPPORTED",
        "KVWIRE_CONTROL_KEY",
    }
)
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})

Kind = Literal["str", "number", "bool", "mapping"]
PathArg = str | os.PathLike[str]


def env_name(field_name: str) -> str:
    """The environment variable of a field: ``timeout_s`` -> ``KVWIRE_TIMEOUT_S``."""
    return f"KVWIRE_{field_name.upper()}"


def _kind(default: object) -> Kind:
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, (int, float)):
        return "number"
    if isinstance(default, str):
        return "str"
    if isinstance(default, Mapping):
        return "mapping"
    raise TypeError(f"no source rule for a field defaulting to {type(default).__name__}")  # a new field's kind


_EXPECTED: dict[Kind, str] = {
    "str": "a string",
    "number": "a number (int or float)",
    "bool": "a boolean (true or false)",
    "mapping": "a table of backend options",
}


def _checked(kind: Kind, key: str, value: object, where: str) -> Any:
    if kind == "number" and isinstance(value, int) and not isinstance(value, bool):
        try:
            float(value)
        except OverflowError:  # 10**400: a float cannot hold it (no repr: it may be thousands of digits)
            raise ConfigError(
                f"{where}: {key} must be a finite number, got an int of {value.bit_length()} bits, past a float's range"
            ) from None
    ok = {
        "str": isinstance(value, str),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "mapping": isinstance(value, Mapping) and all(isinstance(k, str) and k for k in value),
    }[kind]
    if not ok:
        raise ConfigError(f"{where}: {key} must be {_EXPECTED[kind]}, got {type(value).__name__} {value!r:.200}")
    return dict(value) if kind == "mapping" else value  # type: ignore[call-overload]


def _hint(name: str, choices: Mapping[str, object] | frozenset[str]) -> str:
    close = difflib.get_close_matches(name, sorted(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


@dataclass
class Gathered:
    """The merged fields, and which source set each (``options.<key>`` for an option)."""

    values: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, str] = field(default_factory=dict)

    def set(self, key: str, value: object, where: str) -> None:
        if key == "options":
            assert isinstance(value, dict)
            merged = self.values.setdefault("options", {})
            for name, item in value.items():
                merged[name] = item
                self.sources[f"options.{name}"] = where
        else:
            self.values[key] = value
            self.sources[key] = where

    def explain(self, message: str) -> str:
        """``message`` (about ``BackendConfig.<field>``) with where that field was set."""
        named = [m for m in re.findall(r"BackendConfig\.(\w+)", message) if m in self.sources]
        return message if not named else f"{message} (set by {self.sources[named[0]]})"


def _toml(path: Path) -> Any:
    """``tomllib`` (Python 3.11+), else ``tomli`` if installed (a name, so mypy for 3.10 does not look for it)."""
    for name in ("tomllib", "tomli"):
        try:
            return importlib.import_module(name)
        except ImportError:
            pass
    raise ConfigError(f"config file {path}: reading TOML needs Python 3.11+ or `pip install tomli`; or use a JSON file")


def _read_file(path: Path, origin: str) -> dict[str, Any]:
    suffix = path.suffix.lower()
    if suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {path} ({origin}): unknown format {path.suffix!r}; use a .toml or .json file")
    try:
        text = read_regular_file(path, MAX_CONFIG_BYTES).decode("utf-8")
    except UnreadableFile as exc:
        raise ConfigError(f"config file {path} ({origin}) is not read: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"config file {path} ({origin}) cannot be read: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} ({origin}) is not UTF-8: {exc.reason} at byte {exc.start}") from None
    parser = _toml(path) if suffix == ".toml" else json
    try:
        data = parser.loads(text)
    except ValueError as exc:  # TOMLDecodeError and JSONDecodeError both are (and an int of 4,300+ digits)
        raise ConfigError(f"config file {path} is not valid {suffix[1:].upper()}: {exc}") from None
    except RecursionError:
        raise ConfigError(f"config file {path} is not {suffix[1:].upper()} kvwire reads: {_TOO_DEEP}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: the top level must be an object of settings, got {type(data).__name__}")
    return data


def _from_file(kinds: Mapping[str, Kind], path: Path, origin: str, out: Gathered) -> None:
    where = f"config file {path}"
    for key, value in _read_file(path, origin).items():
        if key not in kinds:
            raise ConfigError(
                f"{where}: unknown key {key!r}{_hint(key, kinds)}; known keys: {', '.join(sorted(kinds))} "
                "(backend-specific settings go in the [options] table)"
            )
        out.set(key, _checked(kinds[key], key, value, where), where)


def _env_value(kind: Kind, var: str, raw: str) -> object:
    if kind == "str":
        return raw
    if kind == "number":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"${var}={raw!r} is not a number; write e.g. {var}=5") from None
    if kind == "bool":
        word = raw.strip().lower()
        if word in _TRUE | _FALSE:
            return word in _TRUE
        raise ConfigError(f"${var}={raw!r} is not a boolean; write {var}=1 or {var}=0 (or true/false, yes/no, on/off)")
    try:
        value = _json(raw, f"${var}")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"${var} is not valid JSON ({exc}); write e.g. {var}='{{\"streams\": 2}}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"${var} must be a JSON object of options, got {type(value).__name__}: {raw!r:.200}")
    return value


_TOO_DEEP = "nested too deeply (arrays or tables inside each other past Python's recursion limit)"


def _json(raw: str, where: str) -> Any:
    """``json.loads(raw)``; JSONDecodeError as is, and ConfigError naming ``where`` for what else it raises:
    nesting past the recursion limit, an int of more digits than Python converts (4,300)."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise ConfigError(f"{where} is not JSON kvwire reads: {_TOO_DEEP}") from None
    except ValueError as exc:  # "Exceeds the limit (4300 digits) ...; use sys.set_int_max_str_digits()": not for them
        raise ConfigError(f"{where} is not JSON kvwire reads: {str(exc).split(';')[0]}") from None


def option_value(raw: str, where: str) -> object:
    """A backend option's value from text (a variable, ``--option KEY=VALUE``): JSON when ``raw`` is JSON
    (``2`` stays an int), else the string itself; text that looks like JSON but is not is an error naming ``where``."""
    try:
        return _json(raw, where)
    except json.JSONDecodeError as exc:
        if raw.lstrip()[:1] in ("{", "[", '"'):
            raise ConfigError(f"{where} looks like JSON but is not valid ({exc}); fix it, or quote a string") from None
        return raw


def _from_env(kinds: Mapping[str, Kind], env: Mapping[str, str], out: Gathered) -> None:
    by_var = {env_name(k): k for k in kinds}
    for var in sorted(by_var):
        raw = env.get(var, "")
        if raw != "":  # empty means unset, as for $KVWIRE_BACKENDS
            key = by_var[var]
            out.set(key, _checked(kinds[key], key, _env_value(kinds[key], var, raw), f"${var}"), f"${var}")
    for var in sorted(v for v in env if v.startswith(OPTION_PREFIX)):
        key = var[len(OPTION_PREFIX) :].lower()
        if not key:
            raise ConfigError(f"${var} names no option; write {OPTION_PREFIX}<KEY>=<JSON value>")
        out.set("options", {key: option_value(env[var], f"${var}")}, f"${var}")
    others = by_var.keys() | OTHER_ENV
    unread = (v for v in env if v.startswith("KVWIRE_") and v not in others and not v.startswith(OPTION_PREFIX))
    for var in sorted(unread):  # other KVWIRE_* variables belong to other tools; a near-miss is worth a word
        close = difflib.get_close_matches(var[7:], [v[7:] for v in by_var], n=1, cutoff=0.8)
        if close:
            log.warning("kvwire: $%s is not a kvwire setting and is ignored (did you mean $KVWIRE_%s?)", var, close[0])


def gather(
    defaults: Mapping[str, object],
    path: PathArg | None,
    env: Mapping[str, str],
    overrides: Mapping[str, object],
) -> Gathered:
    """Merge the sources over ``defaults`` (field name -> default); see the module docstring for the order."""
    kinds = {name: _kind(default) for name, default in defaults.items()}
    out = Gathered()
    for name, default in defaults.items():
        out.set(name, dict(default) if isinstance(default, Mapping) else default, "the default")
    origin = "path argument"
    if path is None and env.get(CONFIG_ENV, "").strip():
        path, origin = env[CONFIG_ENV].strip(), f"${CONFIG_ENV}"
    if path is not None:
        if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
            raise ConfigError(
                f"the config file's path ({origin}) must be a str or an os.PathLike of str, got "
                f"{type(path).__name__} {path!r:.100}"
            )
        _from_file(kinds, Path(path), origin, out)
    _from_env(kinds, env, out)
    for key, value in overrides.items():
        if key not in kinds:
            raise ConfigError(
                f"BackendConfig.from_sources: unknown argument {key}={value!r:.100}{_hint(key, kinds)}; "
                f"known: {', '.join(sorted(kinds))}"
            )
        if value is not None:  # None: not given (a CLI flag left out), so the lower sources stand
            out.set(key, _checked(kinds[key], key, value, "argument"), f"argument {key}=")
    return out
