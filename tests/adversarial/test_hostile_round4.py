"""Hostile input, round 4 (issue 37): the vLLM side channel, landing credits, configuration sources.

Each test names the row of the issue it closes and fails on the code before the fix.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from ports import free_port_run

from kvwire import BackendConfig, ConfigError
from kvwire.control import PeerConnection
from kvwire.hosts.vllm import channel
from kvwire.hosts.vllm.channel import RegistrationClient, RegistrationServer

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


# -- rows 12 and 5: kv_transfer_params ------------------------------------------------------------------------

PARAMS_BAD = [
    ({"remote_port": 70000}, "kv_transfer_params['remote_port'] must be a TCP port 1..65535, got 70000"),
    ({"remote_port": 2**70}, "kv_transfer_params['remote_port'] must be a TCP port 1..65535, got "
     "1180591620717411303424"),
    ({"remote_port": 65535, "tp_size": 2}, "kv_transfer_params['remote_port'] = 65535 is not a TCP port for each of "
     "the prefill's 2 ranks (ports remote_port .. remote_port + 1 must be at most 65535)"),
    ({"remote_request_id": "x" * 10_000_000}, "kv_transfer_params['remote_request_id'] is 10000000 characters, over "
     "the limit of 1024: '" + "x" * 59),
    ({"remote_engine_id": "e" * 1025}, "kv_transfer_params['remote_engine_id'] is 1025 characters, over the limit of "
     "1024: '" + "e" * 59),
    ({"remote_request_id": "p\ud800"}, "kv_transfer_params['remote_request_id'] is not UTF-8 text (surrogates not "
     "allowed at character 1): 'p\\ud800'"),
    ({"kvwire": 1.0}, "kv_transfer_params['kvwire'] = 1.0: not written by this connector's prefill (this kvwire reads "
     "version 1); run kvwire's KvwireConnector on both sides"),
    ({"kvwire": True}, "kv_transfer_params['kvwire'] = True: not written by this connector's prefill"),
    ({"tp_size": 4096}, "kv_transfer_params['tp_size'] = 4096 is over the largest prefill TP size this connector "
     "takes (256)"),
    ({"tp_size": 2**40}, "kv_transfer_params['tp_size'] = 1099511627776 is over the largest prefill TP size this "
     "connector takes (256)"),
    ({"tp_size": 10**5000}, "kv_transfer_params['tp_size'] = an int of 16610 bits is over the largest prefill TP "
     "size this connector takes (256)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "message"), PARAMS_BAD, ids=[f"{i}-{next(iter(c))}" for i, (c, _) in enumerate(PARAMS_BAD)]
)
def test_row12_kv_transfer_params_are_bounded_at_parse(change: dict[str, object], message: str) -> None:
    """Before: port 70000, 2**70, a 10 MB id, kvwire 1.0, tp_size 4096 were all accepted at parse."""
    from kvwire.errors import InvalidTransferError
    from kvwire.hosts.vllm import parse_remote_prefill, prefill_params

    params = prefill_params("p0", "engine-p", "127.0.0.1", 5710, [1, 2], 1, 40)
    with pytest.raises(InvalidTransferError) as exc:
        parse_remote_prefill({**params, **change})
    assert str(exc.value).startswith(message)
    assert parse_remote_prefill(dict(params, remote_port=65535)).port == 65535  # the edge itself is fine


@pytest.mark.parametrize("tp_size", [4096, 2**40])
def test_row5_a_prefill_tp_size_past_the_bound_is_refused_at_get_num_new_matched_tokens(
    tp_size: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: accepted (8 heads divide 4096); start() then took 2-4 s in vLLM's step and left 4,096 threads, and
    2**40 raised MemoryError there."""
    from types import SimpleNamespace

    from kvwire.hosts.vllm import ConnectorSettings, prefill_params
    from kvwire.hosts.vllm.scheduler import SchedulerSide
    from kvwire.hosts.vllm.settings import EngineSide

    settings = ConnectorSettings.from_extra_config({"backend": "local"})
    sched = SchedulerSide(EngineSide(settings, 1, producer=False, consumer=True, total_kv_heads=8), "engine-d")
    params = prefill_params("p0", "e", "127.0.0.1", 5710, [1, 2], tp_size, 40)
    request = SimpleNamespace(request_id="d0", prompt_token_ids=list(range(40)), kv_transfer_params=params)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    assert params["do_remote_prefill"] is False  # the decode computes the prompt itself
    assert [r.getMessage() for r in caplog.records] == [
        f"kvwire: request d0: kv_transfer_params['tp_size'] = {tp_size} is over the largest prefill TP size this "
        "connector takes (256); computing its prompt here"
    ]


