"""``bench/vllm_connector.py``: its statistics and arguments (fast), and one tiny alternating run (slow, in
``.venv-vllm``). The bench measures; nothing here checks a timing."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "vllm_connector.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_vllm_connector", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_percentiles_interpolate_between_ranks_as_numpy_does() -> None:
    bench = _bench()
    values = [float(v) for v in range(1, 11)]  # numpy.percentile(1..10, [10, 50, 90]) = 1.9, 5.5, 9.1
    assert bench.percentile(values, 0.1) == pytest.approx(1.9)
    assert bench.percentile(values, 0.5) == pytest.approx(5.5)
    assert bench.percentile(values, 0.9) == pytest.approx(9.1)
    assert math.isnan(bench.percentile([], 0.5))
    assert bench.summarize([3.0]) == {"median": 3.0, "p10": 3.0, "p90": 3.0, "min": 3.0, "max": 3.0}


def test_each_node_holds_two_prompts_at_once() -> None:
    bench = _bench()
    assert bench.blocks_for(1024) == 2 * 32 + 16 + 16
    assert bench.blocks_for(8192) >= 2 * 256


@pytest.mark.parametrize("argv", [["--tokens", "1k"], ["--tokens", "16"], ["--connectors", "x"], ["--requests", "0"]])
def test_bad_arguments_are_refused_before_any_node_starts(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        _bench().main([*argv, "--python", sys.executable])
    assert stopped.value.code == 2


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_tiny_run_alternates_both_connectors_on_the_same_verified_blocks(vllm_python: Path) -> None:
    command = [sys.executable, str(SCRIPT), "--python", str(vllm_python), "--json", "--requests", "2"]
    command += ["--warmup", "1", "--tokens", "64,128", "--layers", "2", "--heads", "2", "--head-size", "64"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=850, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout)["results"]
    assert [r["tokens"] for r in results] == [64, 128]
    for result in results:
        assert result["same_blocks"] is True
        rows = {row["name"]: row for row in result["rows"]}
        assert set(rows) == {"kvwire-nixl", "vllm-nixl"}
        for row in rows.values():
            assert row["verified"] is True and row["n"] == 2 and len(row["times_ms"]) == 2
            assert row["p10"] <= row["median"] <= row["p90"]
            assert row["ratio_of_medians"] is not None and row["median_paired_ratio"] is not None
        assert rows["vllm-nixl"]["ratio_of_medians"] == pytest.approx(1.0)
