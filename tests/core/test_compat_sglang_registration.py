"""The kvwire layout frame a decode adds to sglang's registration: round trip and hostile frames."""

from __future__ import annotations

import json

import pytest

from kvwire import KVBuffer, KVLayout, LayoutError
from kvwire_sglang import layout_frame, layout_from_frames
from kvwire_sglang.registration import FRAME_PREFIX, MAX_FRAME_BYTES

LAYOUT = KVLayout(
    (KVBuffer(0x10000, 4096, 32, 0, "k", "host"), KVBuffer(0x90000, 4096, 32, 0, "v", "host")), 1, 0
)
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
