"""Where an engine kvwire creates accepts connections: only on ``BackendConfig.host`` (issue 11, "Bind where you say").

Mooncake binds its handshake listener to ``0.0.0.0`` and its TCP data listener
to ``::`` (dual-stack) whatever the host. kvwire attaches a socket filter to
both, so they answer only connections addressed to the host; these tests list
the process's listening sockets from ``/proc``, then connect to the same ports
through another local address (``127.0.0.2``: every 127/8 address is local on
Linux, so no network is needed) and through the host itself. A filtered SYN is
dropped, so the refused connection ends in a timeout (kept short here).
"""

from __future__ import annotations

import importlib.util
import json
import socket
import struct
import warnings
from collections.abc import Iterator

import numpy as np
import pytest

from kvwire.config import BackendConfig
from kvwire.errors import ConfigError
from kvwire_mooncake.engine import MooncakeEngine, confine, listening
from kvwire_mooncake.engine.confine import ExposedListenerWarning, filter_program
from kvwire_mooncake.engine.listening import Listener, listeners, socket_states
from kvwire_mooncake.engine_double import HostMemoryEngine
from kvwire_mooncake.options import MooncakeOptions

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
linux_only = pytest.mark.skipif(not listening.supported(), reason="needs Linux /proc")
needs_engine = pytest.mark.skipif(not (HAVE_MOONCAKE and listening.supported()), reason="needs Mooncake and /proc")

HOST = "127.0.0.1"
OTHER = "127.0.0.2"  # a local address that is not the host
TIMEOUT_S = 0.4


def outcome(address: str, port: int) -> str:
    """``"open"`` if a TCP connection to ``address:port`` is accepted, else the exception's name."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as client:
        client.settimeout(TIMEOUT_S)
        try:
            client.connect((address, port))
        except OSError as exc:
            return type(exc).__name__
    return "open"


def handshake_metadata(address: str, port: int) -> dict[str, object] | str:
    """What a stranger gets from Mooncake's P2P handshake: a Metadata request (type 1) with an empty JSON body."""
    body = b"\x01{}"
    data = b""
    try:
        with socket.create_connection((address, port), TIMEOUT_S * 3) as client:
            client.sendall(struct.pack("<Q", len(body)) + body)
            while chunk := client.recv(65536):
                data += chunk
    except OSError as exc:
        return type(exc).__name__
    (length,) = struct.unpack("<Q", data[:8])
    reply: dict[str, object] = json.loads(data[9 : 8 + length])
    return reply


