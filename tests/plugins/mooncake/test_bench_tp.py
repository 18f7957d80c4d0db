"""``kvwire bench --prefill-tp P --decode-tp D``: prefill and decode of different attention-TP sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import numpy as np
import pytest

from kvwire.benchmark.presets import get_preset
from kvwire.benchmark.tp import expected_digest
from kvwire.workload.memory import allocate, digest

pytestmark = pytest.mark.slow

# qwen2.5-7b: 28 layers x K and V, 16 tokens x 4 KV heads x 128 dims x 2 bytes per page; 512 tokens = 32 pages
QWEN_BYTES = 2 * 32 * 16384 * 28 * 2  # 2 requests, every head moved once


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvwire", "bench", "--backend", "mooncake", "--preset", "qwen2.5-7b", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)


def _json(*args: str) -> dict[str, Any]:
    proc = _bench("--requests", "2", "--tokens", "512", "--json", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1)])
def test_every_decode_rank_verified_with_the_same_tp_baseline(
    prefill_tp: int, decode_tp: int, head_major: bool
) -> None:
    order = ["--head-major"] if head_major else []
    r = _json("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), "--compare-same-tp", *order)
    assert (r["verified"], r["guards_unchanged"]) == (True, True)
    assert (r["prefill_tp"], r["decode_tp"], r["rank_pairs"], r["head_major"]) == (prefill_tp, decode_tp, 2, head_major)
    assert r["bytes"] == r["same_tp_bytes"] == QWEN_BYTES
    # token-major head slices move token by token: 32 pages x 16 tokens x 56 buffers, on each of the 2 rank pairs;
    # head-major ones one run per page
    tokens = 1 if head_major else 16
    assert r["descriptors_before"] == r["descriptors_after"] == 2 * 32 * tokens * 56
    assert r["same_tp_gbps"] > 0 and r["tp_ratio"] > 0
    assert r["decode"] == "local children"


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (4, 2)])
def test_landing_pages_scattered_by_each_decode_rank_are_verified(prefill_tp: int, decode_tp: int) -> None:
    """Real engines write whole pages into the decode ranks' landing pools; each scatters them into its KV pages."""
    r = _json("--prefill-tp", str(prefill_tp), "--decode-tp", str(decode_tp), "--compare-same-tp", "--landing")
    assert (r["verified"], r["guards_unchanged"], r["landing"]) == (True, True, True)
    assert r["bytes"] == r["same_tp_bytes"] == QWEN_BYTES
    # whole pages, coalesced like the same-TP baseline's (which moves them from one rank), on each rank pair
    pairs = prefill_tp
    assert r["rank_pairs"] == pairs
    assert r["descriptors_before"] == pairs * 32 * 56
    assert r["descriptors_after"] == pairs * r["same_tp_descriptors"]


def test_single_rank_json_records_tp_one() -> None:
    r = _json()
    assert (r["verified"], r["guards_unchanged"], r["bytes"]) == (True, True, QWEN_BYTES)
    assert (r["prefill_tp"], r["decode_tp"]) == (1, 1)
    assert "rank_pairs" not in r and "tp_ratio" not in r


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--preset", "deepseek-v3", "--decode-tp", "2"],
            "--decode-tp 2: preset 'deepseek-v3' is MLA (never head-sliced); TP sizes other than 1 are for MHA "
            "presets (llama3-8b, qwen2.5-7b)",
        ),
        (
            ["--decode-tp", "3"],
            "--decode-tp 3: preset 'qwen2.5-7b' has 4 KV heads; the TP size must divide them or be a multiple of them",
        ),
        (
            ["--prefill-tp", "2", "--decode-tp", "8", "--preset", "llama3-8b", "--peer", "127.0.0.1:1"],
            "--peer: a remote decode side is one rank; use --prefill-tp 1 --decode-tp 1 with --peer",
        ),
        (
            ["--compare-same-tp"],
            "--compare-same-tp is for different TP sizes: give --prefill-tp or --decode-tp other than 1",
        ),
        (["--head-major"], "--head-major is for different TP sizes: give --prefill-tp or --decode-tp other than 1"),
        (["--landing"], "--landing is for different TP sizes: give --prefill-tp or --decode-tp other than 1"),
        (
            ["--prefill-tp", "1", "--decode-tp", "2", "--landing"],
            "--landing is for token-major pages with prefill TP > decode TP (got --prefill-tp 1 --decode-tp 2): "
            "otherwise every decode page has one sender or its heads are one run already",
        ),
        (
            ["--prefill-tp", "2", "--decode-tp", "1", "--landing", "--head-major"],
            "--landing is for token-major pages with prefill TP > decode TP (got --prefill-tp 2 --decode-tp 1 "
            "--head-major): otherwise every decode page has one sender or its heads are one run already",
        ),
    ],
)
def test_a_bad_combination_is_one_line(args: list[str], message: str) -> None:
    proc = _bench(*args)
    assert (proc.returncode, proc.stderr, proc.stdout) == (2, f"kvwire bench: error: {message}\n", "")


@pytest.mark.parametrize("head_major", [False, True])
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 2)])
def test_expected_digest_matches_a_per_head_oracle(prefill_tp: int, decode_tp: int, head_major: bool) -> None:
    """The prefill side's expected digest against a per-token, per-head copy (qwen: 4 KV heads, replicated at 8)."""
    preset = get_preset("qwen2.5-7b")
    tokens, head_bytes, total = preset.page_tokens, preset.head_dim * preset.dtype_bytes, preset.kv_heads
    entries = preset.entries(decode_side=False)[:4]
    pools = []
    for p in range(prefill_tp):
        pool = allocate(entries, 8, preset.heads(prefill_tp).page_bytes)
        pool.fill_random(p)
        pools.append(pool)
    src = np.array([5, 1, 2], np.int64)
    for d in range(decode_tp):
        d_heads = preset.heads(decode_tp).kv_heads
        views = []
        for i in range(len(entries)):
            out = np.zeros(
                (len(src), d_heads, tokens, head_bytes) if head_major else (len(src), tokens, d_heads, head_bytes),
                np.uint8,
            )
            for h in range(d_heads):
                g = d * total // decode_tp + h if total >= decode_tp else d // (decode_tp // total)
                # the decode rank's lowest-ranked sender holding head g
                first = d * prefill_tp // decode_tp
                senders = range(first, first + max(1, prefill_tp // decode_tp))
                p_heads = preset.heads(prefill_tp).kv_heads
                holders = [
                    p
                    for p in senders
                    if (
                        p * p_heads <= g < (p + 1) * p_heads if total >= prefill_tp else p // (prefill_tp // total) == g
                    )
                ]
                p = holders[0]
                local = g - p * p_heads if total >= prefill_tp else 0
                for j, page in enumerate(src):
                    for t in range(tokens):
                        if head_major:  # (heads, tokens, head bytes)
                            out[j, h, t] = pools[p].views[i][page].reshape(p_heads, tokens, head_bytes)[local, t]
                        else:
                            out[j, t, h] = pools[p].views[i][page].reshape(tokens, p_heads, head_bytes)[t, local]
            views.append(out.reshape(len(src), -1))
        assert expected_digest(preset, pools, decode_tp, d, src, head_major) == digest(views), f"decode rank {d}"
