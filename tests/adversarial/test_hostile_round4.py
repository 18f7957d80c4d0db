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


# -- row 11: bench --plot -------------------------------------------------------------------------------------


def test_row11_a_dangling_symlink_for_plot_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the whole run happened, then exit 2 with nothing on stdout."""
    from kvwire.benchmark.plot import check_plot
    from kvwire.cli import main

    link = tmp_path / "bench.png"
    target = tmp_path / "gone" / "bench.png"
    link.symlink_to(target)
    dangling = f"--plot {str(link)!r}: a symbolic link to {str(target)!r}, which does not exist"
    with pytest.raises(ConfigError) as exc:
        check_plot(str(link))
    assert str(exc.value) == dangling
    folder = tmp_path / "folder.png"
    folder.mkdir()
    with pytest.raises(ConfigError) as exc:
        check_plot(str(folder))
    assert str(exc.value) == f"--plot {str(folder)!r} is a folder; name the file to write"
    assert main(["bench", "--backend", "mooncake", "--plot", str(link), "--json"]) == 2
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", f"kvwire bench: error: {dangling}\n")  # before any set-up step


def test_row11_the_json_result_is_printed_when_the_plot_fails_at_the_end(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: write_plot's ConfigError escaped before the result was printed: the run's result was lost."""
    import argparse
    import json

    pytest.importorskip("matplotlib")
    from kvwire.benchmark.run import _report
    from kvwire.config import resolve_config

    plot = tmp_path / "gone" / "bench.png"  # its folder was removed during the run
    args = argparse.Namespace(
        backend="local", preset="tiny", requests=2, tokens=64, prefill_tp=1, decode_tp=1, plot=str(plot), json=True,
        resolved=resolve_config(env={}),
    )  # fmt: skip
    result = {"verified": True, "guards_unchanged": True, "_series": {"kvwire": [(1 << 20, 0.01), (1 << 20, 0.01)]}}
    with pytest.raises(ConfigError) as exc:
        _report(args, result, "heap", "local child", lambda *_: None)  # type: ignore[arg-type]
    assert str(exc.value).startswith(f"--plot {str(plot)!r} could not be written: ")
    printed = json.loads(capsys.readouterr().out)
    assert printed["verified"] is True and printed["plot_error"] == str(exc.value)