# -- rows 1, 4, 6 and 5: the vLLM side channel ---------------------------------------------------------------


def _until(fn: Callable[[], object], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not fn():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def free_port() -> int:
    return free_port_run(8)


def _threads(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def _echo(message: dict[str, Any]) -> dict[str, Any]:
    return {"echo": message.get("n")}


def _hello(sock: socket.socket) -> dict[str, Any]:
    line = b""
    while not line.endswith(b"\n"):
        byte = sock.recv(1)
        assert byte, f"closed after {line!r}"
        line += byte
    return cast(dict[str, Any], json.loads(line))


@pytest.fixture
def server() -> Iterator[RegistrationServer]:
    srv = RegistrationServer("127.0.0.1", 0, _echo, None, 5.0)
    yield srv
    srv.close()


def _port(srv: RegistrationServer) -> int:
    return int(srv.address.rsplit(":", 1)[1])


def test_row6_a_line_whose_second_half_comes_0_3_s_later_is_answered(server: RegistrationServer) -> None:
    """Before: the partial-line deadline was the 0.2 s poll, not the channel's timeout: closed without a reply."""
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=10) as sock:
        assert _hello(sock) == {"kvwire_control": 2, "challenge": None}
        sock.sendall(b'{"cmd": "register", ')
        time.sleep(0.3)
        sock.sendall(b'"n": 7}\n')
        assert _hello(sock) == {"echo": 7}


def test_row4_idle_connections_are_capped_in_threads_and_closed_once_idle() -> None:
    """Before: one thread per connection, no cap; without a key an idle connection was held forever."""
    before = _threads("kvwire-vllm-registrations")
    srv = RegistrationServer("127.0.0.1", 0, _echo, None, 5.0)  # the defaults: 128 connections, 60 s idle
    socks = [socket.create_connection(("127.0.0.1", _port(srv)), timeout=10) for _ in range(400)]
    try:
        _until(  # every connection accepted or turned away (or, before the cap, a thread past it)
            lambda: (
                getattr(srv, "turned_away", 0) + getattr(srv, "connections", 0) == 400
                or _threads("kvwire-vllm-registrations") - before > 128
            )
        )
        assert _threads("kvwire-vllm-registrations") - before <= 128
        assert (srv.turned_away, srv.connections) == (400 - 128, 128)
        assert (channel.MAX_CONNECTIONS, channel.IDLE_TIMEOUT_S) == (128, 60.0)
    finally:
        for sock in socks:
            sock.close()
        srv.close()
    srv = RegistrationServer("127.0.0.1", 0, _echo, None, 5.0, max_connections=8, idle_s=0.5)
    socks = [socket.create_connection(("127.0.0.1", _port(srv)), timeout=10) for _ in range(50)]
    try:
        _until(lambda: srv.turned_away == 42)
        assert _threads("kvwire-vllm-registrations") - before <= 8
        _until(lambda: srv.idled_out == 8 and srv.connections == 0, timeout_s=5)  # 0.5 s idle, then closed
        for sock in socks[:8]:
            assert _hello(sock) == {"kvwire_control": 2, "challenge": None}
            assert sock.recv(1) == b""  # closed by the prefill
        with PeerConnection("127.0.0.1", _port(srv), what="prefill", timeout_s=5) as conn:  # room again
            assert conn.request({"n": 1}) == {"echo": 1}
    finally:
        for sock in socks:
            sock.close()
        srv.close()


def test_row4_connections_that_never_answer_the_challenge_are_capped_and_end_at_the_deadline() -> None:
    before = _threads("kvwire-vllm-registrations")
    srv = RegistrationServer("127.0.0.1", 0, _echo, b"secret", 0.5, max_connections=8)
    socks = [socket.create_connection(("127.0.0.1", _port(srv)), timeout=10) for _ in range(300)]
    try:
        peak, end = 0, time.monotonic() + 1.5
        while time.monotonic() < end:  # some are turned away, the others' handshakes end at their 0.5 s deadline
            peak = max(peak, _threads("kvwire-vllm-registrations") - before)
            time.sleep(0.002)
        assert 0 < peak <= 8 and srv.turned_away > 0
        _until(lambda: srv.connections == 0, timeout_s=5)
        with PeerConnection("127.0.0.1", _port(srv), what="prefill", timeout_s=5, key=b"secret") as conn:
            assert conn.request({"n": 2}) == {"echo": 2}
    finally:
        for sock in socks:
            sock.close()
        srv.close()


def test_row4_a_decode_reconnects_when_the_prefill_closed_its_idle_connection() -> None:
    srv = RegistrationServer("127.0.0.1", 0, _echo, None, 5.0, idle_s=0.3)
    client = RegistrationClient(None, 5.0)
    replies: list[tuple[dict[str, Any] | None, str | None]] = []
    try:
        client.send("127.0.0.1", _port(srv), {"n": 1}, lambda r, why: replies.append((r, why)))
        _until(lambda: len(replies) == 1)
        _until(lambda: srv.idled_out == 1)
        client.send("127.0.0.1", _port(srv), {"n": 2}, lambda r, why: replies.append((r, why)))
        _until(lambda: len(replies) == 2)
        assert replies == [({"echo": 1}, None), ({"echo": 2}, None)]
    finally:
        client.close()
        srv.close()


CHILD = """
import logging, resource, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s")
from kvwire.hosts.vllm.channel import RegistrationServer
server = RegistrationServer("127.0.0.1", 0, lambda m: {"echo": m.get("n")}, None, 5.0)
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
print(server.address, flush=True)
sys.stdin.readline()
server.close()
"""


def test_row1_the_side_channel_survives_running_out_of_file_descriptors() -> None:
    """Before: the accept thread returned on EMFILE and never accepted again: every later registration timed out."""
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        port = int(child.stdout.readline().rsplit(":", 1)[1])
        assert child.stderr is not None
        err: list[str] = []
        reader = threading.Thread(target=lambda: err.extend(child.stderr or ()), daemon=True)
        reader.start()
        flood = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(100)]  # past 64 descriptors
        _until(lambda: any("Too many open files" in line for line in err))  # the child ran out
        for sock in flood:
            sock.close()
        with PeerConnection("127.0.0.1", port, what="prefill", timeout_s=10) as conn:
            assert conn.request({"n": 3}) == {"echo": 3}
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.wait(10) == 0
        reader.join(10)
        text = "".join(err)
        assert text.count("kvwire: the side channel at 127.0.0.1:") == 1, text  # logged once
        assert (
            "cannot accept a decode's connection ([Errno 24] Too many open files); retrying as descriptors free up"
            in text
        )
    finally:
        child.kill()
        child.wait()


