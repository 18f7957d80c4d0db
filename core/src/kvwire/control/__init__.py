"""A bounded JSON-lines control channel between the two sides of a transfer (peer descriptions, commands).

The bench's decode process and the contract kit's receivers speak it: one JSON
object per line, no pickle on the wire; over a child's stdin/stdout
(:class:`ChildProcess`) or a TCP connection to another machine
(:class:`PeerConnection`, authenticated by a shared key:
:mod:`kvwire.control.auth`, then every frame after the handshake carries a
sequence number and an HMAC tag: :mod:`kvwire.control.frames`). The other end may be buggy or hostile, so the parent
reads bytes on demand with a deadline, a line length, a buffer size and a
nesting depth (:mod:`kvwire.control.jsonlines`): whatever the peer does ends in one
:class:`ControlError` naming it, never a hang or unbounded memory. After a
protocol violation the channel is poisoned (every later call raises the same
error). A peer reports its own failure as ``{"error": "..."}``.
"""

from kvwire.control.auth import KEY_ENV, load_key
from kvwire.control.channel import Channel
from kvwire.control.errors import (
    ControlAuthError,
    ControlClosedError,
    ControlError,
    ControlProtocolError,
    ControlTimeoutError,
)
from kvwire.control.network import PeerConnection, accept_one, check_listen_key, parse_address
from kvwire.control.process import ChildProcess
from kvwire.control.serving import Handler, claim_stdout, read_command, reply, serve

__all__ = [
    "KEY_ENV",
    "Channel",
    "ChildProcess",
    "ControlAuthError",
    "ControlClosedError",
    "ControlError",
    "ControlProtocolError",
    "ControlTimeoutError",
    "Handler",
    "PeerConnection",
    "accept_one",
    "check_listen_key",
    "claim_stdout",
    "load_key",
    "parse_address",
    "read_command",
    "reply",
    "serve",
]
