"""The control channel is bounded and typed: a buggy or hostile peer ends in one ControlError, in time.

Each misbehaviour is played by ``control_peer.py MODE``. The time checks are
fault bounds (the error comes within the read deadline plus a margin for the
child's start on a loaded machine), not performance timings.
"""

from __future__ import annotations

import io
import json
import os
import re
import resource
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import kvwire.benchmark.run
from kvwire.cli import main
from kvwire.control import (
    Channel,
    ChildProcess,
    ControlClosedError,
    ControlError,
    ControlProtocolError,
    ControlTimeoutError,
    read_command,
    serve,
)
from kvwire.control.jsonlines import nesting_depth, parse_object
from kvwire.errors import ConfigError, KvwireError

HERE = Path(__file__).parent
DEADLINE = 2.0
MARGIN = 1.5  # the child's start and scheduling on a busy machine
GRACE = 5.0
MiB = 1 << 20

Spawn = Callable[..., ChildProcess]


@pytest.fixture
def spawn(monkeypatch: pytest.MonkeyPatch) -> Iterator[Spawn]:
    """Start ``control_peer MODE`` as a ChildProcess; every child is closed (and reaped) afterwards."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    children: list[ChildProcess] = []

    def start(mode: str, **options: Any) -> ChildProcess:
        options = {"timeout_s": DEADLINE, "grace_s": GRACE, **options}
        child = ChildProcess("control_peer", [mode], what=f"peer {mode}", **options)
        children.append(child)
        return child

    yield start
    for child in children:
        child.close()
        assert child.proc.returncode is not None


def _label(mode: str) -> str:
    return rf"peer {mode} \(pid \d+\)"


def _timed_read(child: ChildProcess) -> tuple[ControlError, float]:
    start = time.monotonic()
    with pytest.raises(ControlError) as info:
        child.read()
    return info.value, time.monotonic() - start


def _closes_in_time(child: ChildProcess, bound: float) -> None:
    start = time.monotonic()
    child.close()
    elapsed = time.monotonic() - start
    assert child.proc.returncode is not None, "close() must reap the child"
    assert elapsed < bound, f"close() took {elapsed:.2f} s"


CASES = [
    (
        "deep",
        ControlProtocolError,
        r"sent JSON nested deeper than 32 levels: b'\[{60}'\.\.\. \(200000 bytes\)",
    ),
    (
        "not_utf8",
        ControlProtocolError,
        r"sent a line that is not UTF-8 \(byte 0xff at offset 0\): b'\\xff\\xfe\{\"endpoint\": \"x\"\}'",
    ),
    (
        "not_json",
        ControlProtocolError,
        r"sent a line that is not JSON \(Expecting value at column 1\): b'hello, parent'",
    ),
    ("array", ControlProtocolError, r"sent a JSON array, not a JSON object: b'\[\"endpoint\", 1\]'"),
    ("closed_stdout", ControlClosedError, r"closed its stdout but is still running"),
    (
        "stall",
        ControlTimeoutError,
        r"stalled in the middle of a line: 20 bytes and no newline within 2 s: b'\{\"endpoint\": \"tcp://'",
    ),
    (
        "huge_line",
        ControlProtocolError,
        r"sent a line over 1048576 bytes \(no newline within the limit\), "
        r"starting b'\{\"format\": \"kvwire-peer\", \"endpoint\": \"x{21}'",
    ),
    (
        "flood",
        ControlProtocolError,
        r"sent a line over 1048576 bytes \(no newline within the limit\), starting b'x{60}'",
    ),
    ("exit3", ControlClosedError, r"exited with code 3 before answering"),
    ("silent", ControlTimeoutError, r"did not answer within 2 s"),
]


@pytest.mark.parametrize(("mode", "kind", "message"), CASES, ids=[case[0] for case in CASES])
def test_a_misbehaving_child_is_one_typed_error_within_the_deadline(
    spawn: Spawn, mode: str, kind: type[ControlError], message: str
) -> None:
    child = spawn(mode)
    error, elapsed = _timed_read(child)
    assert type(error) is kind
    assert isinstance(error, KvwireError)
    assert re.fullmatch(f"{_label(mode)} {message}", str(error)), str(error)
    assert elapsed < DEADLINE + MARGIN, f"{mode}: {elapsed:.2f} s"
    if mode != "silent":  # a violation poisons the channel: the same error at once, for reads and sends
        for call in (child.read, lambda: child.send({"cmd": "ping"})):
            start = time.monotonic()
            with pytest.raises(kind) as again:
                call()
            assert str(again.value) == str(error)
            assert time.monotonic() - start < 0.5
    # quit is not asked of a poisoned channel; a silent child gets the deadline to answer it
    _closes_in_time(child, (DEADLINE if mode == "silent" else 0.0) + 1.0 + MARGIN)


@pytest.mark.parametrize("mode", ["huge_line", "flood"])
def test_a_huge_line_or_a_flood_is_refused_with_bounded_memory(spawn: Spawn, mode: str) -> None:
    child = spawn(mode)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    tracemalloc.start()
    try:
        error, elapsed = _timed_read(child)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) * 1024
    assert type(error) is ControlProtocolError
    assert elapsed < DEADLINE + MARGIN
    assert peak < 8 * MiB, f"{peak / MiB:.1f} MiB allocated while reading"
    assert growth < 64 * MiB, f"max RSS grew by {growth / MiB:.1f} MiB"


def test_a_flood_of_short_lines_is_refused_over_the_buffer_limit(spawn: Spawn) -> None:
    child = spawn("flood_lines", max_buffered=4096)
    error, elapsed = _timed_read(child)
    assert type(error) is ControlProtocolError
    pattern = rf"{_label('flood_lines')} flooded the channel: \d+ bytes of unread lines, over the limit of 4096"
    assert re.fullmatch(pattern, str(error)), str(error)
    assert elapsed < DEADLINE + MARGIN


def test_limits_are_configurable(spawn: Spawn) -> None:
    deep = spawn("deep", max_depth=100_000, max_line=MiB)
    assert deep.max_depth == 100_000
    with pytest.raises(ControlProtocolError, match=r"sent a line that is not JSON kvwire reads \(maximum recursion"):
        deep.read()  # allowed that deep, json.loads recurses too far: still one typed error
    short = spawn("not_json", max_line=8)
    with pytest.raises(ControlProtocolError, match=r"sent a line over 8 bytes"):
        short.read()
    with pytest.raises(ConfigError, match=r"max_line must be > 0"):
        ChildProcess("control_peer", ["silent"], what="peer", max_line=0)


class _PipeChannel(Channel):
    """A Channel over two pipes of this process: the test writes the peer's bytes to ``peer`` itself."""

    def __init__(self, max_line: int) -> None:
        read_fd, self.peer = os.pipe()
        self._peer_reads, write_fd = os.pipe()
        super().__init__(read_fd, write_fd, what="peer", timeout_s=5.0, max_line=max_line)

    def close(self) -> None:
        for fd in (self._out, self.peer, self._peer_reads, self._in):
            os.close(fd)