@pytest.fixture
def fresh_warning(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The once-per-process warning, re-armed for this test."""
    monkeypatch.setattr(confine, "_warned", False)
    yield


@pytest.fixture
def two_engines() -> Iterator[tuple[MooncakeEngine, MooncakeEngine]]:
    receiver = MooncakeEngine(BackendConfig(host=HOST))
    sender = MooncakeEngine(BackendConfig(host=HOST))
    try:
        yield receiver, sender
    finally:
        sender.close()
        receiver.close()


# ---------------------------------------------------------------------------- /proc listing and the filter itself


@linux_only
def test_listeners_lists_this_process_listening_sockets_with_address_and_port() -> None:
    with socket.socket() as v4, socket.socket() as idle:
        v4.bind((HOST, 0))
        v4.listen()
        idle.bind((HOST, 0))  # bound, not listening: not a listener
        found = {(item.address, item.port) for item in listeners()}
        assert (HOST, v4.getsockname()[1]) in found
        assert (HOST, idle.getsockname()[1]) not in found
        mine = next(item for item in listeners() if item.port == v4.getsockname()[1])
        assert str(mine) == f"{HOST}:{mine.port}" and not mine.wildcard
        assert socket_states().get("LISTEN", 0) >= 1


@linux_only
def test_a_filtered_wildcard_listener_answers_only_on_the_allowed_address() -> None:
    with socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen(16)
        port = server.getsockname()[1]
        assert outcome(OTHER, port) == "open"
        item = next(x for x in listeners() if x.port == port)
        assert item.wildcard and str(item) == f"0.0.0.0:{port}"
        assert confine._attach(item, filter_program([socket.inet_aton(HOST)], [])) is None
        assert outcome(HOST, port) == "open"
        assert outcome(OTHER, port) == "TimeoutError"


def test_filter_program_jumps_stay_in_range_and_end_in_returns() -> None:
    v6 = [bytes(15) + bytes([i]) for i in range(confine.MAX_ADDRESSES)]
    v4 = [bytes([10, 0, 0, i]) for i in range(confine.MAX_ADDRESSES)]
    program = filter_program(v4, v6)
    for at, (code, jt, jf, _) in enumerate(program):
        assert 0 <= jt <= 255 and 0 <= jf <= 255
        if code == 0x15:  # a conditional jump lands on an instruction of the program
            assert at + 1 + max(jt, jf) < len(program)
    assert program[-1] == (0x06, 0, 0, 0xFFFFFFFF) and program[-2] == (0x06, 0, 0, 0)


def test_bare_host_strips_ports_and_brackets() -> None:
    assert confine.bare_host("127.0.0.1:14001") == "127.0.0.1"
    assert confine.bare_host("[::1]:80") == "::1"
    assert confine.bare_host("fd00::2") == "fd00::2"
    assert confine.bare_host("node-3") == "node-3"


# ---------------------------------------------------------------------------- a real engine


@needs_engine
def test_both_listeners_answer_only_on_the_configured_host(two_engines: tuple[MooncakeEngine, MooncakeEngine]) -> None:
    receiver, sender = two_engines
    rpc_port = int(receiver.endpoint.rsplit(":", 1)[1])
    found = receiver.confinement
    # /proc still shows Mooncake's wildcard binds: the handshake on 0.0.0.0:<rpc port>, the data port on [::].
    ours = {item for item in listeners() if item in found.restricted}
    assert ours == set(found.restricted) and len(ours) == 2 and not found.exposed
    handshake = next(item for item in ours if item.port == rpc_port)
    data = next(item for item in ours if item.port != rpc_port)
    assert (handshake.address, data.address) == ("0.0.0.0", "::")
    assert (found.roles[handshake], found.roles[data]) == ("P2P handshake", "TCP data")
    assert found.allowed == (HOST,)
    for item in ours:
        assert outcome(HOST, item.port) == "open"
        assert outcome(OTHER, item.port) == "TimeoutError"
        if socket.has_ipv6 and item.family == socket.AF_INET6:
            assert outcome("::1", item.port) == "TimeoutError"

    # What the handshake hands a stranger that reaches it: every registered buffer.
    buf = np.zeros(1 << 16, dtype=np.uint8)
    receiver.register(int(buf.ctypes.data), buf.nbytes)
    reply = handshake_metadata(HOST, rpc_port)
    assert isinstance(reply, dict) and reply["tcp_data_port"] == data.port
    assert reply["buffers"] == [{"addr": int(buf.ctypes.data), "length": buf.nbytes, "name": receiver.endpoint}]
    assert handshake_metadata(OTHER, rpc_port) == "TimeoutError"

    # ...and a peer that uses the endpoint still writes, through both filtered listeners.
    src = np.arange(buf.nbytes, dtype=np.uint64).astype(np.uint8)
    sender.register(int(src.ctypes.data), src.nbytes)
    offsets = np.arange(16, dtype=np.int64) * 4096
    lengths = np.full(16, 4096, dtype=np.int64)
    sender.write(receiver.endpoint, int(src.ctypes.data) + offsets, int(buf.ctypes.data) + offsets, lengths)
    assert np.array_equal(buf, src)


@needs_engine
def test_restrict_listeners_false_leaves_every_interface_open_without_warning(fresh_warning: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = MooncakeEngine(BackendConfig(host=HOST, options={"restrict_listeners": "false"}))
    try:
        found = engine.confinement
        assert found.deliberate and not found.restricted and len(found.exposed) == 2
        assert all(outcome(OTHER, item.port) == "open" for item in found.exposed)
        assert not [w for w in caught if issubclass(w.category, ExposedListenerWarning)]
    finally:
        engine.close()


@needs_engine
def test_a_host_that_is_not_this_machine_warns_once_naming_ports_and_interfaces(fresh_warning: None) -> None:
    foreign = "203.0.113.7"  # TEST-NET-3: never an address of this machine
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = MooncakeEngine(BackendConfig(host=foreign))
        second = MooncakeEngine(BackendConfig(host=foreign))
    try:
        shown = [w for w in caught if issubclass(w.category, ExposedListenerWarning)]
        assert len(shown) == 1, [str(w.message) for w in shown]
        text = str(shown[0].message)
        for item in first.confinement.exposed:
            assert str(item) in text
        rpc_port = first.endpoint.rsplit(":", 1)[1]
        assert f"0.0.0.0:{rpc_port} (P2P handshake, every IPv4 interface)" in text
        assert "(TCP data, every IPv4 and IPv6 interface)" in text
        assert "is not an address of this machine" in text and foreign in text
        assert len(second.confinement.exposed) == 2  # exposed again, but not warned again
        assert all(outcome(OTHER, item.port) == "open" for item in first.confinement.exposed)
    finally:
        second.close()
        first.close()


@needs_engine
def test_a_wildcard_host_is_taken_at_its_word(fresh_warning: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = MooncakeEngine(BackendConfig(host="0.0.0.0"))
    try:
        assert engine.confinement.deliberate and len(engine.confinement.exposed) == 2
        assert not [w for w in caught if issubclass(w.category, ExposedListenerWarning)]
    finally:
        engine.close()


# ---------------------------------------------------------------------------- no listeners, no /proc, options


def test_an_engine_double_opens_no_listener_and_nothing_is_warned(fresh_warning: None) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = MooncakeEngine(BackendConfig(host=HOST), engine_factory=HostMemoryEngine)
    engine.close()
    assert engine.confinement == confine.Confinement(HOST)
    assert not [w for w in caught if issubclass(w.category, ExposedListenerWarning)]


def test_without_proc_the_check_is_a_no_op(monkeypatch: pytest.MonkeyPatch, fresh_warning: None) -> None:
    monkeypatch.setattr(listening, "supported", lambda: False)
    monkeypatch.setattr(confine, "supported", lambda: False)
    assert listening.listeners() == [] and listening.socket_states() == {}
    with confine.watch() as created, socket.socket() as server:
        server.bind(("0.0.0.0", 0))
        server.listen()
    assert created == []


def test_exposed_listeners_warn_once_per_process(fresh_warning: None) -> None:
    wide = Listener("0.0.0.0", 15999, 1, socket.AF_INET)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            found = confine.confine([wide], host="203.0.113.9", rpc_port=15999, protocol="tcp", restrict=True)
            assert found.exposed == (wide,) and not found.deliberate
    shown = [w for w in caught if issubclass(w.category, ExposedListenerWarning)]
    assert len(shown) == 1 and "0.0.0.0:15999 (P2P handshake, every IPv4 interface)" in str(shown[0].message)


@pytest.mark.parametrize(("given", "expected"), [(True, True), (False, False), ("false", False), (" ON ", True)])
def test_restrict_listeners_option_takes_bools_and_their_strings(given: object, expected: bool) -> None:
    assert (
        MooncakeOptions.from_config(BackendConfig(options={"restrict_listeners": given})).restrict_listeners is expected
    )


@pytest.mark.parametrize("given", [1, "maybe", None])
def test_restrict_listeners_option_refuses_anything_else(given: object) -> None:
    with pytest.raises(ConfigError, match=r"BackendConfig.options\['restrict_listeners'\] must be a bool"):
        MooncakeOptions.from_config(BackendConfig(options={"restrict_listeners": given}))
