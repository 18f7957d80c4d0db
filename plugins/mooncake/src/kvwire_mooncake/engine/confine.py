"""Making an engine kvwire creates accept connections only on ``BackendConfig.host``, or saying it does not.

Mooncake 0.3.13 binds its P2P handshake listener to ``0.0.0.0`` (``::`` with
``MC_USE_IPV6``) and its TCP data listener to ``::`` dual-stack (every IPv4 and
IPv6 address), whatever host it is given; no variable or argument changes that
(``MC_TCP_BIND_ADDRESS`` only changes the address it *advertises* through a
metadata server). The handshake hands anyone the address and length of every
registered buffer, and the data port writes into them without authentication.

A listening socket cannot be re-bound, but it can be given a socket filter: a
classic BPF program attached with ``SO_ATTACH_FILTER`` (unprivileged, Linux)
runs on every packet the socket receives, SYNs included, and drops those not
addressed to one of the host's addresses. Accepted connections inherit it.
Connections to any other address of the machine (another interface, or
``127.0.0.2`` when the host is ``127.0.0.1``) then go unanswered as if
firewalled, which is what ``bind(host)`` would give, except that a refused
SYN is dropped rather than reset. ``/proc`` still lists the sockets as bound to
the wildcard address.

Only Mooncake's listeners are filtered: those that appear while kvwire creates
an engine (creation is serialised by :func:`watch`), the handshake one by its
port (``get_rpc_port()``) and, for the ``tcp`` protocol, the single other new
one. When that cannot be done (not Linux, a host that is not an address of this
machine, an unrecognised extra listener, the kernel refusing the filter) the
engine stays reachable on every interface and :class:`ExposedListenerWarning`
says so once per process, naming the ports.
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import threading
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Final

from kvwire_mooncake.engine.listening import Listener, listeners, socket_fds, supported

__all__ = [
    "Confinement",
    "ExposedListenerWarning",
    "bare_host",
    "confine",
    "filter_program",
    "host_addresses",
    "watch",
]

#: ``SO_ATTACH_FILTER`` (asm-generic/socket.h; every Linux architecture but parisc). Python does not export it.
SO_ATTACH_FILTER: Final = getattr(socket, "SO_ATTACH_FILTER", 26)
#: Classic BPF offset of the network header, for a filter that runs with the data at the TCP header.
_SKF_NET_OFF: Final = -0x100000
_LD_B_ABS, _LD_W_ABS, _RSH_K, _JEQ_K, _RET_K = 0x30, 0x20, 0x74, 0x15, 0x06
#: At most this many addresses per family: classic BPF jumps reach 255 instructions.
MAX_ADDRESSES: Final = 16
_WILDCARD_HOSTS: Final = frozenset({"", "0.0.0.0", "::", "*"})  # noqa: S104 - recognised, never bound

_CREATION_LOCK: Final = threading.RLock()
_WARN_LOCK: Final = threading.Lock()
_warned = False


class ExposedListenerWarning(UserWarning):
    """A Mooncake engine kvwire created accepts connections on more addresses than ``BackendConfig.host``.

    Shown at most once per process. Silence it with
    ``warnings.filterwarnings("ignore", category=ExposedListenerWarning)`` once
    the ports are firewalled (see the kvwire-mooncake README, "Security").
    """


@dataclass(frozen=True)
class Confinement:
    """Where one engine's listeners accept connections.

    ``restricted``: listeners filtered to ``allowed`` (the host's addresses).
    ``exposed``: listeners still answering on every interface, with ``reason``;
    ``deliberate`` when the configuration asked for that (a wildcard host, or
    ``options['restrict_listeners']`` False), in which case no warning is shown.
    """

    host: str
    allowed: tuple[str, ...] = ()
    restricted: tuple[Listener, ...] = ()
    exposed: tuple[Listener, ...] = ()
    reason: str = ""
    deliberate: bool = False
    roles: dict[Listener, str] = field(default_factory=dict, compare=False, hash=False)


def bare_host(host: str) -> str:
    """``host`` without a port or IPv6 brackets (``"[::1]:80"`` -> ``"::1"``, ``"h:80"`` -> ``"h"``)."""
    if host.startswith("["):
        return host[1 : host.index("]")] if "]" in host else host[1:]
    if host.count(":") == 1:
        return host.split(":", 1)[0]
    return host


def _is_local(family: int, sockaddr: tuple[str, int] | tuple[str, int, int, int]) -> bool:
    """Whether this machine owns the address: a socket can be bound to it."""
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.bind((sockaddr[0], 0, *sockaddr[2:]))
    except OSError:  # EADDRNOTAVAIL: not ours; anything else: do not filter on a guess
        return False
    return True


def host_addresses(host: str) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """The IPv4 and IPv6 addresses of this machine that ``host`` resolves to, packed (network order).

    An IPv4-mapped IPv6 address counts as its IPv4 address (such packets are
    IPv4 on the wire). Raises OSError if ``host`` does not resolve.
    """
    v4: dict[bytes, None] = {}
    v6: dict[bytes, None] = {}
    for family, _, _, _, sockaddr in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
        if family not in (socket.AF_INET, socket.AF_INET6) or not isinstance(sockaddr[0], str):
            continue
        if not _is_local(family, sockaddr):
            continue
        packed = socket.inet_pton(family, sockaddr[0].split("%", 1)[0])
        if family == socket.AF_INET6 and packed[:12] == b"\0" * 10 + b"\xff\xff":
            v4[packed[12:]] = None
        elif family == socket.AF_INET6:
            v6[packed] = None
        else:
            v4[packed] = None
    return tuple(v4)[:MAX_ADDRESSES], tuple(v6)[:MAX_ADDRESSES]


def filter_program(v4: Sequence[bytes], v6: Sequence[bytes]) -> list[tuple[int, int, int, int]]:
    """A classic BPF program accepting only IPv4/IPv6 packets whose destination is in ``v4`` / ``v6``.

    Instructions ``(code, jt, jf, k)``: load the IP version from the network
    header; for IPv4 compare the destination word, for IPv6 the four words of
    the destination; return 0 (drop) or 0xFFFFFFFF (keep the whole packet).
    """
    code: list[tuple[int, int | str, int | str, int]] = []
    labels: dict[str, int] = {}

    def emit(op: int, k: int, jt: int | str = 0, jf: int | str = 0) -> None:
        code.append((op, jt, jf, k & 0xFFFFFFFF))

    emit(_LD_B_ABS, _SKF_NET_OFF)
    emit(_RSH_K, 4)
    emit(_JEQ_K, 4, 0, "v6")
    emit(_LD_W_ABS, _SKF_NET_OFF + 16)  # IPv4 destination
    for address in v4:
        emit(_JEQ_K, int.from_bytes(address, "big"), "accept", 0)
    emit(_RET_K, 0)
    labels["v6"] = len(code)
    emit(_JEQ_K, 6, 0, "drop")
    for i, address in enumerate(v6):
        for word in range(4):  # IPv6 destination: bytes 24..40 of the header
            emit(_LD_W_ABS, _SKF_NET_OFF + 24 + 4 * word)
            value = int.from_bytes(address[4 * word : 4 * word + 4], "big")
            emit(_JEQ_K, value, "accept" if word == 3 else 0, f"next{i}")
        labels[f"next{i}"] = len(code)
    labels["drop"] = len(code)
    emit(_RET_K, 0)
    labels["accept"] = len(code)
    emit(_RET_K, 0xFFFFFFFF)

    def offset(at: int, target: int | str) -> int:
        return labels[target] - at - 1 if isinstance(target, str) else target

    return [(op, offset(i, jt), offset(i, jf), k) for i, (op, jt, jf, k) in enumerate(code)]


class _SockFprog(ctypes.Structure):
    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def _attach(listener: Listener, program: list[tuple[int, int, int, int]]) -> str | None:
    """Attach ``program`` to the listener's socket; None, or why not."""
    fd = socket_fds().get(listener.inode)
    if fd is None:
        return f"{listener} is no longer open"
    raw = b"".join(struct.pack("=HBBI", *insn) for insn in program)
    buffer = ctypes.create_string_buffer(raw, len(raw))
    fprog = _SockFprog(len(program), ctypes.addressof(buffer))
    try:
        if os.fstat(fd).st_ino != listener.inode:
            return f"{listener} is no longer open"
        sock = socket.socket(fileno=fd)
    except OSError as exc:
        return f"cannot reach the socket of {listener}: {exc}"
    try:  # the fd stays the engine's: detached below, never closed here
        if not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) or sock.getsockname()[1] != listener.port:
            return f"{listener} is no longer listening"
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, bytes(fprog))
    except OSError as exc:
        return f"the kernel refused a socket filter on {listener}: {exc}"
    finally:
        sock.detach()
    return None