def test_row5_a_decodes_registrations_to_many_prefill_ranks_take_a_bounded_pool_of_threads() -> None:
    """Before: one executor, so one thread, per prefill rank (4,096 threads for tp_size 4096)."""
    before = _threads("kvwire-vllm-register_")
    listeners = [socket.create_server(("127.0.0.1", 0)) for _ in range(64)]  # never accept: no hello ever
    client = RegistrationClient(None, 1.0)
    reasons: list[str | None] = []
    try:
        for listener in listeners:
            client.send("127.0.0.1", listener.getsockname()[1], {"n": 0}, lambda r, why: reasons.append(why))
        time.sleep(0.3)
        assert _threads("kvwire-vllm-register_") - before <= 16
        assert channel.MAX_CLIENT_THREADS == 16
        _until(lambda: len(reasons) == 64, timeout_s=30)  # 64 / 16 threads x the 1 s handshake deadline
        assert all(r is not None and "did not complete the control-key handshake within 1 s" in r for r in reasons)
    finally:
        client.close()
        for listener in listeners:
            listener.close()


# -- row 2: a lone surrogate, and nothing raising out of vLLM's step ----------------------------------------

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")


def vllm_kv_caches(num_blocks: int = 8, heads: int = 2) -> dict[str, Any]:
    """vLLM's allocate_kv_cache on CPU (LBHNC): views at layer_stride into one int8 buffer."""
    torch = pytest.importorskip("torch")
    block = heads * 32 * 128 * 2
    raw = torch.zeros(len(LAYERS) * num_blocks * block, dtype=torch.int8)
    shape, stride = (num_blocks, heads, 32, 256), (block, 32 * 256, 256, 1)
    return {name: torch.as_strided(raw, shape, stride, i * num_blocks * block).view(torch.float16)
            for i, name in enumerate(LAYERS)}  # fmt: skip


