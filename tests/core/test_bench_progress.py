"""``kvwire bench``'s reporting without a backend: steps and progress, --option values, the tables, --plot."""

from __future__ import annotations

import argparse
import importlib.util
import io
import re
from pathlib import Path
from typing import Any

import pytest

import kvwire.benchmark.plot
from kvwire.benchmark.progress import Progress, Steps
from kvwire.benchmark.run import _print_table, add_arguments
from kvwire.errors import ConfigError


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_steps_are_timed_lines() -> None:
    clock, stream = _Clock(), _Stream(False)
    steps = Steps(stream, clock)
    steps("connecting")
    clock.now += 12.34
    steps("allocating")
    assert stream.getvalue() == "kvwire bench: [  0.0 s] connecting\nkvwire bench: [ 12.3 s] allocating\n"


def test_progress_off_a_terminal_is_a_plain_line_every_few_seconds_and_one_at_the_end() -> None:
    clock, stream = _Clock(), _Stream(False)
    progress = Progress(10, Steps(stream, clock), interval_s=3.0)
    for i in range(10):
        clock.now += 1.0
        progress.step("verified" if i < 7 else "MISMATCH")
    assert stream.getvalue().splitlines() == [
        "kvwire bench: [  3.0 s] 3/10 requests done (all verified so far)",
        "kvwire bench: [  6.0 s] 6/10 requests done (all verified so far)",
        "kvwire bench: [  9.0 s] 9/10 requests done (MISMATCH seen)",
        "kvwire bench: [ 10.0 s] 10/10 requests done (MISMATCH seen)",
    ]


def test_progress_on_a_terminal_is_a_bar_redrawn_in_place() -> None:
    stream = _Stream(True)
    progress = Progress(2, Steps(stream, _Clock()))
    progress.step("verified")
    progress.step("verified")
    assert stream.getvalue() == (f"\r  [{'#' * 15}{'.' * 15}] 1/2 verified   \r  [{'#' * 30}] 2/2 verified   \n")


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvwire bench")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_option_values_are_json_with_a_string_fallback() -> None:
    args = _parse(
        *("--option", "port=0", "--option", "name=abc", "--option", "flag=true", "--option", "ids=[1, 2]"),
        *("--option", 'text="7"', "--option", "ratio=0.5", "--option", "empty=", "--option", "url=a=b"),
    )
    options = dict(args.option)
    assert options == {
        "port": 0,
        "name": "abc",
        "flag": True,
        "ids": [1, 2],
        "text": "7",
        "ratio": 0.5,
        "empty": "",
        "url": "a=b",
    }
    assert type(options["port"]) is int


def test_an_option_without_a_value_names_the_argument(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--option", "port")
    assert "argument --option: expected KEY=VALUE, got 'port'" in capsys.readouterr().err


def test_the_help_says_option_values_are_json() -> None:
    parser = argparse.ArgumentParser(prog="kvwire bench")
    add_arguments(parser)
    text = re.sub(r"\s+", " ", parser.format_help())
    assert "VALUE is read as JSON (port=0 is the integer 0" in text
    assert "a VALUE that is not JSON (name=abc) is kept as the string" in text


def _inflight_result() -> dict[str, Any]:
    return {
        "backend": "mooncake",
        "preset": "qwen2.5-7b",
        "backing": "numpy",
        "decode": "local child",
        "requests": 4,
        "tokens": 512,
        "bytes": 1 << 30,
        "verified": True,
        "guards_unchanged": True,
        "gbps": 1.5,
        "p50_ms": 12.3,
        "p99_ms": 20.1,
        "sequential_p50_ms": 5.5,
        "sequential_p99_ms": 6.0,
        "descriptors_before": 64,
        "descriptors_after": 8,
        "inflight_requests": 2,
        "sequential_gbps": 1.0,
        "inflight_gbps": 1.5,
        "inflight_ratio": 1.5,
        "inflight_ratio_paired": 1.4,
        "inflight_wave_ratios": [1.4, 1.6],
        "submit_p50_us": 30.0,
        "submit_p99_us": 40.0,
        "notify_p50_us": 10.0,
        "notify_p99_us": 20.0,
        "sequential_notify_p50_us": 15.0,
        "sequential_notify_p99_us": 25.0,
        "prefill_tp": 1,
        "decode_tp": 1,
    }


def test_the_inflight_latency_row_has_its_figures(capsys: pytest.CaptureFixture[str]) -> None:
    _print_table(_inflight_result())
    out = capsys.readouterr().out
    assert "see below" not in out
    (row,) = [line for line in out.splitlines() if line.startswith("latency p50 / p99")]
    assert row.endswith("12.3 / 20.1 ms per request, 2 in flight (call to completion); 1 in flight: 5.5 / 6.0 ms"), row


def test_a_single_rank_latency_row_is_unchanged(capsys: pytest.CaptureFixture[str]) -> None:
    result = {k: v for k, v in _inflight_result().items() if "inflight" not in k and "sequential" not in k}
    _print_table({k: v for k, v in result.items() if not k.startswith(("submit", "notify"))})
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("latency p50 / p99")]
    assert row.endswith("  12.3 / 20.1 ms")


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    series = {
        "kvwire": [(1 << 20, 0.010), (1 << 20, 0.012), (1 << 20, 0.009)],
        "raw engine call": [(1 << 20, 0.011), (1 << 20, 0.013), (1 << 20, 0.010)],
    }
    kvwire.benchmark.plot.check_plot(str(path))
    kvwire.benchmark.plot.write_plot(str(path), series, "test")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 10_000


