"""The kvwire layout frame a decode adds to sglang's registration: round trip and hostile frames."""

from __future__ import annotations

import json

import pytest

from kvwire import KVBuffer, KVLayout, LayoutError
from kvwire_sglang import layout_frame, layout_from_frames
from kvwire_sglang.registration import FRAME_PREFIX, MAX_FRAME_BYTES

LAYOUT = KVLayout((KVBuffer(0x10000, 4096, 32, 0, "k", "host"), KVBuffer(0x90000, 4096, 32, 0, "v", "host")), 1, 0)
# sglang 0.5.23's registration: 20 frames, the session id in frame 3
SGLANG_FRAMES = [b"None", b"127.0.0.1", b"17001", b"127.0.0.1:15000", b"\x00" * 16, *([b""] * 15)]


def test_a_decodes_layout_travels_in_one_extra_frame_and_reads_back_equal() -> None:
    frames = [*SGLANG_FRAMES, layout_frame("127.0.0.1:15000", LAYOUT)]
    assert frames[20].startswith(b"kvwire.peer:1:{")
    assert layout_from_frames(frames, "127.0.0.1:15000") == LAYOUT


def test_a_registration_without_the_frame_has_no_layout() -> None:
    assert layout_from_frames(SGLANG_FRAMES, "127.0.0.1:15000") is None


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        (FRAME_PREFIX + b"{not json", "registration of '127.0.0.1:15000': kvwire layout frame is not JSON"),
        (FRAME_PREFIX + b"[1, 2]", "peer description: expected an object with format 'kvwire.peer'"),
        (
            FRAME_PREFIX + b" " * MAX_FRAME_BYTES,
            "registration of '127.0.0.1:15000': kvwire layout frame of 4194318 bytes, over 4194304",
        ),
        (
            layout_frame("10.0.0.9:1", LAYOUT),
            "registration of '127.0.0.1:15000': its kvwire layout frame describes session '10.0.0.9:1'",
        ),
    ],
    ids=["not-json", "not-a-description", "too-large", "another-session"],
)
def test_a_malformed_frame_is_a_layout_error_naming_the_registration(frame: bytes, message: str) -> None:
    with pytest.raises(LayoutError) as exc:
        layout_from_frames([*SGLANG_FRAMES, frame], "127.0.0.1:15000")
    assert str(exc.value).startswith(message)


def test_a_layout_with_a_buffer_past_the_address_space_is_refused() -> None:
    data = json.loads(layout_frame("s", LAYOUT)[len(FRAME_PREFIX) :])
    data["layout"]["buffers"][0]["base"] = 2**63 - 4096
    frame = FRAME_PREFIX + json.dumps(data).encode()
    with pytest.raises(LayoutError, match="base"):
        layout_from_frames([*SGLANG_FRAMES, frame], "s")


def test_two_kvwire_frames_are_refused() -> None:
    frame = layout_frame("s", LAYOUT)
    with pytest.raises(LayoutError) as exc:
        layout_from_frames([*SGLANG_FRAMES, frame, frame], "s")
    assert str(exc.value) == "registration of 's': 2 kvwire layout frames, expected one"


def test_a_decode_that_published_other_addresses_than_it_registered_stays_unknown(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Same count, other pointers: the prefill refuses the decode (its sends -22, nothing moves), by name."""
    import logging
    import threading
    from types import SimpleNamespace
    from typing import Any

    import numpy as np

    import kvwire
    from kvwire_sglang.manager import KvwireManagerMixin

    class _SglangPrefill:
        def _publish_peer_registration(self, session_id: str, decode_kv_args: Any) -> str:
            return "sglang's verdict"

    class _Prefill(KvwireManagerMixin, _SglangPrefill):  # type: ignore[misc]
        pass

    session = "10.0.0.2:17001"
    src, dst, other = (np.full((4, 64), v, np.uint8) for v in (7, 0, 0))
    manager: Any = _Prefill()
    manager.kvwire_connection = kvwire.connect("local")
    manager._kvwire_lock, manager._kvwire_registered, manager._kvwire_endpoints = threading.Lock(), {}, {}
    manager.kvwire_layout = KVLayout.mla([src])
    try:
        manager.kvwire_connection.register_kv_buffers(manager.kvwire_layout)
        manager._kvwire_note_registration(
            [b"None", b"x", b"y", session.encode(), layout_frame(session, KVLayout.mla([dst]))]
        )
        with caplog.at_level(logging.ERROR, logger="kvwire"):
            verdict = manager._publish_peer_registration(session, SimpleNamespace(dst_kv_ptrs=[int(other.ctypes.data)]))
            ids = np.array([1], np.int32)
            status = manager.send_kvcache(session, ids, [int(other.ctypes.data)], ids, None)
        assert verdict == "sglang's verdict" and status == -22
        assert manager.kvwire_connection.peer_layout(session) is None
        assert not dst.any() and not other.any()
        expected = [hex(int(dst.ctypes.data))], [hex(int(other.ctypes.data))]
        assert caplog.records[0].getMessage() == (
            f"kvwire: decode session {session}: published buffers at {expected[0]} but registered dst_kv_ptrs "
            f"{expected[1]} with sglang; sends to it are refused"
        )
    finally:
        manager.kvwire_connection.close()


def test_positional_draft_layers_follow_a_pipeline_stages_first_layer() -> None:
    """A stage starting at layer 4 with 2 target layers and 1 draft (positional ids): the draft is layer 6."""
    from kvwire_sglang import layout_from_kv_args

    layout = layout_from_kv_args(
        [0x10000, 0x20000, 0x30000], [4096] * 3, [1024] * 3, [], attention="mla", memory="host", attn_tp_size=1,
        first_layer=4, num_draft_entries=1,
    )  # fmt: skip
    assert [b.layer for b in layout.buffers] == [4, 5, 6]
