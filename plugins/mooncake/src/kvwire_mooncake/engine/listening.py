"""This process's listening TCP sockets, read from ``/proc`` (Linux only; empty elsewhere).

``/proc/net/tcp`` and ``/proc/net/tcp6`` list every TCP socket of the network
namespace; the ones this process owns are those whose inode appears as a
``socket:[inode]`` link under ``/proc/self/fd``. A socket in state ``0A``
(``TCP_LISTEN``) is a listener. Mooncake opens two per engine and says where
in neither its API nor its log, so this is how kvwire finds them
(:mod:`kvwire_mooncake.engine.confine`), and how its tests check them.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from collections.abc import Iterable
from contextlib import suppress
from dataclasses import dataclass
from typing import Final

__all__ = ["Listener", "listeners", "socket_fds", "socket_states", "supported"]

_TABLES: Final = (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6))
_TCP_LISTEN: Final = "0A"
#: ``include/net/tcp_states.h``, as ``/proc/net/tcp`` prints them (hex).
_STATES: Final = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
    "0C": "NEW_SYN_RECV",
}
_WILDCARDS: Final = frozenset({"0.0.0.0", "::"})  # noqa: S104 - recognised, never bound


@dataclass(frozen=True, order=True)
class Listener:
    """One listening socket of this process: the address it is bound to, its port and socket inode."""

    address: str
    port: int
    inode: int
    family: int

    @property
    def wildcard(self) -> bool:
        """Bound to every address (``0.0.0.0`` or ``::``), not to one."""
        return self.address in _WILDCARDS

    def __str__(self) -> str:
        return f"[{self.address}]:{self.port}" if self.family == socket.AF_INET6 else f"{self.address}:{self.port}"


def supported() -> bool:
    """Whether this process can list its sockets (Linux with ``/proc`` mounted)."""
    return sys.platform.startswith("linux") and os.path.isdir("/proc/self/fd") and os.path.exists(_TABLES[0][0])


def socket_fds() -> dict[int, int]:
    """``{socket inode: file descriptor}`` for every socket this process has open (empty off Linux)."""
    found: dict[int, int] = {}
    with suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            with suppress(OSError, ValueError):
                link = os.readlink(f"/proc/self/fd/{name}")
                if link.startswith("socket:[") and link.endswith("]"):
                    found.setdefault(int(link[8:-1]), int(name))
    return found


def _address(hex_address: str, family: int) -> str:
    """The text form of a ``/proc/net/tcp*`` address: 32-bit words in host byte order, as hex."""
    words = [int(hex_address[i : i + 8], 16) for i in range(0, len(hex_address), 8)]
    return socket.inet_ntop(family, struct.pack(f"={len(words)}I", *words))


def _fields(path: str) -> Iterable[list[str]]:
    """The rows of one ``/proc/net/tcp*`` table, split (nothing if it cannot be read)."""
    try:
        with open(path, encoding="ascii") as table:
            lines = table.read().splitlines()[1:]
    except OSError:
        return
    for line in lines:
        fields = line.split()
        if len(fields) >= 10:
            yield fields


def _rows(path: str, family: int) -> Iterable[Listener]:
    for fields in _fields(path):
        if fields[3] != _TCP_LISTEN:
            continue
        with suppress(ValueError, OSError):
            hex_address, hex_port = fields[1].rsplit(":", 1)
            yield Listener(_address(hex_address, family), int(hex_port, 16), int(fields[9]), family)


def listeners() -> list[Listener]:
    """This process's listening TCP sockets (IPv4 and IPv6), sorted; empty where /proc is not there."""
    if not supported():
        return []
    mine = socket_fds()
    return sorted(row for path, family in _TABLES for row in _rows(path, family) if row.inode in mine)


def socket_states() -> dict[str, int]:
    """How many of this process's TCP sockets are in each state (``{"CLOSE_WAIT": 12, ...}``; empty off Linux)."""
    if not supported():
        return {}
    mine = socket_fds()
    counts: dict[str, int] = {}
    for path, _ in _TABLES:
        for fields in _fields(path):
            if fields[9].isdigit() and int(fields[9]) in mine:
                state = _STATES.get(fields[3], fields[3])
                counts[state] = counts.get(state, 0) + 1
    return counts