def _sender(submit: Callable[..., Any] | None = None) -> Any:
    from concurrent.futures import Future
    from types import SimpleNamespace

    from kvwire.hosts.vllm import layout_from_kv_caches
    from kvwire.hosts.vllm.rank import WorkerRank
    from kvwire.hosts.vllm.sending import Sender

    def written(*_: object, **__: object) -> Future[int]:
        done: Future[int] = Future()
        done.set_result(1)
        return done

    connection = SimpleNamespace(
        config=SimpleNamespace(timeout_s=10.0), add_peer=lambda endpoint, layout: None, submit_kvcache=submit or written
    )
    mapped = layout_from_kv_caches(vllm_kv_caches())
    return Sender(WorkerRank(connection, mapped, 0, 1), lease_s=30)  # type: ignore[arg-type]


def _registration(prefill: str = "p0", decode: str = "d0", **change: Any) -> dict[str, Any]:
    from kvwire import PeerDescription
    from kvwire.hosts.vllm import layout_from_kv_caches
    from kvwire.hosts.vllm.registration import Registration

    peer = PeerDescription("ep", layout_from_kv_caches(vllm_kv_caches()).layout)
    return {**Registration(prefill, decode, (1, 2), (3, 4), LAYERS, 0, 1, 30.0, peer).to_dict(), **change}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"decode_request_id": "d\ud800"}, "registration: 'decode_request_id' is not UTF-8 text (surrogates not "
         "allowed at character 1): 'd\\ud800'"),
        ({"prefill_request_id": "\udfffp"}, "registration: 'prefill_request_id' is not UTF-8 text (surrogates not "
         "allowed at character 0): '\\udfffp'"),
        ({"layers": [LAYERS[0], "x\ud800"]}, "registration: layers[1] is not UTF-8 text (surrogates not allowed at "
         "character 1): 'x\\ud800'"),
    ],
    ids=["decode-id", "prefill-id", "layer"],
)  # fmt: skip
def test_row2_a_lone_surrogate_is_refused_at_parse(change: dict[str, Any], message: str) -> None:
    """Before: queued; when the request became ready, UnicodeEncodeError escaped WorkerSide.start (vLLM's step)."""
    sender = _sender()
    assert sender.handle(_registration(**change)) == {"error": message}
    sender.mark_ready(_ready("p0"))  # nothing queued: nothing raises
    peer = _registration()["peer"]
    assert sender.handle(_registration(peer={**peer, "endpoint": "e\ud800"}))["error"] == (
        "registration: the peer's endpoint is not UTF-8 text (surrogates not allowed at character 1): 'e\\ud800'"
    )


def _ready(request_id: str) -> Any:
    from kvwire.hosts.vllm.metadata import ReadyToSend

    return ReadyToSend(request_id, (1, 2))


def test_row2_a_write_that_raises_anything_is_that_requests_failure_only() -> None:
    """Before: a non-kvwire exception from a queued registration's write escaped mark_ready into vLLM's step."""
    calls: list[str] = []

    def submit(*_: object, notification: bytes, **__: object) -> Any:
        calls.append(notification.decode())
        raise RuntimeError("the engine broke")

    sender = _sender(submit)
    assert sender.handle(_registration()) == {"queued": "p0"}
    sender.mark_ready(_ready("p0"))  # in vLLM's step: logged, not raised
    assert calls == ["kvwire.vllm:d0"] and list(sender.failures) == ["RuntimeError: the engine broke"]


