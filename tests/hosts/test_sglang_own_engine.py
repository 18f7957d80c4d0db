"""kvwire on an engine of its own under sglang (``KVWIRE_SGLANG_BACKEND``): the decode publishes the endpoint of
kvwire's engine, the prefill sends there, and a decode on another transport, or one whose published buffers are
not those it registered with sglang, is refused by name. Fast: no sglang; the manager's hooks are driven as
sglang's bootstrap thread drives them, over the ``local`` backend."""

from __future__ import annotations

import json
import logging
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire import KVLayout, LayoutError
from kvwire_sglang.backends import BACKEND_ENV, chosen_backend, default_backend
from kvwire_sglang.manager import KvwireManagerMixin
from kvwire_sglang.registration import (
    ENGINE_FRAME_PREFIX,
    FRAME_PREFIX,
    MAX_BACKEND_CHARS,
    Published,
    layout_frame,
    published_from_frames,
)

SESSION = "10.0.0.2:17001"  # sglang's session id of the decode (its Mooncake endpoint)


def _layout(pool: np.ndarray) -> KVLayout:
    return KVLayout.mla([pool])


def test_the_engine_frame_carries_session_backend_and_kvwires_own_endpoint() -> None:
    pool = np.zeros((4, 64), np.uint8)
    frame = layout_frame(SESSION, _layout(pool), "nixl://agent-7", "nixl")
    assert frame.startswith(ENGINE_FRAME_PREFIX)
    published = published_from_frames([b"None", b"x", b"y", SESSION.encode(), frame], SESSION)
    assert published == Published(_layout(pool), "nixl://agent-7", "nixl")


def test_the_plain_frame_is_unchanged_and_reached_at_sglangs_session_id() -> None:
    pool = np.zeros((4, 64), np.uint8)
    frame = layout_frame(SESSION, _layout(pool))
    assert frame.startswith(FRAME_PREFIX)
    assert published_from_frames([frame], SESSION) == Published(_layout(pool), SESSION, None)


def _engine(data: object) -> bytes:
    return ENGINE_FRAME_PREFIX + json.dumps(data).encode()


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (
            {"session": "other:1", "backend": "nixl", "peer": {}},
            f"registration of {SESSION!r}: its kvwire layout frame describes session 'other:1'",
        ),
        (
            {"session": SESSION, "backend": "", "peer": {}},
            f"registration of {SESSION!r}: kvwire engine frame's backend must be a name of 1 to "
            f"{MAX_BACKEND_CHARS} characters, got ''",
        ),
        (
            {"session": SESSION, "backend": 7, "peer": {}},
            f"registration of {SESSION!r}: kvwire engine frame's backend must be a name of 1 to "
            f"{MAX_BACKEND_CHARS} characters, got 7",
        ),
        (
            {"session": SESSION, "peer": {}},
            f"registration of {SESSION!r}: kvwire engine frame must be an object with keys backend, peer and "
            f"session, got {{'session': {SESSION!r}, 'peer': {{}}}}",
        ),
    ],
)
def test_a_malformed_engine_frame_is_refused_naming_the_field(frame: object, message: str) -> None:
    with pytest.raises(LayoutError) as exc:
        published_from_frames([_engine(frame)], SESSION)
    assert str(exc.value) == message


def test_two_frames_of_either_form_are_refused() -> None:
    pool = np.zeros((4, 64), np.uint8)
    frames = [layout_frame(SESSION, _layout(pool)), layout_frame(SESSION, _layout(pool), "nixl://a", "nixl")]
    with pytest.raises(LayoutError, match=r"2 kvwire layout frames, expected one$"):
        published_from_frames(frames, SESSION)


def test_the_backend_comes_from_the_variable_and_only_mooncake_and_hisparse_ride_sglangs_engine() -> None:
    assert chosen_backend({BACKEND_ENV: "nixl"}) == ("nixl", False)
    assert chosen_backend({BACKEND_ENV: " acme "}) == ("acme", False)
    assert chosen_backend({BACKEND_ENV: "mooncake"}) == ("mooncake", True)
    assert chosen_backend({BACKEND_ENV: "hisparse"}) == ("hisparse", True)
    assert chosen_backend({}) == (default_backend(), True)


# -- the prefill's hooks, as sglang's bootstrap thread calls them ---------------------------------------------


class _SglangPrefill:
    def _publish_peer_registration(self, session_id: str, decode_kv_args: Any) -> str:
        return "sglang's verdict"


class _Prefill(KvwireManagerMixin, _SglangPrefill):  # type: ignore[misc]
    pass


