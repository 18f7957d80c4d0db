"""Hostile input, round 4 (issue 37): the vLLM side channel, landing credits, configuration sources.

Each test names the row of the issue it closes and fails on the code before the fix.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvwire import BackendConfig, ConfigError

# -- row 10: configuration sources ---------------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000
TOO_DEEP = "nested too deeply (arrays or tables inside each other past Python's recursion limit)"


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"KVWIRE_OPTIONS": '{"a": ' + DEEP + "}"}, f"$KVWIRE_OPTIONS is not JSON kvwire reads: {TOO_DEEP}"),
        ({"KVWIRE_OPTION_X": DEEP}, f"$KVWIRE_OPTION_X is not JSON kvwire reads: {TOO_DEEP}"),
        (
            {"KVWIRE_OPTION_X": "1" * 5000},
            "$KVWIRE_OPTION_X is not JSON kvwire reads: Exceeds the limit (4300 digits) for integer string "
            "conversion: value has 5000 digits",
        ),
    ],
    ids=["options-deep", "option-deep", "option-5000-digits"],
)
def test_row10_a_variable_kvwire_cannot_read_is_a_config_error_naming_it(env: dict[str, str], message: str) -> None:
    """Before: RecursionError, ValueError tracebacks."""
    with pytest.raises(ConfigError) as exc:
        BackendConfig.from_sources(env=env)
    assert str(exc.value) == message


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("a.json", '{"options": {"a": ' + DEEP + "}}", f"is not JSON kvwire reads: {TOO_DEEP}"),
        ("a.toml", "[options]\nx = " + DEEP + "\n", f"is not TOML kvwire reads: {TOO_DEEP}"),
        ("a.toml", "x = " + DEEP + "\n", f"is not TOML kvwire reads: {TOO_DEEP}"),
        ("a.json", '{"timeout_s": 1' + "0" * 400 + "}", ": timeout_s must be a finite number, got an int of 1329 bits, "
         "past a float's range"),
        ("a.toml", "timeout_s = 1" + "0" * 400 + "\n", ": timeout_s must be a finite number, got an int of 1329 bits, "
         "past a float's range"),
    ],
    ids=["json-deep", "toml-deep-option", "toml-deep", "json-10**400", "toml-10**400"],
)  # fmt: skip
def test_row10_a_config_file_kvwire_cannot_read_is_a_config_error_naming_it(
    tmp_path: Path, name: str, text: str, message: str
) -> None:
    """Before: RecursionError, OverflowError tracebacks."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as exc:
        BackendConfig.from_sources(path, env={})
    assert str(exc.value) == f"config file {path}{'' if message.startswith(':') else ' '}{message}"
    with pytest.raises(ConfigError) as exc:  # named by the variable
        BackendConfig.from_sources(env={"KVWIRE_CONFIG": str(path)})
    assert str(exc.value).startswith(f"config file {path}")


def test_row10_a_bytes_path_is_a_config_error() -> None:
    """Before: TypeError from pathlib."""
    with pytest.raises(ConfigError) as exc:
        BackendConfig.from_sources(os.fsencode("/tmp/kvwire.toml"), env={})  # type: ignore[arg-type]
    assert str(exc.value) == (
        "the config file's path (path argument) must be a str or an os.PathLike of str, got bytes b'/tmp/kvwire.toml'"
    )
