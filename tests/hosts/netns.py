"""Hosts of their own on one machine: network namespaces on a bridge, joined by veth pairs (iproute2, root).

``Network(["prefill", "decode", "probe"])`` makes one namespace per host, each with a veth whose peer is on a
bridge in the root namespace (which gets the bridge's address, so the test process and sglang's router reach
every host). Addresses are private (``10.203.<n>.0/24``) and every name carries a random tag, so parallel runs do
not meet. :meth:`Network.close` removes what it made. :func:`unavailable` says why a machine refuses it.
"""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Sequence

__all__ = ["Network", "unavailable"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """None when ``ip netns`` works here, else the reason (not root, no iproute2, a sandbox that refuses it)."""
    name = f"kvwprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except FileNotFoundError:
        return "no `ip` command (Debian's iproute2)"
    except subprocess.CalledProcessError as exc:
        return f"`ip netns add` refused: {exc.stderr.strip()}"
    _ip("netns", "del", name)
    return None


class Network:
    """Namespaces ``kvw<tag><i>`` on bridge ``kvwbr<tag>``; ``address[host]`` is each host's bridge address."""

    def __init__(self, hosts: Sequence[str]) -> None:
        self.tag = secrets.token_hex(3)
        subnet = 10 + secrets.randbelow(240)
        self.bridge = f"kvwbr{self.tag}"
        self.gateway = f"10.203.{subnet}.1"
        self.namespace: dict[str, str] = {}
        self.device: dict[str, str] = {}  # the veth inside each namespace
        self.address: dict[str, str] = {}
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, host in enumerate(hosts):
                ns, outside, inside = f"kvw{self.tag}{i}", f"kvw{self.tag}{i}o", f"kvw{self.tag}{i}i"
                _ip("netns", "add", ns)
                self.namespace[host] = ns
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", ns)
                _ip("link", "set", outside, "master", self.bridge, "up")
                address = f"10.203.{subnet}.{i + 2}"
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", inside)
                _ip("-n", ns, "link", "set", inside, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                self.device[host], self.address[host] = inside, address
        except BaseException:
            self.close()
            raise

    def run(self, host: str, argv: Sequence[str], timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
        """``argv`` inside ``host``'s namespace."""
        return subprocess.run(
            ["ip", "netns", "exec", self.namespace[host], *argv],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )

    def shape(self, host: str, rate: str) -> None:
        """Limit what ``host`` sends to ``rate`` (``tc ... htb``; this kernel has no netem for latency)."""
        dev = self.device[host]
        ns = self.namespace[host]
        tc = ["ip", "netns", "exec", ns, "tc"]
        subprocess.run(
            [*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb", "default", "10"],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip
        subprocess.run(
            [*tc, "class", "replace", "dev", dev, "parent", "1:", "classid", "1:10", "htb", "rate", rate, "ceil", rate],
            check=True, capture_output=True, timeout=30,
        )  # fmt: skip

    def listening(self, host: str) -> list[tuple[str, int]]:
        """The TCP (address, port) pairs ``host`` listens on (``ss -ltnH``)."""
        out = self.run(host, ["ss", "-ltnH"]).stdout
        found = []
        for line in out.splitlines():
            local = line.split()[3]
            address, _, port = local.rpartition(":")
            found.append((address.strip("[]"), int(port)))
        return sorted(set(found))

    def close(self) -> None:
        for ns in self.namespace.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30, check=False)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30, check=False)