def test_a_line_of_max_line_bytes_is_read_and_one_byte_more_is_refused() -> None:
    with _PipeChannel(max_line=8) as channel:
        os.write(channel.peer, b'{"a":12}\n')  # 8 bytes before the newline
        assert channel.read() == {"a": 12}
        os.write(channel.peer, b'{"a":123}\n')  # 9
        with pytest.raises(ControlProtocolError) as exc:
            channel.read()
        assert str(exc.value) == (
            "peer sent a line over 8 bytes (no newline within the limit), starting b'{\"a\":123}\\n'"
        )


def test_a_line_in_progress_may_reach_max_line_bytes_and_not_one_byte_more() -> None:
    """No newline yet: 8 bytes are a line in progress (the read times out waiting for the rest), 9 are refused."""
    with _PipeChannel(max_line=8) as channel:
        os.write(channel.peer, b'{"a":12}')
        with pytest.raises(ControlTimeoutError) as stalled:
            channel.read(timeout_s=0)  # the bytes are already in the pipe: one look takes them
        assert str(stalled.value) == (
            "peer stalled in the middle of a line: 8 bytes and no newline within 0 s: b'{\"a\":12}'"
        )
    with _PipeChannel(max_line=8) as channel:
        os.write(channel.peer, b'{"a":123}')
        with pytest.raises(ControlProtocolError) as exc:
            channel.read(timeout_s=0)
        assert str(exc.value) == "peer sent a line over 8 bytes (no newline within the limit), starting b'{\"a\":123}'"


