"""The bench's verification can fail: a write that did not happen is detected."""

from __future__ import annotations

import json

import numpy as np
import pytest

import kvwire
from kvwire.benchmark.pools import Pool
from kvwire.benchmark.presets import get_preset
from kvwire.benchmark.wire import digest, parse_peer_description
from kvwire.control import ChildProcess, ControlError

pytestmark = pytest.mark.slow


def test_scrambled_pages_fail_verification_until_written_again() -> None:
    preset = get_preset("qwen2.5-7b")
    args = {"backend": "mooncake", "preset": preset.name, "pages": 64, "seed": 3}
    decode = ChildProcess("kvwire.benchmark.decode", [json.dumps(args)], what="decode process")
    try:
        endpoint, peer = parse_peer_description(decode.read())
        pool = Pool(preset, 64, decode_side=False)
        pool.fill_random(4)
        src, dst = np.array([3, 4, 9], np.int32), np.array([10, 11, 40], np.int32)
        expected = digest(pool.views, src.astype(np.int64))
        pages = {"host_pages": dst.tolist(), "device_pages": None}
        with kvwire.connect("mooncake") as conn:
            conn.register_kv_buffers(pool.layout)
            conn.add_peer(endpoint, peer)
            ptrs = [b.base for b in peer.buffers]
            conn.send_kvcache(endpoint, src, ptrs, dst)
            assert decode.request({"cmd": "verify", "digest": expected, **pages})["ok"] is True
            decode.request({"cmd": "scramble", **pages})
            assert decode.request({"cmd": "verify", "digest": expected, **pages})["ok"] is False
            conn.send_kvcache(endpoint, src, ptrs, dst)
            assert decode.request({"cmd": "verify", "digest": expected, **pages})["ok"] is True
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
