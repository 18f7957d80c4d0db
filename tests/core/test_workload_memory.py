"""The bench's and the contract kit's host KV memory: private mappings that may use huge pages.

A cross-process copy (UCX ``cma``) pins every destination page it writes, and
4 KiB pages cost kvwire-nixl about a quarter of its throughput on the CI
machine (``bench/nixl_ceiling.py``). A shared anonymous mapping is shmem and
gets no transparent huge pages by default, so the mapping must be private and
advised. Checked in the kernel's own account of the mapping (``smaps``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from kvwire.workload.memory import allocate

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")


def _mapping_of(address: int) -> dict[str, str]:
    """The ``smaps`` entry of the mapping holding ``address``: its header fields and its key: value lines."""
    entry: dict[str, str] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()
        if "-" in head[0] and len(head) >= 5 and ":" not in head[0]:  # a mapping's header line
            if entry is not None:
                break
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            if lo <= address < hi:
                entry = {"perms": head[1]}
        elif entry is not None and ":" in line:
            key, _, value = line.partition(":")
            entry[key.strip()] = value.strip()
    assert entry is not None, f"no mapping holds {address:#x}"
    return entry


def _thp_advisable() -> bool:
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return enabled.exists() and "[never]" not in enabled.read_text()


@pytest.mark.parametrize("backing", ["numpy", "torch"])
def test_host_buffers_are_private_mappings_advised_to_use_huge_pages(backing: str) -> None:
    if backing == "torch":
        pytest.importorskip("torch")
    memory = allocate([(0, "k", "host"), (0, "v", "host")], 64, 32768, backing=backing)  # 2 MiB per buffer
    for i, buf in enumerate(memory.layout.buffers):
        entry = _mapping_of(buf.base)
        assert entry["perms"][3] == "p", f"buffer {i} is in a shared mapping ({entry['perms']}): shmem, no THP"
        if _thp_advisable():
            assert "hg" in entry.get("VmFlags", "").split(), f"buffer {i} is not advised MADV_HUGEPAGE: {entry}"
        assert memory.views[i].ctypes.data == buf.base
        if backing == "torch":
            assert memory.tensors[i].data_ptr() == buf.base  # the tensor is a view of that very mapping


def test_a_torch_host_buffer_and_its_numpy_view_are_one_memory() -> None:
    pytest.importorskip("torch")
    memory = allocate([(0, "k", "host")], 8, 4096, backing="torch")
    memory.tensors[0][3].fill_(7)
    assert memory.views[0][3].tolist() == [7] * 4096
    memory.views[0][5] = np.arange(4096) % 251
    assert memory.tensors[0][5].tolist() == (np.arange(4096) % 251).tolist()
