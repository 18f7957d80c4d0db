"""Mutual HMAC challenge-response for a control channel that crosses TCP.

Like :mod:`multiprocessing.connection`'s authkey handshake, both ways, before
any command: the server (the side that listens) sends a random nonce, the
client answers ``HMAC-SHA256(key, "kvwire-control client" + server nonce)`` and
its own nonce, the server checks it and answers
``HMAC-SHA256(key, "kvwire-control server" + server nonce + client nonce)``,
which the client checks. Only then is a command sent. The key never crosses
the wire; the labels keep one side's answer from being replayed as the other's.
With a key, every line after the handshake is a frame with a sequence number
and a tag under a session key derived from the key and both nonces
(:mod:`kvwire.control.frames`); the handshakes return that framing. The hello
carries the protocol version (2: per-frame tags); a client refuses a server of
another version at the hello, naming both versions, so both sides must run the
same kvwire.

The key comes from ``--control-key-file FILE`` or the environment variable
``KVWIRE_CONTROL_KEY`` (:func:`load_key`). A server without a key says so in
its hello (``"challenge": null``) and is accepted only by a client without a
key: a client that has one never downgrades. A wrong or missing key ends the
connection with :class:`ControlAuthError` naming the peer, before any data.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
from typing import Any

from kvwire.control.errors import ControlAuthError
from kvwire.control.frames import FrameAuth, session_key
from kvwire.control.jsonlines import LineError, parse_object
from kvwire.errors import ConfigError

__all__ = [
    "KEY_ENV",
    "MIN_KEY_BYTES",
    "client_handshake",
    "is_loopback",
    "load_key",
    "server_handshake",
]

#: The environment variable holding the control key (text; its UTF-8 bytes are the key).
KEY_ENV = "KVWIRE_CONTROL_KEY"
#: The shortest control key accepted from an operator (``load_key``): 16 bytes, 128 bits if random.
MIN_KEY_BYTES = 16
#: Version tag of the hello line (2: every line after the handshake is an authenticated frame).
_PROTOCOL = 2
_NONCE_BYTES = 32
_MAX_LINE = 1024  # a handshake line is ~200 bytes
_CLIENT = b"kvwire-control client"
_SERVER = b"kvwire-control server"
_NOT_PEER = "not a kvwire control peer"


def load_key(key_file: str | None, what: str = "--control-key-file") -> bytes | None:
    """The control key: ``key_file``'s bytes (trailing whitespace dropped), else ``$KVWIRE_CONTROL_KEY``, else None.

    ConfigError naming ``what`` (or the variable) for an unreadable or empty key, or one shorter than
    :data:`MIN_KEY_BYTES` (a short secret is guessed offline from one recorded handshake).
    """
    if key_file is not None:
        try:
            with open(key_file, "rb") as f:
                key = f.read(1 << 16).rstrip()
        except OSError as exc:
            raise ConfigError(f"{what} {key_file!r} cannot be read: {exc.strerror or exc}") from None
        if not key:
            raise ConfigError(f"{what} {key_file!r} is empty; put a random secret in it (e.g. `openssl rand -hex 32`)")
        return _long_enough(key, f"{what} {key_file!r}")
    text = os.environ.get(KEY_ENV)
    if text is None:
        return None
    if not text.strip():
        raise ConfigError(f"{KEY_ENV} is set but empty; set it to a random secret or unset it")
    return _long_enough(text.strip().encode(), KEY_ENV)


def _long_enough(key: bytes, where: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(
            f"{where} holds a key of {len(key)} bytes; a control key needs at least {MIN_KEY_BYTES} "
            "(e.g. `openssl rand -hex 32`, the same on both sides)"
        )
    return key


def is_loopback(host: str) -> bool:
    """True for a loopback address or ``localhost`` (reachable from this machine only)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _mac(key: bytes, label: bytes, *nonces: bytes) -> str:
    return hmac.new(key, label + b"".join(nonces), hashlib.sha256).hexdigest()


def _send(sock: socket.socket, message: dict[str, Any]) -> None:
    sock.sendall((json.dumps(message, separators=(",", ":")) + "\n").encode())


