"""kvwire-nixl pieces that need no NIXL: endpoint format, options, memory kinds, errors, tables, logging."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from standins import run_now

import kvwire
from kvwire_nixl import locate
from kvwire_nixl.backend import NixlBackend
from kvwire_nixl.endpoint import (
    MAX_ENDPOINT_CHARS,
    PeerInfo,
    Region,
    decode_endpoint,
    encode_endpoint,
    metadata_agent,
)
from kvwire_nixl.errors import translate
from kvwire_nixl.feed import DONE, PROC, Group, Write, chunks_of, feed
from kvwire_nixl.memory import segment_of
from kvwire_nixl.options import NixlOptions
from kvwire_nixl.quiet import Quiet, install_filter
from kvwire_nixl.xfer import RegionIndex, groups_of

REGIONS = (Region(0x10000, 0x1000, "DRAM", 0), Region(0x20000, 0x2000, "DRAM", 0))


# -- endpoint -------------------------------------------------------------------


def test_endpoint_round_trip_is_versioned_json_in_base64() -> None:
    endpoint = encode_endpoint("kvwire-h-1-0-ab", b"\x00md\xff" * 100, REGIONS)
    assert endpoint.startswith("nixl:1:kvwire-h-1-0-ab:")
    assert decode_endpoint(endpoint) == PeerInfo("kvwire-h-1-0-ab", b"\x00md\xff" * 100, REGIONS)


def _forge(payload: object, name: str = "a") -> str:
    blob = base64.urlsafe_b64encode(json.dumps(payload).encode()).decode().rstrip("=")
    return f"nixl:1:{name}:{blob}"


GOOD = {
    "agent": "a",
    "metadata": "bWQ",  # b"md"
    "sha256": hashlib.sha256(b"md").hexdigest(),
    "regions": [[4096, 4096, "DRAM", 0]],
}


@pytest.mark.parametrize(
    ("endpoint", "message"),
    [
        (42, "expected a str"),
        ("127.0.0.1:17000", "does not start with"),
        ("nixl:2:a:xx", "version '2' is not supported"),
        ("nixl:1:bad name:xx", "agent name must match"),
        ("nixl:1:a:%%%", "not base64url|not JSON"),
        (_forge([1, 2]), "exactly the keys"),
        (_forge({**GOOD, "extra": 1}), "exactly the keys"),
        (_forge({**GOOD, "sha256": "00"}), "does not match its SHA-256"),
        (_forge({**GOOD, "agent": "b"}), "names agent 'b'"),
        (_forge({**GOOD, "metadata": ""}), "'metadata' must be"),
        (_forge({**GOOD, "regions": [[0, 1, "DRAM", 0]]}), r"regions\[0\] base"),
        (_forge({**GOOD, "regions": [[4096, 2**63, "DRAM", 0]]}), r"regions\[0\] nbytes"),
        (_forge({**GOOD, "regions": [[4096, 1, "HBM", 0]]}), r"regions\[0\] segment"),
        (_forge({**GOOD, "regions": [[4096, 1, "DRAM", True]]}), r"regions\[0\] device"),
        (_forge({**GOOD, "regions": [4096]}), r"regions\[0\] must be"),
        ("nixl:1:a:" + "A" * MAX_ENDPOINT_CHARS, "over the limit"),
    ],
)
def test_malformed_endpoints_are_refused_naming_the_problem(endpoint: object, message: str) -> None:
    with pytest.raises(kvwire.InvalidTransferError, match=message):
        decode_endpoint(endpoint)


# -- options ----------------------------------------------------------------------


def test_options_defaults_strings_and_errors() -> None:
    auto = max(1, min(2, len(os.sched_getaffinity(0))))
    assert NixlOptions.from_config(kvwire.BackendConfig()) == NixlOptions("kvwire", 2.0, 0, auto)
    strings = {"progress": "nixl", "progress_interval_ms": "0.5", "num_threads": "2", "streams": "3"}
    assert NixlOptions.from_config(kvwire.BackendConfig(options=strings)) == NixlOptions("nixl", 0.5, 2, 3)
    assert NixlOptions.from_config(kvwire.BackendConfig(options={"streams": "auto"})).streams == auto
    assert NixlOptions.from_config(kvwire.BackendConfig(options={"streams": 1})).streams == 1
    bad: list[tuple[dict[str, object], str]] = [
        ({"progres": "nixl"}, "did you mean 'progress'"),
        ({"progress": "spin"}, "must be one of"),
        ({"progress_interval_ms": "fast"}, "must be a number"),
        ({"progress_interval_ms": True}, "must be a number"),
        ({"progress_interval_ms": 0}, r"must be in \[0.1, 1000.0\]"),
        ({"num_threads": -1}, r"must be an int in \[0, 64\]"),
        ({"num_threads": 2.5}, r"must be an int in \[0, 64\]"),
        ({"streams": 0}, r"BackendConfig.options\['streams'\] must be 'auto' or an int in \[1, 64\]"),
        ({"streams": 65}, r"\['streams'\] must be 'auto' or an int in \[1, 64\], got 65"),
        ({"streams": "two"}, r"\['streams'\] must be 'auto' or an int"),
        ({"streams": True}, r"\['streams'\] must be 'auto' or an int"),
        ({"stream": 2}, "did you mean 'streams'"),
    ]
    for options, message in bad:
        with pytest.raises(kvwire.ConfigError, match=message):
            NixlOptions.from_config(kvwire.BackendConfig(options=options))


# -- memory kinds -------------------------------------------------------------------


def test_segment_comes_from_the_memory_itself() -> None:
    device = {2: 2, 9: 3}  # CU_POINTER_ATTRIBUTE_MEMORY_TYPE -> DEVICE, DEVICE_ORDINAL -> 3
    assert segment_of(0x1000, lambda attr, _: device[attr]) == ("VRAM", 3)
    assert segment_of(0x1000, lambda attr, _: 1) == ("DRAM", 0)  # CU_MEMORYTYPE_HOST (pinned host memory)
    assert segment_of(0x1000, lambda attr, _: None) == ("DRAM", 0)  # unknown to the driver
    buf = np.zeros(64, np.uint8)
    assert segment_of(buf.ctypes.data) == ("DRAM", 0)  # here: no CUDA driver, or host memory


# -- descriptor tables ------------------------------------------------------------------


def _plan(src: list[int], dst: list[int], length: list[int]) -> kvwire.TransferPlan:
    arrays = [np.array(a, np.int64) for a in (src, dst, length)]
    return kvwire.TransferPlan(arrays[0], arrays[1], arrays[2], len(src))


def test_a_plan_over_one_segment_is_one_nx3_table_pair() -> None:
    plan = _plan([0x10000, 0x20100], [0x50000, 0x50800], [256, 512])
    (group,) = groups_of(plan, RegionIndex.of(REGIONS), RegionIndex.of((Region(0x50000, 0x1000, "DRAM", 0),)))
    assert (group.local_segment, group.remote_segment) == ("DRAM", "DRAM")
    assert group.local.dtype == np.int64 and group.local.flags.c_contiguous
    assert group.local.tolist() == [[0x10000, 256, 0], [0x20100, 512, 0]]
    assert group.remote.tolist() == [[0x50000, 256, 0], [0x50800, 512, 0]]


def test_mixed_segments_split_into_one_group_per_pair() -> None:
    local = RegionIndex.of((Region(0x10000, 0x1000, "DRAM", 0), Region(0x20000, 0x1000, "VRAM", 1)))
    remote = RegionIndex.of((Region(0x50000, 0x1000, "VRAM", 2), Region(0x60000, 0x1000, "DRAM", 0)))
    plan = _plan([0x10000, 0x20000, 0x10100, 0x20100], [0x50000, 0x50100, 0x60000, 0x60100], [16, 32, 48, 64])
    groups = groups_of(plan, local, remote)
    seen = {(g.local_segment, g.remote_segment): (g.local.tolist(), g.remote.tolist()) for g in groups}
    assert seen == {
        ("DRAM", "VRAM"): ([[0x10000, 16, 0]], [[0x50000, 16, 2]]),
        ("VRAM", "VRAM"): ([[0x20000, 32, 1]], [[0x50100, 32, 2]]),
        ("DRAM", "DRAM"): ([[0x10100, 48, 0]], [[0x60000, 48, 0]]),
        ("VRAM", "DRAM"): ([[0x20100, 64, 1]], [[0x60100, 64, 0]]),
    }


# -- errors -------------------------------------------------------------------------------


def _nixl_error(name: str) -> Exception:
    cls: type[Exception] = type(name, (Exception,), {})
    return cls("NIXL_ERR")


def test_nixl_errors_map_onto_kvwire_errors() -> None:
    gone = translate(_nixl_error("nixlRemoteDisconnectError"), "posting", "peer", posted=True)
    assert isinstance(gone, kvwire.PeerUnreachableError) and gone.peer == "peer"
    before = translate(_nixl_error("nixlNotFoundError"), "preparing", "p", posted=False)
    assert isinstance(before, kvwire.InvalidTransferError)
    after = translate(_nixl_error("nixlNotFoundError"), "polling", "p", posted=True)
    assert type(after) is kvwire.TransferError and "partly written" in str(after)
    assert type(translate(RuntimeError("BAD_STATUS"), "x", None, posted=False)) is kvwire.TransferError


# -- logging ----------------------------------------------------------------------------------


def test_nixl_records_are_dropped_only_inside_kvwire_calls() -> None:
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("nixl")
    logger.addHandler(handler)
    try:
        install_filter()
        with Quiet(True):
            logging.getLogger("nixl.api").warning("inside")
        with Quiet(False):
            logging.getLogger("nixl.api").warning("verbose")
        logging.getLogger("nixl.api").warning("host's own")
    finally:
        logger.removeHandler(handler)
    assert records == ["verbose", "host's own"]


# -- availability ---------------------------------------------------------------------------------


def test_availability_never_imports_nixl() -> None:
    code = (
        "import sys, kvwire\n"
        "infos = {i.name: i for i in kvwire.Registry(allow=['nixl']).load()}\n"
        "from kvwire_nixl.backend import NixlBackend\n"
        "NixlBackend.availability()\n"
        "print(infos['nixl'].status, sorted(m for m in sys.modules if m.split('.')[0] in "
        "('nixl', 'nixl_cu12', 'nixl_cu13', 'torch')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.stdout.strip() == "ok []", proc.stderr


def test_check_reports_ok_and_unavailable_when_nixl_is_missing(tmp_path: Path) -> None:
    # `kvwire check` probes plugins in child processes: hide NIXL from every process, as if not installed
    hide = "import sys\nfor name in ('nixl', 'nixl_cu12', 'nixl_cu13'):\n    sys.modules[name] = None\n"
    (tmp_path / "sitecustomize.py").write_text(hide)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-m", "kvwire", "check", "--json", "--backends", "nixl"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    (entry,) = [e for e in json.loads(proc.stdout) if e["name"] == "nixl"]
    assert (entry["name"], entry["status"], entry["distribution"]) == ("nixl", "ok", "kvwire-nixl")
    assert entry["runtime"].startswith("unavailable: NIXL is not installed"), entry["runtime"]
    assert {"interprocess", "mha", "mla", "host_memory", "layer_ids"} <= set(entry["capabilities"])


def test_a_missing_ucx_plugin_is_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(locate, "_package_dir", lambda module: object() if module == "nixl_cu12" else None)
    monkeypatch.setattr(locate, "find_ucx_plugin", lambda module: None)
    reason = NixlBackend.availability()
    assert reason is not None and "UCX plugin (libplugin_UCX.so) was not found in nixl_cu12" in reason


def test_the_agent_name_is_read_from_nixl_metadata_before_loading_it() -> None:
    blob = b"nixlSerDes|Agent" + (5).to_bytes(8, "little") + b"alpha|Conns..."
    assert metadata_agent(blob) == "alpha"
    assert metadata_agent(b"another format") is None
    assert metadata_agent(b"nixlSerDes|Agent" + (10**9).to_bytes(8, "little")) is None
    with pytest.raises(kvwire.InvalidTransferError, match="its NIXL metadata is agent 'alpha', not 'beta'"):
        decode_endpoint(encode_endpoint("beta", blob, REGIONS))


def _group(lengths: list[int], base: int = 0x100000) -> Group:
    length = np.array(lengths, np.int64)
    addr = base + np.concatenate(([0], np.cumsum(length)[:-1])).astype(np.int64)
    table = np.stack([addr, length, np.zeros_like(length)], axis=1)
    return Group(table, "DRAM", table + np.array([0x10000000, 0, 0], np.int64), "DRAM")


def test_chunks_are_byte_balanced_in_order_and_cover_every_row() -> None:
    mib = 1 << 20
    group = _group([mib] * 8 + [2 * mib] * 4 + [mib] * 8)  # 24 MiB
    parts = chunks_of([group], 3)
    assert len(parts) == 3 and all(len(p) == 1 for p in parts)
    tables = [p[0].local for p in parts]
    assert np.array_equal(np.concatenate(tables), group.local)  # every row once, in order
    assert np.array_equal(np.concatenate([p[0].remote for p in parts]), group.remote)
    assert [int(t[:, 1].sum()) // mib for t in tables] == [8, 8, 8]
    assert all(t.flags.c_contiguous for t in tables)


def test_small_writes_and_one_stream_are_not_split() -> None:
    mib = 1 << 20
    group = _group([mib] * 6)  # 6 MiB: one 4 MiB chunk at most
    assert chunks_of([group], 1) == [[group]]
    assert chunks_of([group], 4) == [[group]]
    assert len(chunks_of([_group([mib] * 8)], 4)) == 2  # 4 MiB per stream at least
    (single,) = chunks_of([_group([64 * mib])], 4)  # one descriptor cannot be cut
    assert single[0].local.shape == (1, 3)


def test_every_segment_group_is_split_over_the_same_streams() -> None:
    mib = 1 << 20
    dram, other = _group([2 * mib] * 8), _group([mib], base=0x9000000)
    parts = chunks_of([dram, other], 2)
    assert len(parts) == 2
    assert sum(int(g.local[:, 1].sum()) for p in parts for g in p) == 17 * mib
    assert [len(p) for p in parts] == [2, 1]  # the one-row group lands whole in the first chunk


def test_a_large_write_is_cut_into_chunks_of_about_the_chunk_size_with_two_streams_or_more() -> None:
    mib = 1 << 20
    group = _group([mib] * 300)  # 300 MiB
    parts = chunks_of([group], 2)
    assert len(parts) == 5  # ceil(300 / 64): five chunks of 60 MiB, fed to whichever stream is free
    assert [int(p[0].local[:, 1].sum()) // mib for p in parts] == [60] * 5
    assert np.array_equal(np.concatenate([p[0].local for p in parts]), group.local)
    assert len(chunks_of([group], 8)) == 8  # at least one per stream
    assert chunks_of([group], 1) == [[group]]  # one stream: one thread posts it either way
    assert len(chunks_of([group], 2, chunk=100 * mib)) == 3


class _Streams:
    """A stand-in for NixlAgent's streams: each task runs at once, on the thread; the order is recorded."""

    def __init__(self, streams: int) -> None:
        self.streams = streams
        self.started: list[tuple[int, str]] = []

    def on_stream(self, index: int, fn: Callable[[], list[str]]) -> Future[list[str]]:
        return run_now(fn)