def _prefill(own_engine: bool) -> Any:
    """A prefill manager after init_engine, on the local backend: on its own engine, or as if on sglang's."""
    manager: Any = _Prefill()
    manager.kvwire_connection = kvwire.connect("local")
    manager._kvwire_lock = threading.Lock()
    manager._kvwire_registered = {}
    manager._kvwire_endpoints = {}
    manager.src = np.arange(4 * 64, dtype=np.uint8).reshape(4, 64)
    manager.kvwire_layout = _layout(manager.src)
    manager.kvwire_connection.register_kv_buffers(manager.kvwire_layout)
    manager.kvwire_endpoint = manager.kvwire_connection.endpoint() if own_engine else None
    return manager


def _register(manager: Any, frame: bytes, ptrs: list[int]) -> str:
    manager._kvwire_note_registration([b"None", b"x", b"y", SESSION.encode(), frame])
    verdict: str = manager._publish_peer_registration(SESSION, SimpleNamespace(dst_kv_ptrs=ptrs))
    return verdict


def test_the_prefill_sends_to_the_endpoint_the_decode_published() -> None:
    prefill = _prefill(own_engine=True)
    decode = kvwire.connect("local")
    dst = np.zeros((8, 64), np.uint8)
    try:
        decode.register_kv_buffers(_layout(dst))
        frame = layout_frame(SESSION, _layout(dst), decode.endpoint(), "local")
        assert _register(prefill, frame, [int(dst.ctypes.data)]) == "sglang's verdict"
        assert prefill.kvwire_endpoint_of(SESSION) == decode.endpoint()
        ids = np.array([1, 2], np.int32)
        status = prefill.send_kvcache(SESSION, ids, [int(dst.ctypes.data)], np.array([5, 6], np.int32), None)
        assert status == 0
        assert np.array_equal(dst[[5, 6]], prefill.src[[1, 2]])  # sglang's session id, kvwire's endpoint
    finally:
        prefill.kvwire_connection.close()
        decode.close()


@pytest.mark.parametrize(
    ("own_engine", "backend", "said"),
    [
        (False, "nixl", "the decode's kvwire runs on backend 'nixl''s own engine, this prefill's on sglang's "
         "Mooncake engine"),
        (True, None, "the decode's kvwire runs on sglang's Mooncake engine, this prefill's on backend 'local''s "
         "own engine"),
        (True, "nixl", "the decode's kvwire runs on backend 'nixl''s own engine, this prefill's on backend "
         "'local''s own engine"),
    ],
)  # fmt: skip
def test_a_decode_on_another_transport_is_refused_by_name_and_its_sends_too(
    own_engine: bool, backend: str | None, said: str, caplog: pytest.LogCaptureFixture
) -> None:
    prefill = _prefill(own_engine)
    dst = np.zeros((8, 64), np.uint8)
    endpoint = "nixl://agent-3" if backend else None
    frame = layout_frame(SESSION, _layout(dst), endpoint, backend)
    try:
        with caplog.at_level(logging.ERROR, logger="kvwire"):
            assert _register(prefill, frame, [int(dst.ctypes.data)]) == "sglang's verdict"
            ids = np.array([1], np.int32)
            status = prefill.send_kvcache(SESSION, ids, [int(dst.ctypes.data)], ids, None)
        assert status == -22 and not dst.any()
        logged = [r.getMessage() for r in caplog.records]
        assert logged[0] == (
            f"kvwire: decode session {SESSION}: {said}: set KVWIRE_SGLANG_BACKEND to the same backend on both "
            "sides; sends to it are refused"
        )
    finally:
        prefill.kvwire_connection.close()


def test_a_decode_that_published_other_addresses_than_it_registered_stays_unknown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Same count, other pointers: the prefill refuses the decode (its sends -22, nothing moves), by name."""
    prefill = _prefill(own_engine=False)
    dst, other = np.zeros((4, 64), np.uint8), np.zeros((4, 64), np.uint8)
    try:
        with caplog.at_level(logging.ERROR, logger="kvwire"):
            assert _register(prefill, layout_frame(SESSION, _layout(dst)), [int(other.ctypes.data)]) == (
                "sglang's verdict"
            )
            ids = np.array([1], np.int32)
            status = prefill.send_kvcache(SESSION, ids, [int(other.ctypes.data)], ids, None)
        assert status == -22
        assert prefill.kvwire_connection.peer_layout(SESSION) is None
        assert not dst.any() and not other.any()
        assert caplog.records[0].getMessage() == (
            f"kvwire: decode session {SESSION}: published buffers at {[hex(int(dst.ctypes.data))]} but registered "
            f"dst_kv_ptrs {[hex(int(other.ctypes.data))]} with sglang; sends to it are refused"
        )
    finally:
        prefill.kvwire_connection.close()
