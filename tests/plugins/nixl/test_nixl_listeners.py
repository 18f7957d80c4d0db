"""kvwire-nixl's network exposure: UCX listens only on the interface of BackendConfig.host (issue 23, defect 7).

Without it, each NIXL agent had two UCX TCP listeners on the machine's external address, open to anyone.
The check runs in a fresh process (UCX reads its environment once) and lists that process's listening
sockets from /proc; it then connects to those ports from the machine's other address, and moves bytes.
"""

from __future__ import annotations

import fcntl
import json
import socket
import struct
import subprocess
import sys

import pytest

from kvwire_nixl.locate import nixl_availability

if (_reason := nixl_availability()) is not None:
    pytest.skip(f"kvwire-nixl cannot run here: {_reason}", allow_module_level=True)

pytestmark = pytest.mark.slow

CHILD = r"""
import json, os, sys
import numpy as np
import kvwire
from kvwire.testing.receiver import LayoutSpec

config = kvwire.BackendConfig(host=sys.argv[1], process_settings=True)
spec = LayoutSpec("mha", (0,), 8, 4096)
src, dst = spec.allocate(1), spec.allocate(2)
sender, receiver = kvwire.connect("nixl", config), kvwire.connect("nixl", config)
sender.register_kv_buffers(src.layout)
receiver.register_kv_buffers(dst.layout)
sender.add_peer(receiver.endpoint(), dst.layout)
ids = np.arange(4, dtype=np.int32)
moved = sender.send_kvcache(receiver.endpoint(), ids, [b.base for b in dst.layout.buffers], ids[::-1].copy())
same = all((d[3 - k] == s[k]).all() for s, d in zip(src.views, dst.views) for k in range(4))

inodes = set()
for fd in os.listdir("/proc/self/fd"):
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:  # the descriptor of the listing itself, closed by now
        continue
    if target.startswith("socket:["):
        inodes.add(target[8:-1])
listening = []
for family in ("tcp", "tcp6"):
    for line in open(f"/proc/self/net/{family}").read().splitlines()[1:]:
        f = line.split()
        if f[3] == "0A" and f[9] in inodes:
            listening.append([family, f[1].split(":")[0], int(f[1].split(":")[1], 16)])
ucx = os.environ.get("UCX_NET_DEVICES")
print(json.dumps({"listening": listening, "moved": moved, "same": bool(same), "ucx": ucx}))
sys.stdout.flush()
sys.stdin.read()  # keep the listeners up while the parent tries them
sender.close(); receiver.close()
"""


def _external_address() -> str | None:
    """The IPv4 address of an interface other than loopback, if the machine has one."""
    for _, name in socket.if_nameindex():
        if name == "lo":
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                raw = fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))  # SIOCGIFADDR
            except OSError:
                continue
        return socket.inet_ntoa(raw[20:24])
    return None


def test_ucx_listens_only_on_the_interface_of_backend_config_host() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "127.0.0.1"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout is not None
        report = json.loads(child.stdout.readline())
        assert report["ucx"] == "lo"
        assert report["moved"] == 4 * 4096 * 2 and report["same"]
        assert report["listening"], "no UCX listener found: the check would prove nothing"
        assert {address for _, address, _ in report["listening"]} == {"0100007F"}  # 127.0.0.1 only
        external = _external_address()
        if external is not None:  # from the machine's other address, every port is closed
            for _, _, port in report["listening"]:
                with pytest.raises(ConnectionRefusedError):
                    socket.create_connection((external, port), timeout=5).close()
    finally:
        child.kill()
        child.wait(30)
