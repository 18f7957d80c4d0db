"""The vLLM connector's side channel with a control key: every registration and reply is an authenticated frame.

A man in the middle (``tests/mitm.py``) sits between a decode and the prefill's side channel: a registration
altered on the way, or a genuine one recorded on one connection and replayed on another, is refused by the
prefill, which logs why, closes that connection and keeps serving the others; the decode reports the
request's blocks as load errors and nothing moves. Fast, in one process, no vLLM (as test_vllm_compat.py).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from mitm import UP, Frame, Mitm, Relay, flip_last_digit
from test_vllm_compat import _blocks, _port, _request, _until, local_pair

from kvwire.control import KEY_ENV, ControlClosedError, PeerConnection
from kvwire.hosts.vllm import ConnectorSettings
from kvwire.hosts.vllm.channel import RegistrationServer

KEY = b"0123456789abcdef-the-right-key"
_TAMPERED = (
    "kvwire: side channel to decode at 127.0.0.1:{port} closed: decode at 127.0.0.1:{port} sent frame 0 with a "
    "wrong authentication tag: altered on the way, or not sent by the peer that completed the handshake in this "
    "direction; the connection is closed"
)


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvwire.hosts.vllm" and r.levelno == logging.WARNING]


def test_the_side_channel_refuses_altered_and_replayed_frames_and_serves_the_next_connection(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handled: list[dict[str, Any]] = []

    def handler(message: dict[str, Any]) -> dict[str, Any]:
        handled.append(message)
        return {"accepted": message["n"]}

    def attack(relay: Relay, frame: Frame) -> None:
        if (frame.conn, frame.direction, frame.index) == (1, UP, 0):  # connection 0's first frame, replayed
            relay.send(UP, mitm.lines(0, UP)[0])
        elif (frame.conn, frame.direction, frame.index) == (2, UP, 0):
            relay.send(UP, flip_last_digit(frame.line))
        else:
            relay.forward(frame)

    server = RegistrationServer("127.0.0.1", 0, handler, KEY, 5.0)
    port = int(server.address.rsplit(":", 1)[1])
    mitm = Mitm(("127.0.0.1", port), attack)
    try:
        with caplog.at_level(logging.WARNING, logger="kvwire.hosts.vllm"):
            for conn, n in enumerate((1, 2, 3, 4)):
                channel = PeerConnection("127.0.0.1", mitm.port, what="prefill", timeout_s=5.0, key=KEY)
                try:
                    if conn in (1, 2):
                        with pytest.raises(ControlClosedError, match="closed the connection before answering"):
                            channel.request({"cmd": "register", "n": n})
                    else:
                        assert channel.request({"cmd": "register", "n": n}) == {"accepted": n}
                finally:
                    channel.close()
            _until(lambda: server.connections == 0)
        assert handled == [{"cmd": "register", "n": 1}, {"cmd": "register", "n": 4}]
        ports = [relay.local_port for relay in mitm.relays]
        assert _warnings(caplog) == [_TAMPERED.format(port=ports[1]), _TAMPERED.format(port=ports[2])]
    finally:
        mitm.close()
        server.close()


def test_a_registration_altered_on_the_way_is_refused_and_nothing_moves(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Decode to prefill through the connector's own parts, with a key; only the untouched registration moves KV."""
    monkeypatch.setenv(KEY_ENV, KEY.decode())
    settings = ConnectorSettings.from_extra_config({"backend": "local", "side_channel_port": _port(), "lease_s": 60})
    with local_pair(settings) as (p_sched, d_sched, p_work, d_work, p_caches, d_caches):

        def tamper_first(relay: Relay, frame: Frame) -> None:
            first = (frame.conn, frame.direction, frame.index) == (0, UP, 0)
            relay.send(frame.direction, flip_last_digit(frame.line) if first else frame.line)

        mitm = Mitm(("127.0.0.1", settings.side_channel_port), tamper_first)
        try:
            prefill = _request("p0", 70, {"do_remote_decode": True}, status="FINISHED_LENGTH_CAPPED")
            _, params = p_sched.request_finished(prefill, [1, 2, 3])
            assert params is not None
            p_work.start(p_sched.build_connector_meta(None))
            via_mitm = dict(params, remote_port=mitm.port)
            with caplog.at_level(logging.WARNING, logger="kvwire.hosts.vllm"):
                # the first registration is altered on the way: the prefill refuses it, the decode's blocks fail
                decode = _request("d0", 70, dict(via_mitm))
                assert d_sched.get_num_new_matched_tokens(decode, 0) == (70, True)
                d_sched.update_state_after_alloc(decode, _blocks([6, 4, 5]), 70)
                d_work.start(d_sched.build_connector_meta(None))
                assert _until(lambda: d_work.get_finished()[1]) == {"d0"}
                assert d_work.load_errors() == {4, 5, 6}
                assert d_work.receiver is not None
                assert d_work.receiver.failures == {
                    "d0": "the prefill did not take the registration: the prefill's kvwire side channel at "
                    f"127.0.0.1:{mitm.port} closed the connection before answering"
                }
                assert _warnings(caplog) == [_TAMPERED.format(port=mitm.relays[0].local_port)]
            assert all(not t.any() for t in d_caches.values())
            # the same request registered again, untouched, on a new connection: the prefill serves it
            again = _request("d1", 70, dict(via_mitm))
            assert d_sched.get_num_new_matched_tokens(again, 0) == (70, True)
            d_sched.update_state_after_alloc(again, _blocks([6, 4, 5]), 70)
            d_work.start(d_sched.build_connector_meta(None))
            assert _until(lambda: d_work.get_finished()[1]) == {"d1"}
            assert d_work.load_errors() == set()
            for name in p_caches:
                assert torch.equal(
                    d_caches[name][[6, 4, 5]].view(torch.int16), p_caches[name][[1, 2, 3]].view(torch.int16)
                )
            assert len(mitm.relays) == 2
        finally:
            mitm.close()