def test_plot_without_matplotlib_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    with pytest.raises(ConfigError, match=r"^--plot needs matplotlib, an optional extra: pip install 'kvwire\[plot\]'"):
        kvwire.benchmark.plot.check_plot(str(tmp_path / "bench.png"))


@pytest.mark.parametrize(
    ("name", "pattern"),
    [
        ("bench.jpg", r"^--plot '.*bench\.jpg': the file must end in \.png, \.svg, \.pdf$"),
        ("missing/bench.png", r"^--plot '.*missing/bench\.png': the folder '.*missing' does not exist$"),
    ],
)
def test_a_bad_plot_path_is_refused_before_the_run(tmp_path: Path, name: str, pattern: str) -> None:
    with pytest.raises(ConfigError, match=pattern):
        kvwire.benchmark.plot.check_plot(str(tmp_path / name))


def test_bench_checks_plot_before_starting(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from kvwire.cli import main

    assert main(["bench", "--backend", "mooncake", "--plot", str(tmp_path / "x.gif")]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("kvwire bench: error: --plot ")
    assert captured.err.count("\n") == 1  # refused before any set-up step


def test_inflight_result_has_per_request_latencies_of_both_phases() -> None:
    from kvwire.benchmark.inflight import _result, _Tally

    seq, inf = _Tally(), _Tally()
    seq.add(4 << 20, 0.040)
    inf.add(4 << 20, 0.020)
    seq.requests = [(1 << 20, s) for s in (0.010, 0.010, 0.010, 0.010)]
    inf.requests = [(1 << 20, s) for s in (0.005, 0.010, 0.015, 0.020)]
    args = argparse.Namespace(requests=4, tokens=512, inflight_requests=4)
    result = _result(args, {"sequential": seq, "inflight": inf})
    assert (result["p50_ms"], result["p99_ms"]) == (12.5, 19.8)
    assert (result["sequential_p50_ms"], result["sequential_p99_ms"]) == (10.0, 10.0)
    assert result["_series"] == {"1 in flight": seq.requests, "4 in flight": inf.requests}


def test_an_option_that_looks_like_json_but_is_not_is_refused_as_its_variable_is(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One rule for an option's text, on the command line as in KVWIRE_OPTION_<KEY>: no silent string fallback."""
    with pytest.raises(SystemExit):
        _parse("--option", "ids=[1, 2")
    assert "argument --option: --option ids=[1, 2 looks like JSON but is not valid" in capsys.readouterr().err


def test_the_table_names_both_ratios_of_kvwire_to_the_raw_call(capsys: pytest.CaptureFixture[str]) -> None:
    """The median of per-request ratios and the ratio of total throughputs differ on a noisy run: both, labelled."""
    result = {
        "backend": "mooncake", "preset": "p", "backing": "heap", "decode": "local child", "requests": 2,
        "tokens": 16, "bytes": 2**30, "verified": True, "guards_unchanged": True, "gbps": 0.73, "p50_ms": 1.0,
        "p99_ms": 2.0, "descriptors_before": 4, "descriptors_after": 1, "raw_gbps": 1.0, "ratio": 0.92,
        "ratio_of_totals": 0.73, "prefill_tp": 1, "decode_tp": 1,
    }  # fmt: skip
    _print_table(result)
    (row,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("raw engine call")]
    assert row.endswith(
        "1.000 GB/s   (kvwire/raw: 0.920 median of per-request ratios, 0.730 ratio of total throughputs)"
    )