def test_row2_worker_start_fails_only_the_request_whose_work_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: an exception from one request's work left WorkerSide.start, and the step's other requests were
    never marked ready or registered."""
    from kvwire.hosts.vllm import ConnectorSettings
    from kvwire.hosts.vllm.metadata import StepMetadata, ToReceive
    from kvwire.hosts.vllm.params import RemotePrefill
    from kvwire.hosts.vllm.settings import EngineSide
    from kvwire.hosts.vllm.worker import WorkerSide

    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": free_port()})
    both = WorkerSide(EngineSide(settings, 1, producer=True, consumer=True), 0)
    both.register_kv_caches(vllm_kv_caches())
    try:
        sender, receiver, client = both.sender, both.receiver, both._client
        assert sender is not None and receiver is not None and client is not None
        marked: list[str] = []
        real_mark = sender.mark_ready

        def mark(item: Any) -> None:
            if item.request_id == "p0":
                raise RuntimeError("p0 cannot be marked")
            marked.append(item.request_id)
            real_mark(item)

        sent: list[str] = []

        def send(host: str, port: int, message: dict[str, Any], on_reply: Any) -> None:
            if message["decode_request_id"] == "d0":
                raise RuntimeError("d0 cannot be sent")
            sent.append(message["decode_request_id"])

        monkeypatch.setattr(sender, "mark_ready", mark)
        monkeypatch.setattr(client, "send", send)
        remote = RemotePrefill("p9", "e", "127.0.0.1", 1, (1, 2), 1, 40)
        meta = StepMetadata(
            to_send=(_ready("p0"), _ready("p1")),
            to_receive=(ToReceive("d0", (3, 4), remote), ToReceive("d1", (5, 6), remote)),
        )
        both.start(meta)  # vLLM's step: nothing raises
        assert marked == ["p1"] and sent == ["d1"]
        assert both.get_finished() == (None, {"d0"}) and both.load_errors() == {3, 4}
        assert receiver.failures == {"d0": "registering its blocks failed: RuntimeError: d0 cannot be sent"}
        assert receiver.pending == 1  # d1 waits for its prefill
    finally:
        both.shutdown()


# -- rows 3 and 7: waiting registrations, and registrations for blocks already gone ----------------------


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _clocked_sender() -> tuple[Any, Clock]:
    sender, clock = _sender(), Clock()
    sender._clock = clock
    return sender, clock


def test_row3_waiting_registrations_are_bounded_in_count_and_age() -> None:
    """Before: each kept until valid_for_s (1e300: forever), no count bound."""
    from kvwire.hosts.vllm.sending import MAX_WAITING

    sender, clock = _clocked_sender()
    base = _registration(valid_for_s=1e300)
    for i in range(1024):
        assert sender.handle({**base, "prefill_request_id": f"p{i}"}) == {"queued": f"p{i}"}
    assert sender.handle({**base, "prefill_request_id": "p1024"}) == {
        "error": "registration for 'p1024': 1024 registrations already wait for requests this prefill does not hold "
        "(yet), the most it keeps; refused (nothing was sent)"
    }
    assert MAX_WAITING == 1024
    clock.now += 29.9
    assert sender.finished() == set() and len(sender._waiting) == 1024
    clock.now += 0.2  # lease_s = 30: a registration waits at most that long for a request this prefill does not hold
    assert sender.finished() == set() and sender._waiting == {}
    assert sender.handle({**base, "prefill_request_id": "p1024"}) == {"queued": "p1024"}


def test_row3_a_second_registration_for_a_queued_request_is_refused_not_replacing() -> None:
    """Before: it silently replaced the first."""
    sender = _sender()
    assert sender.handle(_registration()) == {"queued": "p0"}
    other = _registration(decode="d-other", decode_block_ids=[5, 6])
    assert sender.handle(other) == {
        "error": "registration for 'p0': one from the decode already waits for this request; a second is refused "
        "(the first stands)"
    }
    assert sender._waiting["p0"][None][0].decode_block_ids == (3, 4)


def test_row3_a_layout_of_other_buffers_than_layers_is_refused_before_it_is_kept() -> None:
    """Before: a 2,000-buffer layout was kept for each waiting registration (+80 MiB per 100)."""
    from kvwire import KVBuffer, KVLayout, PeerDescription

    huge = KVLayout(tuple(KVBuffer((1 << 20) + i * 8 * 16384, 16384, 8, i) for i in range(2000)))
    peer = PeerDescription("ep", huge).to_dict()
    sender = _sender()
    assert sender.handle(_registration(peer=peer)) == {
        "error": "registration for 'p0': the decode's layout has 2000 buffers, this prefill's 2 (one per layer); "
        "nothing was sent"
    }
    assert sender._waiting == {}


def test_row7_a_registration_for_blocks_already_written_or_released_is_refused_at_once() -> None:
    """Before: answered "queued"; the decode waited its whole load_timeout_s."""
    sender, clock = _clocked_sender()
    sender.mark_ready(_ready("p0"))
    assert sender.handle(_registration()) == {"accepted": "p0"}  # written at once (a finished future)
    assert sender.finished() == {"p0"}
    assert sender.handle(_registration(decode="d-replay")) == {
        "error": "request 'p0': its blocks were written to a decode and freed; nothing was sent"
    }
    sender.mark_ready(_ready("p1"))
    clock.now += 30
    assert sender.finished() == {"p1"}
    assert sender.handle(_registration("p1", "d1")) == {
        "error": "request 'p1': its lease ended (lease_s = 30 s) and its blocks were freed; nothing was sent"
    }
    assert sender._waiting == {}


# -- rows 8 and 9, and the landing release during a scatter ------------------------------------------------


def _final(heads: int = 8, decode_tp: int = 1, rank: int = 0, pages: int = 16) -> Any:
    import numpy as np

    from kvwire import HeadLayout, KVLayout

    held = HeadLayout(max(1, heads // decode_tp), heads, 128, 2, 16)
    k, v = (np.zeros((pages, held.page_bytes), np.uint8) for _ in "kv")
    return KVLayout.mha([k], [v], attn_tp_size=decode_tp, attn_tp_rank=rank, heads=held), (k, v)


def test_row8_repeated_and_out_of_range_senders_are_refused_before_anything_is_reserved() -> None:
    """Before: reserve(2, [0, 0]) reserved 2 pages named by nothing; a sender of 2**63 raised OverflowError halfway,
    leaving the earlier senders' pages reserved."""
    from kvwire import InvalidTransferError
    from kvwire.landing import LandingCredits

    layout, _ = _final()
    credits = LandingCredits(layout)
    for senders, message in (
        ([0, 0], "senders[1] = 0 repeats senders[0]: each sender gets pages of its own; nothing was reserved"),
        ([0, 1, 2**63], f"senders[2] = {2**63} is out of range: a sender is an int in 0..{2**63 - 1}; nothing was "
         "reserved"),
    ):  # fmt: skip
        with pytest.raises(InvalidTransferError) as exc:
            credits.reserve(2, senders)
        assert str(exc.value) == message
        assert credits.free == 16  # all or nothing
    assert list(credits.reserve(2, [3, 2**63 - 1]) or {}) == [3, 2**63 - 1]


