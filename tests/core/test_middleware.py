"""Middleware: pluggy hook wrappers around send_kvcache, for metrics and tracing."""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire import KVLayout


class ByteCounter:
    """Counts bytes per session around every send, and sees failures too."""

    def __init__(self) -> None:
        self.bytes: dict[str, int] = {}
        self.failures: list[str] = []

    @kvwire.hookimpl(wrapper=True)
    def send_kvcache(self, session_id: str) -> Generator[None, Any, int]:
        try:
            moved: int = yield
        except kvwire.KvwireError as exc:
            self.failures.append(type(exc).__name__)
            raise
        self.bytes[session_id] = self.bytes.get(session_id, 0) + moved
        return moved


def test_wrapper_sees_results_and_errors() -> None:
    src = [np.random.default_rng(1).integers(0, 256, (8, 64), dtype=np.uint8) for _ in range(2)]
    dst = [np.zeros((8, 64), np.uint8) for _ in range(2)]
    counter = ByteCounter()
    registry = kvwire.Registry(allow=["local"])
    with registry.connect("local") as receiver, registry.connect("local", middleware=[counter]) as sender:
        peer = KVLayout.mha([dst[0]], [dst[1]])
        receiver.register_kv_buffers(peer)
        sender.register_kv_buffers(KVLayout.mha([src[0]], [src[1]]))
        sender.add_peer(receiver.endpoint(), peer)
        ptrs = [b.base for b in peer.buffers]
        moved = sender.send_kvcache(receiver.endpoint(), np.array([1, 2], np.int32), ptrs, np.array([5, 6], np.int32))
        assert moved == 2 * 64 * 2
        assert counter.bytes == {receiver.endpoint(): moved}
        assert np.array_equal(dst[0][5:7], src[0][1:3]) and np.array_equal(dst[1][5:7], src[1][1:3])
        bad = np.array([9], np.int32)
        with pytest.raises(kvwire.InvalidTransferError, match="prefill_kv_indices"):
            sender.send_kvcache(receiver.endpoint(), bad, ptrs, bad)
        assert counter.failures == ["InvalidTransferError"]


class Misspelled:
    @kvwire.hookimpl(wrapper=True)
    def send_kv_cache(self) -> Generator[None, Any, int]:
        return (yield)


class NotAWrapper:
    @kvwire.hookimpl
    def send_kvcache(self, session_id: str) -> int:
        return 0


class WrongArgument:
    @kvwire.hookimpl(wrapper=True)
    def send_kvcache(self, session: str) -> Generator[None, Any, int]:
        return (yield)


@pytest.mark.parametrize(
    ("middleware", "message"),
    [
        (Misspelled(), r"middleware\[0\] \(Misspelled\): 'send_kv_cache' is not a kvwire hook; did you mean"),
        (NotAWrapper(), r"NotAWrapper\)\.send_kvcache must be declared @kvwire\.hookimpl\(wrapper=True\)"),
        (WrongArgument(), r"WrongArgument\)\.send_kvcache takes \['session'\], not arguments of hook"),
        (object(), r"middleware\[0\] \(object\) has no @kvwire\.hookimpl\(wrapper=True\) method"),
    ],
)
def test_bad_middleware_is_refused_before_the_backend_is_built(middleware: object, message: str) -> None:
    from kvwire.backends import local

    before = len(local._directory)
    with pytest.raises(kvwire.ConfigError, match=message):
        kvwire.Registry(allow=["local"]).connect("local", middleware=[middleware])
    assert len(local._directory) == before  # no backend instance was created
