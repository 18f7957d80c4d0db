"""The bench's verification can fail: a write that did not happen is detected."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvwire
from kvwire.benchmark.presets import get_preset
from kvwire.control import ChildProcess, ControlError
from kvwire.workload.memory import allocate

pytestmark = pytest.mark.slow


def test_scrambled_pages_fail_verification_until_written_again() -> None:
    preset = get_preset("qwen2.5-7b")
    args = {"backend": "mooncake", "preset": preset.name, "pages": 64, "seed": 3}
    decode = ChildProcess("kvwire.benchmark.decode", [json.dumps(args)], what="decode process")
    try:
        peer = kvwire.PeerDescription.from_dict(decode.read())
        pool = allocate(preset.entries(decode_side=False), 64, preset.page_bytes)
        pool.fill_random(4)
        src, dst = np.array([3, 4, 9], np.int32), np.array([10, 11, 40], np.int32)
        expected = pool.digest(src.astype(np.int64))
        pages = {"host_pages": dst.tolist(), "device_pages": None}
        verify = {"cmd": "verify", "digest": expected, **pages}
        with kvwire.connect("mooncake") as conn:
            conn.register_kv_buffers(pool.layout)
            conn.add_peer(peer.endpoint, peer.layout)
            ptrs = [b.base for b in peer.layout.buffers]
            conn.send_kvcache(peer.endpoint, src, ptrs, dst)
            assert decode.request(verify) == {"ok": True, "guards_ok": True}
            decode.request({"cmd": "scramble", **pages})
            assert decode.request(verify) == {"ok": False, "guards_ok": True}
            conn.send_kvcache(peer.endpoint, src, ptrs, dst)
            assert decode.request(verify) == {"ok": True, "guards_ok": True}
            # a write one page past a target run changes a guard page: caught
            decode.request({"cmd": "scramble", **pages})
            conn.send_kvcache(peer.endpoint, src, ptrs, dst)
            conn.send_kvcache(peer.endpoint, np.array([5], np.int32), ptrs, np.array([12], np.int32))
            assert decode.request(verify) == {"ok": True, "guards_ok": False}
        with pytest.raises(ControlError, match=r"decode process failed: unknown command 'bogus'"):
            decode.request({"cmd": "bogus"})
    finally:
        decode.close()
    assert decode.proc.returncode == 0


def test_a_child_that_exits_is_an_error_not_a_hang() -> None:
    child = ChildProcess("kvwire.control_module_does_not_exist", [], what="test child", timeout_s=5.0)
    with pytest.raises(ControlError, match=r"test child \(pid \d+\) exited with code 1 before answering"):
        child.read()
    child.close()


def test_a_child_that_never_answers_times_out() -> None:
    child = ChildProcess("timeit", ["-n", "1000000000000", "pass"], what="silent child", timeout_s=1.0)
    with pytest.raises(ControlError, match=r"silent child \(pid \d+\) did not answer within 1 s"):
        child.read()
    child.close()  # asks, gets no answer in time, kills and reaps
    assert child.proc.returncode is not None