@contextmanager
def watch() -> Iterator[list[Listener]]:
    """Serialise engine creation; the list yielded receives the listeners opened inside the block."""
    created: list[Listener] = []
    with _CREATION_LOCK:
        before = {item.inode for item in listeners()} if supported() else set()
        try:
            yield created
        finally:
            if supported():
                created.extend(item for item in listeners() if item.inode not in before)


def _interfaces(listener: Listener) -> str:
    if listener.family == socket.AF_INET:
        return "every IPv4 interface"
    fd = socket_fds().get(listener.inode)
    v6only = 1
    if fd is not None:
        with suppress(OSError):
            sock = socket.socket(fileno=fd)
            try:
                v6only = sock.getsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY)
            finally:
                sock.detach()
    return "every IPv6 interface" if v6only else "every IPv4 and IPv6 interface"


def _warn_once(confinement: Confinement) -> None:
    global _warned
    with _WARN_LOCK:
        if _warned:
            return
        _warned = True
    ports = ", ".join(
        f"{item} ({confinement.roles.get(item, 'listener')}, {_interfaces(item)})" for item in confinement.exposed
    )
    with suppress(OSError):
        names = ", ".join(name for _, name in socket.if_nameindex())
    message = (
        f"kvwire-mooncake: BackendConfig.host is {confinement.host!r}, but the Mooncake engine accepts "
        f"connections on {ports}: {confinement.reason}. Whoever reaches these ports can read the address "
        f"and length of every registered buffer from the handshake and write into them through the data "
        f"port (no authentication). Interfaces here: {names or 'unknown'}. Keep the ports on a private "
        f"network or firewall them (kvwire-mooncake README, 'Security'). Shown once per process."
    )
    warnings.warn(message, ExposedListenerWarning, stacklevel=4)