def test_feed_posts_chunks_in_order_drops_a_failed_writes_rest_and_takes_work_added_between() -> None:
    mib = 1 << 20
    streams = _Streams(2)
    a = Write("a", "agent-a", [_group([mib] * 12)])  # three 4 MiB chunks with three streams' worth of cuts
    b = Write("b", "agent-b", [_group([mib] * 8)])
    c = Write("c", "agent-c", [_group([mib] * 4)])
    work = deque([*a.chunks(3), *b.chunks(2)])
    assert [w.session for w, _ in work] == ["a", "a", "a", "b", "b"]
    posted: list[str] = []

    def post(_: object, __: object, part: Sequence[Group], peer: str, session: str, handles: list[Any]) -> list[str]:
        posted.append(session)
        handles.append(f"{session}{len(posted)}")
        if session == "a" and posted.count("a") == 1:
            raise kvwire.InvalidTransferError("refused")
        return [PROC if session == "b" else DONE]

    rounds: list[int] = []

    def between() -> float | None:
        rounds.append(len(work))
        if len(rounds) == 1:
            work.extend(c.chunks(2))
        return None

    feed(streams, None, work, between, post)  # type: ignore[arg-type]
    assert posted == ["a", "a", "b", "b", "c"]  # a's third chunk: dropped once its first failed
    assert a.unposted == b.unposted == c.unposted == 0
    assert isinstance(a.error, kvwire.TransferError) and not isinstance(a.error, kvwire.InvalidTransferError)
    assert "other chunks of this write were posted: the destination may be partly written" in str(a.error)
    assert sorted(a.handles) == ["a1", "a2"]  # both made, so both are released (in the order posts returned)
    assert b.error is None and sorted(b.pending) == sorted(b.handles) == ["b3", "b4"]
    assert c.error is None and c.pending == [] and c.handles == ["c5"]
    assert rounds[0] == 3  # a1 and a2 went first; between() then added c's chunk