def test_a_reported_error_does_not_poison_the_channel(spawn: Spawn) -> None:
    child = spawn("error")
    error, _ = _timed_read(child)
    assert type(error) is ControlError
    assert re.fullmatch(r"peer error failed: cannot allocate pages \(pid \d+\)", str(error)), str(error)
    assert type(_timed_read(child)[0]) is ControlTimeoutError  # still a channel: nothing more to read
    _closes_in_time(child, DEADLINE + 1.0 + MARGIN)


def test_close_kills_a_child_that_ignores_quit_eof_and_sigterm(spawn: Spawn) -> None:
    child = spawn("ignore_quit")
    assert child.read() == {"ok": True}
    _closes_in_time(child, DEADLINE + 1.0 + MARGIN)
    assert child.proc.returncode == -9


def test_a_child_that_does_not_read_its_input_times_out_a_send(spawn: Spawn) -> None:
    child = spawn("silent")
    start = time.monotonic()
    with pytest.raises(ControlTimeoutError) as info:
        child.send({"cmd": "scramble", "pad": "x" * MiB})  # far more than a pipe holds
    assert time.monotonic() - start < DEADLINE + MARGIN
    pattern = rf"{_label('silent')} did not read its input within 2 s \(\d+ of \d+ bytes sent\)"
    assert re.fullmatch(pattern, str(info.value)), str(info.value)
    _closes_in_time(child, 1.0 + MARGIN)


def test_a_send_to_an_exited_child_names_its_exit_code(spawn: Spawn) -> None:
    child = spawn("exit3")
    child.proc.wait(timeout=30)
    with pytest.raises(ControlClosedError) as info:
        child.send({"cmd": "hashes"})
    assert re.fullmatch(rf"{_label('exit3')} exited with code 3 before reading a command", str(info.value))


def test_a_child_that_cannot_start_is_a_control_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(ControlClosedError, match=r"^decode process could not be started: .*No such file"):
        ChildProcess("kvwire.benchmark.decode", ["{}"], what="decode process")


def test_bench_reports_a_failed_decode_process_on_one_line_and_reaps_it(
    spawn: Spawn, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    started: list[ChildProcess] = []

    def decode_process(module: str, args: list[str], *, what: str) -> ChildProcess:
        assert module == "kvwire.benchmark.decode"
        child = spawn("exit3")
        child.what = what
        started.append(child)
        return child

    monkeypatch.setattr(kvwire.benchmark.run, "ChildProcess", decode_process)
    monkeypatch.setattr(kvwire.benchmark.run, "_check_arguments", lambda args: None)
    assert main(["bench", "--backend", "mooncake"]) == 2
    *steps, error = capsys.readouterr().err.splitlines()
    assert error == f"kvwire bench: error: decode process (pid {started[0].pid}) exited with code 3 before answering"
    assert [re.sub(r"\[ *[\d.]+ s\] ", "", line) for line in steps] == [
        "kvwire bench: starting the decode process (a local child)",
        "kvwire bench: waiting for the decode side to allocate and register 576 pages (mooncake)",  # 2 x 256 + 64
    ]
    assert started[0].proc.returncode == 3  # closed by run() itself, before the fixture


# -- child side ------------------------------------------------------------------------------------------------


def test_read_command_refuses_bad_lines_with_typed_errors() -> None:
    lines = [
        b"\xff\xfe\n",
        b"[" * 100_000 + b"]" * 100_000 + b"\n",
        b"x" * (2 * MiB) + b"\n",
        b"[1]\n",
        b"hello\n",
        b'{"cmd": "ok"}\n',
    ]
    stream = io.BytesIO(b"".join(lines))
    expected = [
        r"bad command: a line that is not UTF-8 \(byte 0xff at offset 0\): b'\\xff\\xfe'",
        r"bad command: JSON nested deeper than 32 levels: b'\[{60}'\.\.\. \(200000 bytes\)",
        r"bad command: a line over 1048576 bytes: b'x{60}'\.\.\. \(1048577 bytes\)",
        r"bad command: a JSON array, not a JSON object: b'\[1\]'",
        r"bad command: a line that is not JSON \(Expecting value at column 1\): b'hello'",
    ]
    for pattern in expected:
        with pytest.raises(ControlProtocolError) as info:
            read_command(stream)
        assert re.fullmatch(pattern, str(info.value)), str(info.value)
    assert read_command(stream) == {"cmd": "ok"}  # the stream stays in step after every bad line
    assert read_command(stream) is None


def test_serve_answers_bad_commands_with_errors_and_keeps_serving() -> None:
    code = (
        "from kvwire.control import serve\n"
        "def boom(message):\n"
        "    raise KeyError('digest')\n"
        "serve({'echo': lambda m: {'echo': m['v']}, 'boom': boom, 'odd': lambda m: {'x': object()}})\n"
    )
    commands = [
        b"\xff\n",
        b"[" * 100_000 + b"]" * 100_000 + b"\n",
        b'{"cmd": "echo", "v": "' + b"y" * (2 * MiB) + b'"}\n',
        b"42\n",
        b"{not json\n",
        b'{"cmd": "echo", "v": 7}\n',
        b'{"cmd": "boom"}\n',
        b'{"cmd": "odd"}\n',
        b'{"cmd": "' + b"z" * 1000 + b'"}\n',
        b'{"cmd": "quit"}\n',
        b'{"cmd": "echo", "v": 8}\n',  # after quit: never read
    ]
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", code], input=b"".join(commands), capture_output=True, timeout=60, check=False
    )
    assert time.monotonic() - start < 30
    assert proc.returncode == 0, proc.stderr.decode()
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    errors = [r.get("error", "") for r in replies]
    assert errors[0].startswith("bad command: a line that is not UTF-8")
    assert errors[1].startswith("bad command: JSON nested deeper than 32 levels")
    assert errors[2].startswith("bad command: a line over 1048576 bytes")
    assert errors[3].startswith("bad command: a JSON number, not a JSON object")
    assert errors[4].startswith("bad command: a line that is not JSON (Expecting property name")
    assert replies[5] == {"echo": 7}
    assert errors[6] == "KeyError: 'digest'"
    assert errors[7] == "TypeError: Object of type object is not JSON serializable"
    assert errors[8] == "unknown command '" + "z" * 199 + "..."
    assert replies[9] == {"ok": True}
    assert len(replies) == 10