def _held(heads: int, tp: int, rank: int) -> range:
    """The KV heads TP rank ``rank`` of ``tp`` holds (vLLM's and sglang's split; the test's own)."""
    if tp <= heads:
        return range(rank * (heads // tp), (rank + 1) * (heads // tp))
    return range(rank * heads // tp, rank * heads // tp + 1)


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "heads"), [(16, 1, 8), (32, 2, 8), (64, 1, 4), (8, 2, 8),
                                                                 (16, 4, 2), (4, 1, 8)])  # fmt: skip
def test_row9_a_landing_keeps_the_lowest_rank_of_each_head(prefill_tp: int, decode_tp: int, heads: int) -> None:
    from kvwire.landing import Landing

    for d in range(decode_tp):
        final, _ = _final(heads, decode_tp, d)
        first = d * prefill_tp // decode_tp
        routed = range(first, first + prefill_tp // decode_tp)
        mine = _held(heads, decode_tp, d)
        want = sorted({min(r for r in routed if h in _held(heads, prefill_tp, r)) for h in mine})
        with Landing(final, prefill_tp, 4) as landing:
            assert landing.senders == tuple(want)


@pytest.mark.parametrize("prefill_tp", [2**16, 2**20])
def test_row9_a_landing_for_many_prefill_ranks_is_built_in_time_of_the_heads(prefill_tp: int) -> None:
    """Before: 3 s for 65,536 prefill ranks, more than 30 s for 2**20 (every rank's slicing, replicas included)."""
    from kvwire.landing import Landing

    final, _ = _final()
    t0 = time.perf_counter()
    with Landing(final, prefill_tp, 4) as landing:
        assert time.perf_counter() - t0 < 0.5
        assert landing.senders == tuple(range(0, prefill_tp, prefill_tp // 8))


def test_landing_pages_are_not_released_while_a_scatter_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in issue 37: release() was accepted while a scatter() of the same pages ran, and reserve() could then
    hand them out mid-copy."""
    from kvwire import InvalidTransferError
    from kvwire.landing import Landing, zone

    final, _ = _final(pages=8)
    inside, go = threading.Event(), threading.Event()
    real = zone._Copy.run_all

    def slow(self: Any, *args: Any) -> None:
        inside.set()
        assert go.wait(10)
        real(self, *args)

    monkeypatch.setattr(zone._Copy, "run_all", slow)
    with Landing(final, 2, 8, threads=1) as landing:
        reserved = landing.reserve(2)
        assert reserved is not None
        pages = reserved[0]
        import numpy as np

        scatter = threading.Thread(target=landing.scatter, args=(0, pages, np.array([1, 2])))
        scatter.start()
        assert inside.wait(10)
        with pytest.raises(InvalidTransferError) as exc:
            landing.release(pages)
        assert str(exc.value) == (
            f"pages[0] = {int(pages[0])} is being scattered: release it once scatter() returns; nothing was released"
        )
        assert landing.credits.free == 4  # still reserved: not handed out again
        go.set()
        scatter.join(10)
        landing.release(pages)
        assert landing.credits.free == 6


# -- row 13: memory registered from arrays and tensors is kept alive ------------------------------------------


def test_row13_arrays_whose_last_reference_the_caller_drops_stay_registered_memory() -> None:
    """Before: KVLayout.mla kept only the addresses; the arrays were freed while registered, and a write landed in
    freed memory (glibc ``realloc(): invalid next size`` in 3 of 4 runs of one pair of reproductions)."""
    import gc
    import weakref

    import numpy as np

    import kvwire
    from kvwire import KVLayout

    with kvwire.connect("local") as sender, kvwire.connect("local") as receiver:
        src = KVLayout.mla([np.full((4, 4096), i + 1, np.uint8) for i in range(2)])
        dst = [np.zeros((4, 4096), np.uint8) for _ in range(2)]
        alive = [weakref.ref(a) for a in dst]
        layout = KVLayout.mla(dst)
        sender.register_kv_buffers(src)
        receiver.register_kv_buffers(layout)
        published = KVLayout.from_dict(layout.to_dict())  # what a peer sees: addresses only
        sender.add_peer(receiver.endpoint(), published)
        del dst, layout, src  # the caller's last references
        gc.collect()
        assert all(ref() is not None for ref in alive)  # still the registered arrays
        pages = np.array([1, 2], np.int32)
        sender.send_kvcache(receiver.endpoint(), pages, [b.base for b in published.buffers], np.array([0, 3], np.int32))
        for i, ref in enumerate(alive):
            array = ref()
            assert array is not None and array[[0, 3]].tolist() == [[i + 1] * 4096] * 2
            assert not array[[1, 2]].any()


def test_row13_the_vllm_connector_keeps_the_kv_tensors_it_registers() -> None:
    """Before: layout_from_kv_caches took data_ptr() only; tensors nobody else held were freed while registered."""
    import gc
    import weakref

    from kvwire.hosts.vllm import ConnectorSettings
    from kvwire.hosts.vllm.settings import EngineSide
    from kvwire.hosts.vllm.worker import WorkerSide

    settings = ConnectorSettings.from_extra_config({"backend": "local"})
    work = WorkerSide(EngineSide(settings, 1, producer=False, consumer=False), 0)
    caches = vllm_kv_caches()
    alive = [weakref.ref(t) for t in caches.values()]
    work.register_kv_caches(caches)
    try:
        del caches
        gc.collect()
        assert all(ref() is not None for ref in alive)
    finally:
        work.shutdown()


# -- found in issue 37: a spoofed arrival ---------------------------------------------------------------------


def test_an_arrival_or_failure_notice_from_a_peer_the_decode_did_not_register_with_is_ignored() -> None:
    """Found in issue 37: a connection other than the prefill sent ``kvwire.vllm:<id>``, and the decode reported the
    request loaded with no byte written (vLLM would then decode from whatever its blocks held)."""
    import numpy as np

    import kvwire
    from kvwire.hosts.vllm import ConnectorSettings, prefill_params
    from kvwire.hosts.vllm.metadata import StepMetadata, ToReceive
    from kvwire.hosts.vllm.notices import failure_notice_for
    from kvwire.hosts.vllm.params import parse_remote_prefill
    from kvwire.hosts.vllm.registration import notification_for
    from kvwire.hosts.vllm.settings import EngineSide
    from kvwire.hosts.vllm.worker import WorkerSide

    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": free_port()})
    p_work = WorkerSide(EngineSide(settings, 1, producer=True, consumer=False), 0)
    d_work = WorkerSide(EngineSide(settings, 1, producer=False, consumer=True), 0)
    p_caches, d_caches = vllm_kv_caches(), vllm_kv_caches()
    for t in p_caches.values():
        t.fill_(3.0)
    p_work.register_kv_caches(p_caches)
    d_work.register_kv_caches(d_caches)
    try:
        receiver, sender = d_work.receiver, p_work.sender
        assert receiver is not None and sender is not None and d_work.connection is not None
        remote = parse_remote_prefill(prefill_params("p0", "e", "127.0.0.1", settings.side_channel_port, [1, 2], 1, 40))
        d_work.start(StepMetadata(to_receive=(ToReceive("d0", (5, 6), remote),)))
        _until(lambda: "p0" in sender._waiting)  # queued: the prefill's scheduler has not said p0 is ready
        with kvwire.connect("local") as spoofer:
            spoofer.register_kv_buffers(kvwire.KVLayout.mla([np.zeros((1, 64), np.uint8)]))
            endpoint = d_work.connection.endpoint()
            spoofer.add_peer(endpoint, kvwire.KVLayout.from_dict(d_work.local.layout.to_dict()))  # type: ignore[union-attr]
            done: list[set[str]] = []

            def settled(count: int) -> bool:  # d0 reported done, or the message seen and ignored
                finished = d_work.get_finished()[1]
                if finished:
                    done.append(finished)
                return bool(done) or getattr(receiver, "spoofed", 0) == count

            spoofer.send_notification(endpoint, notification_for("d0"))
            _until(lambda: settled(1))
            assert done == []  # before: [{"d0"}], loaded with no byte written
            spoofer.send_notification(endpoint, failure_notice_for("d0", None, "spoofed"))
            _until(lambda: settled(2))
            assert done == []  # before: failed while the real prefill may still write its blocks
        assert receiver.pending == 1
        p_work.start(StepMetadata(to_send=(_ready("p0"),)))  # the real prefill writes, tagged with d0's token
        _until(lambda: d_work.get_finished()[1] == {"d0"})
        assert d_work.load_errors() == set() and receiver.failures == {}
        for name in LAYERS:
            assert d_caches[name][[5, 6]].equal(p_caches[name][[1, 2]])
    finally:
        p_work.shutdown()
        d_work.shutdown()