def _read(sock: socket.socket, peer: str, deadline_s: float) -> dict[str, Any]:
    """One handshake line, byte by byte (nothing past its newline is consumed), bounded and with a deadline."""
    sock.settimeout(deadline_s)
    line = bytearray()
    try:
        while not line.endswith(b"\n"):
            byte = sock.recv(1)
            if not byte:
                raise ControlAuthError(f"{peer} closed the connection during the control-key handshake")
            line += byte
            if len(line) > _MAX_LINE:
                raise ControlAuthError(f"{peer} sent a handshake line over {_MAX_LINE} bytes: {_NOT_PEER}")
    except TimeoutError:
        raise ControlAuthError(f"{peer} did not complete the control-key handshake within {deadline_s:g} s") from None
    except OSError as exc:
        raise ControlAuthError(f"{peer}: the control-key handshake failed: {exc}") from None
    finally:
        sock.settimeout(None)
    try:
        return parse_object(bytes(line[:-1]), 4)
    except LineError as exc:
        raise ControlAuthError(f"{peer} sent {exc} during the control-key handshake: {_NOT_PEER}") from None


def _hex(message: dict[str, Any], name: str, peer: str) -> bytes:
    value = message.get(name)
    try:
        if isinstance(value, str) and len(value) <= 2 * 64:
            return bytes.fromhex(value)
    except ValueError:
        pass
    raise ControlAuthError(f"{peer} sent no valid {name!r} in the control-key handshake: not a kvwire control peer")


def server_handshake(sock: socket.socket, key: bytes | None, peer: str, timeout_s: float = 30.0) -> FrameAuth | None:
    """The listening side: challenge the client that connected from ``peer``; ControlAuthError if it fails.

    Returns the framing of every later line (None without a key).
    """
    try:
        if key is None:
            _send(sock, {"kvwire_control": _PROTOCOL, "challenge": None})
            return None
        nonce = secrets.token_bytes(_NONCE_BYTES)
        _send(sock, {"kvwire_control": _PROTOCOL, "challenge": nonce.hex()})
        answer = _read(sock, peer, timeout_s)
        if "error" in answer:
            raise ControlAuthError(f"{peer} refused the control-key handshake: {str(answer['error'])[:300]}")
        response = _hex(answer, "response", peer)
        if not hmac.compare_digest(response.hex(), _mac(key, _CLIENT, nonce)):
            _send(sock, {"error": "authentication failed: wrong control key"})
            raise ControlAuthError(f"{peer} answered the control-key challenge with a wrong key")
        theirs = _hex(answer, "challenge", peer)
        if len(theirs) < 16:
            raise ControlAuthError(f"{peer} sent a challenge of {len(theirs)} bytes, under 16")
        _send(sock, {"response": _mac(key, _SERVER, nonce, theirs)})
        return FrameAuth(session_key(key, nonce, theirs), server=True, peer=peer)
    except OSError as exc:
        raise ControlAuthError(f"{peer}: the control-key handshake failed: {exc}") from None


def client_handshake(sock: socket.socket, key: bytes | None, peer: str, timeout_s: float = 30.0) -> FrameAuth | None:
    """The connecting side: answer ``peer``'s challenge and check its answer; ControlAuthError if it fails.

    Returns the framing of every later line (None when neither side has a key).
    """
    try:
        hello = _read(sock, peer, timeout_s)
        version = hello.get("kvwire_control")
        if isinstance(version, int) and not isinstance(version, bool) and version != _PROTOCOL:
            raise ControlAuthError(
                f"{peer} speaks kvwire control protocol version {version}, this side version {_PROTOCOL} (every "
                "frame after the handshake authenticated): run the same kvwire version on both sides"
            )
        if version != _PROTOCOL:
            raise ControlAuthError(
                f"{peer} did not open with a kvwire control hello (version {_PROTOCOL}): not a kvwire control peer"
            )
        if hello.get("challenge") is None:
            if key is not None:
                raise ControlAuthError(
                    f"{peer} does not authenticate (it has no control key) but this side has one: refusing to "
                    f"connect unauthenticated; give the decode side the same key ({KEY_ENV} or --control-key-file)"
                )
            return None
        nonce = _hex(hello, "challenge", peer)
        if key is None:
            _send(sock, {"error": "no control key on the connecting side"})
            raise ControlAuthError(
                f"{peer} requires a control key: set {KEY_ENV} or pass --control-key-file with the decode side's key"
            )
        mine = secrets.token_bytes(_NONCE_BYTES)
        _send(sock, {"response": _mac(key, _CLIENT, nonce), "challenge": mine.hex()})
        answer = _read(sock, peer, timeout_s)
        if "error" in answer:
            raise ControlAuthError(f"{peer} refused the control key: {str(answer['error'])[:300]}")
        if not hmac.compare_digest(_hex(answer, "response", peer).hex(), _mac(key, _SERVER, nonce, mine)):
            raise ControlAuthError(f"{peer} answered the control-key challenge with a wrong key")
        return FrameAuth(session_key(key, nonce, mine), server=False, peer=peer)
    except OSError as exc:
        raise ControlAuthError(f"{peer}: the control-key handshake failed: {exc}") from None