def confine(
    created: Sequence[Listener], *, host: str, rpc_port: int, protocol: str, restrict: bool, warn: bool = True
) -> Confinement:
    """Filter the engine's new wildcard listeners to ``host``'s addresses; warn once if some stay exposed.

    ``created``: the listeners :func:`watch` saw appear while the engine was
    created. The handshake listener is the one on ``rpc_port``; with the
    ``tcp`` protocol the single other one is the data listener. Anything else
    is not touched (and reported as exposed).
    """
    roles: dict[Listener, str] = {}
    others = [item for item in created if item.port != rpc_port]
    for item in created:
        if item.port == rpc_port:
            roles[item] = "P2P handshake"
        elif protocol == "tcp" and len(others) == 1:
            roles[item] = "TCP data"
        else:
            roles[item] = "unrecognised listener"
    wide = tuple(item for item in created if item.wildcard)
    name = bare_host(host)
    if not wide:
        return Confinement(host, roles=roles)
    if name in _WILDCARD_HOSTS:
        return Confinement(host, exposed=wide, reason="the host is a wildcard address", deliberate=True, roles=roles)
    if not restrict:
        reason = "BackendConfig.options['restrict_listeners'] is False"
        return Confinement(host, exposed=wide, reason=reason, deliberate=True, roles=roles)
    try:
        v4, v6 = host_addresses(name)
    except OSError as exc:
        v4, v6 = (), ()
        reason = f"{name!r} does not resolve ({exc})"
    else:
        reason = f"{name!r} is not an address of this machine (a NAT or advertised address?)"
    allowed = tuple(socket.inet_ntop(socket.AF_INET, a) for a in v4) + tuple(
        socket.inet_ntop(socket.AF_INET6, a) for a in v6
    )
    restricted: list[Listener] = []
    exposed: list[Listener] = []
    reasons: list[str] = []
    program = filter_program(v4, v6)
    for item in wide:
        if not allowed:
            problem: str | None = reason
        elif roles[item] == "unrecognised listener":
            problem = f"{item} was opened during engine creation but is not recognisably Mooncake's"
        else:
            problem = _attach(item, program)
        if problem is None:
            restricted.append(item)
        else:
            exposed.append(item)
            reasons.append(problem)
    result = Confinement(
        host, allowed, tuple(restricted), tuple(exposed), "; ".join(dict.fromkeys(reasons)), roles=roles
    )
    if result.exposed and warn:
        _warn_once(result)
    return result