def test_serve_returns_at_eof() -> None:
    out = io.StringIO()
    serve({"echo": lambda m: {"echo": m["v"]}}, stdin=io.BytesIO(b'{"cmd": "echo", "v": 1}\n[]\n'), stdout=out)
    assert [json.loads(line) for line in out.getvalue().splitlines()] == [
        {"echo": 1},
        {"error": "bad command: a JSON array, not a JSON object: b'[]'"},
    ]


# -- the depth scan --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("{}", 1),
        ('{"a": [1, {"b": []}]}', 4),
        ('{"a": "[[[[{{{{"}', 1),
        ('{"a": "\\"[[[["}', 1),
        ('{"a": "\\\\", "b": [[]]}', 3),
        ("]]]", 0),
        ("[" * 100_000, 100_000),
    ],
)
def test_nesting_depth_skips_strings_and_escapes(text: str, depth: int) -> None:
    assert nesting_depth(text) == depth


def test_parse_object_takes_a_deep_line_in_linear_time() -> None:
    line = b'{"a": "' + b'\\"' * 300_000 + b'", "b": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    start = time.monotonic()
    with pytest.raises(ValueError, match="nested deeper than 32 levels"):
        parse_object(line)
    assert time.monotonic() - start < 2.0


def test_a_closed_channel_is_an_error_not_a_stray_descriptor(spawn: Spawn) -> None:
    child = spawn("ignore_quit")
    assert child.read() == {"ok": True}
    child.close()
    child.close()  # idempotent
    for call in (child.read, lambda: child.send({"cmd": "hashes"})):
        with pytest.raises(ControlClosedError, match=r"^peer ignore_quit \(pid \d+\): the channel is closed$"):
            call()


def test_a_childs_library_writing_to_stdout_does_not_reach_the_channel(spawn: Spawn) -> None:
    """claim_stdout(): what a native library writes to fd 1 (UCX's warnings) goes to stderr, not between replies."""
    child = spawn("noisy_library")
    assert child.read() == {"ok": True}
    assert child.request({"cmd": "echo", "x": 5}) == {"echo": 5}
    assert child.request({"cmd": "echo", "x": [1, 2]}) == {"echo": [1, 2]}
