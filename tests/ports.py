"""Free TCP ports for tests that need a run of consecutive ones (a side channel at ``port + rank``).

``bind(("127.0.0.1", 0))`` hands out one ephemeral port; the next one up may be taken at any moment by
another process's outgoing connection (ephemeral ports are 32768-60999 on Linux). So a run is drawn
below that range and each of its ports is checked by binding it.
"""

from __future__ import annotations

import random
import socket

__all__ = ["free_port_run"]

_LOW, _HIGH = 20000, 32000  # below Linux's ephemeral range


def free_port_run(count: int = 1) -> int:
    """The first of ``count`` consecutive ports on 127.0.0.1 that were all free just now."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(_LOW, _HIGH - count)
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                sockets.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
        return base
    raise RuntimeError(f"no run of {count} free ports found in {_LOW}..{_HIGH}")
