"""Numbers that cannot be addresses, backends that break the spec's promises, peers that never leave.

Each case asserts the error type and message; sends assert the destination unchanged.
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
import pytest
from numpy.typing import NDArray

import kvwire
from kvwire import BackendConfig, KVBuffer, KVLayout, LayoutError, PeerDescription


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"base": 2**64}, r"KVBuffer.base = 0x10000000000000000, page_bytes = 64 and num_pages = 4 must each be below"),
        ({"base": 2**63 - 64}, r"KVBuffer.base \+ page_bytes \* num_pages = 0x7fffffffffffffc0 \+ 64 \* 4 ends past"),
        ({"num_pages": 2**62}, r"ends past 2\*\*63 - 1: not an address range of this platform"),
        ({"page_bytes": 2**63}, r"must each be below 2\*\*63"),
        ({"base": 0}, r"KVBuffer.base must be >= 1, got 0"),
        ({"base": True}, r"KVBuffer.base must be an int, got bool True"),
    ],
)
def test_addresses_that_cannot_be_addresses_are_refused(fields: dict[str, int], message: str) -> None:
    args = {"base": 4096, "page_bytes": 64, "num_pages": 4, "layer": 0, **fields}
    with pytest.raises(LayoutError, match=message):
        KVBuffer(**args)  # type: ignore[arg-type]


def test_a_peer_description_with_a_64_bit_base_is_refused_at_parse() -> None:
    good = PeerDescription("peer:1", KVLayout((KVBuffer(4096, 64, 4, 0),))).to_dict()
    bad = {**good, "layout": {**good["layout"], "buffers": [{**good["layout"]["buffers"][0], "base": 2**64}]}}
    with pytest.raises(LayoutError, match=r"^layout description: buffers\[0\]: KVBuffer.base = 0x10000000000000000"):
        PeerDescription.from_dict(bad)


@pytest.mark.parametrize("version", [True, 1.0, "1", None, 2])
def test_a_peer_description_version_must_be_the_integer_it_claims(version: object) -> None:
    good = PeerDescription("peer:1", KVLayout((KVBuffer(4096, 64, 4, 0),))).to_dict()
    with pytest.raises(LayoutError, match=rf"^peer description: version {version!r} is not supported"):
        PeerDescription.from_dict({**good, "version": version})
    layout = {**good["layout"], "version": version}
    with pytest.raises(LayoutError, match=rf"^layout description: 'version' {version!r} is not supported"):
        KVLayout.from_dict(layout)


@pytest.mark.parametrize("text", [None, 3, "[" * 100_000, "{}"])
def test_from_json_of_garbage_is_a_layout_error(text: object) -> None:
    with pytest.raises(LayoutError, match=r"^layout description"):
        KVLayout.from_json(text)  # type: ignore[arg-type]


def test_huge_page_ids_are_refused_not_wrapped() -> None:
    """On main a page id of 2**54 + 3 wrapped in int64 and overwrote page 3; now it is out of range."""
    src, dst = np.ones((8, 64), np.uint8), np.zeros((8, 64), np.uint8)
    with kvwire.connect("local") as a, kvwire.connect("local") as b:
        a.register_kv_buffers(KVLayout.mla([src]))
        b.register_kv_buffers(KVLayout.mla([dst]))
        a.add_peer(b.endpoint(), KVLayout.mla([dst]))
        for idx in (np.array([2**54 + 3], np.int64), np.array([2**63 + 3], np.uint64), np.array([-5], np.int64)):
            with pytest.raises(kvwire.InvalidTransferError, match=r"^dst_kv_indices"):
                a.send_kvcache(b.endpoint(), np.array([1]), [int(dst.ctypes.data)], idx)
    assert not dst.any()


class _Base:
    """A spec-conforming backend; subclasses break one promise each through ``answer``."""

    spec_version = kvwire.SPEC_VERSION
    capabilities = frozenset({"mla", "host_memory"})

    def __init__(self, config: BackendConfig) -> None:
        self.config = config

    def answer(self) -> object:
        return 0

    @kvwire.hookimpl
    def register_kv_buffers(self, layout: KVLayout) -> None:
        pass

    @kvwire.hookimpl
    def endpoint(self) -> str:
        return "x:1"

    @kvwire.hookimpl
    def add_peer(self, session_id: str, layout: KVLayout) -> None:
        pass

    @kvwire.hookimpl
    def remove_peer(self, session_id: str) -> None:
        pass

    @kvwire.hookimpl
    def send_kvcache(
        self,
        session_id: str,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
        dst_device_kv_indices: NDArray[np.int32] | None = None,
        dst_kv_item_len: int | None = None,
        dst_attn_tp_size: int | None = None,
    ) -> int:
        return self.answer()  # type: ignore[return-value]

    @kvwire.hookimpl
    def close(self) -> None:
        pass


def _raise(exc: BaseException) -> object:
    raise exc


class NegativeCount(_Base):
    def answer(self) -> object:
        return -5


class FloatCount(_Base):
    def answer(self) -> object:
        return 12.0


class RaisesRuntimeError(_Base):
    def answer(self) -> object:
        return _raise(RuntimeError("engine exploded"))


class RaisesSystemExit(_Base):
    def answer(self) -> object:
        return _raise(SystemExit(3))


class EmptyEndpoint(_Base):
    @kvwire.hookimpl
    def endpoint(self) -> str:
        return ""


class BadConstructor(_Base):
    def __init__(self, config: BackendConfig) -> None:
        raise ValueError("no such NIC")


class ExitingConstructor(_Base):
    def __init__(self, config: BackendConfig) -> None:
        raise SystemExit(1)


@pytest.fixture
def registry() -> kvwire.Registry:
    registry = kvwire.Registry(allow=["local"], policy="strict")
    for cls in (NegativeCount, FloatCount, RaisesRuntimeError, RaisesSystemExit, EmptyEndpoint, BadConstructor,
                ExitingConstructor):
        registry.register(cls.__name__.lower(), cls)
    return registry


IDX = np.array([1], np.int32)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("negativecount", r"^backend 'negativecount': send_kvcache returned -5; the spec requires the bytes moved"),
        ("floatcount", r"^backend 'floatcount': send_kvcache returned 12.0; the spec requires the bytes moved"),
        (
            "raisesruntimeerror",
            r"^backend 'raisesruntimeerror' raised RuntimeError in send_kvcache: engine exploded \(backends must",
        ),
        ("raisessystemexit", r"^backend 'raisessystemexit' raised SystemExit in send_kvcache: 3 \("),
    ],
)
def test_the_connection_holds_send_kvcache_to_the_spec(registry: kvwire.Registry, name: str, message: str) -> None:
    conn = registry.connect(name)
    with pytest.raises(kvwire.BackendError, match=message) as exc:
        conn.send_kvcache("peer", IDX, [1], IDX)
    if "raises" in name:
        assert exc.value.__cause__ is not None  # the original is chained


def test_an_empty_endpoint_is_a_backend_error(registry: kvwire.Registry) -> None:
    conn = registry.connect("emptyendpoint")
    with pytest.raises(kvwire.BackendError, match=r"^backend 'emptyendpoint': endpoint\(\) returned '', expected"):
        conn.endpoint()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("badconstructor", r"^backend 'badconstructor' raised ValueError in its constructor: no such NIC"),
        ("exitingconstructor", r"^backend 'exitingconstructor' raised SystemExit in its constructor: 1"),
    ],
)
def test_constructor_failures_are_wrapped(registry: kvwire.Registry, name: str, message: str) -> None:
    with pytest.raises(kvwire.BackendError, match=message):
        registry.connect(name)


def test_a_list_as_session_id_is_a_typed_error() -> None:
    with kvwire.connect("local") as conn, pytest.raises(
        kvwire.InvalidTransferError, match=r"^session_id must be a non-empty str, got list$"
    ):
        conn.send_kvcache(["peer"], IDX, [1], IDX)  # type: ignore[arg-type]


def test_thousands_of_peers_come_and_go_in_bounded_memory() -> None:
    """20,000 peers added and removed: what the connection and the backend hold stays flat."""
    page = np.zeros((4, 64), np.uint8)
    with kvwire.connect("local") as conn:
        conn.register_kv_buffers(KVLayout.mla([page]))

        def churn(count: int) -> None:
            for i in range(count):
                layout = KVLayout((KVBuffer(4096 * (i + 1), 64, 4, 0),))
                conn.add_peer(f"peer:{i}", layout)
                conn.remove_peer(f"peer:{i}")

        churn(2_000)  # warm caches
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        churn(20_000)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        assert after - before < 256 * 1024, after - before
        assert len(conn._peers) == 0 and len(conn.backend._peers) == 0
