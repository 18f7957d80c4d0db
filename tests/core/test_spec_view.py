"""``kvwire spec``: the spec of a version, the diff of two, JSON, and unknown versions."""

from __future__ import annotations

import argparse
import json

import pytest

import kvwire
from kvwire.cli import spec_command as spec_view
from kvwire.spec import SPEC_HISTORY, SPEC_VERSION, spec_hooks
from kvwire.spec.capabilities import FEATURES


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    parser = argparse.ArgumentParser(prog="kvwire spec")
    spec_view.add_arguments(parser)
    assert spec_view.run(parser.parse_args(argv)) == 0
    return capsys.readouterr().out.splitlines()


def test_current_spec_prints_every_hook_capability_and_release(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _run(capsys)
    assert lines[0] == f"kvwire backend spec {SPEC_VERSION} (current; known: 1.0, 1.1, 1.2, 1.3, 1.4, 1.5)"
    assert "  register_kv_buffers(layout: KVLayout) -> None" in lines
    assert "  remove_peer(session_id: str) -> None  # since 1.4" in lines
    start = lines.index("  send_kvcache(")
    assert lines[start + 1 : start + 11] == [
        "      session_id: str,",
        "      prefill_kv_indices: NDArray[np.int32],",
        "      dst_kv_ptrs: Sequence[int],",
        "      dst_kv_indices: NDArray[np.int32],",
        "      executor: Executor | None,",
        "      dst_layer_ids: Sequence[int] | None = None,  # since 1.1, capability layer_ids",
        "      dst_device_kv_indices: NDArray[np.int32] | None = None,  # since 1.2, capability device_kv_indices",
        "      dst_kv_item_len: int | None = None,  # since 1.3, guard, no capability",
        "      dst_attn_tp_size: int | None = None,  # since 1.3, guard, no capability",
        "  ) -> int",
    ]
    assert lines[start + 11] == "      Write the pages `prefill_kv_indices` into the peer; return the bytes moved."
    assert "  device_kv_indices  honours dst_device_kv_indices (HiSparse split host/device destinations)" in lines
    assert all(any(line.startswith(f"  {name} ") for line in lines) for name in FEATURES)
    history = lines[lines.index("History:") + 1 :]
    assert history[0] == "  1.0  register_kv_buffers(layout)"
    assert "  1.2  send_kvcache: dst_device_kv_indices (HiSparse split host/device destinations)" in history
    assert (
        "  1.4  hook remove_peer: Forget a peer: its layout and the engine's per-peer resources (spec 1.4); "
        "unknown ids are a no-op."
    ) in history
    assert history[-3:] == [
        "  1.5  optional hook submit_kvcache (capability submit): native non-blocking sends; "
        "without it the core runs send_kvcache on a worker pool",
        "       optional hook send_notification (capability notifications): short messages delivered after the data",
        "       optional hook poll_notifications (capability notifications): "
        "the messages that arrived at this endpoint",
    ]
    assert "  poll_notifications() -> list[Notification]  # since 1.5, optional: with capability notifications" in lines


def test_an_older_version_leaves_out_what_came_later(capsys: pytest.CaptureFixture[str]) -> None:
    lines = _run(capsys, "--at", "1.1")
    assert _run(capsys, "--version", "1.1") == lines  # the former name still works
    assert lines[0] == "kvwire backend spec 1.1 (current is 1.5; known: 1.0, 1.1, 1.2, 1.3, 1.4, 1.5)"
    text = "\n".join(lines)
    assert "submit" not in text
    assert "remove_peer" not in text and "dst_device_kv_indices" not in text and "device_kv_indices" not in text
    assert "      dst_layer_ids: Sequence[int] | None = None,  # since 1.1, capability layer_ids" in lines
    assert lines[-1] == "  1.1  send_kvcache: dst_layer_ids (pipeline-parallel layer mapping)"


def test_diff_names_each_change(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(capsys, "--diff", "1.1", "1.2") == [
        "spec 1.1 -> 1.2",
        "  + send_kvcache: dst_device_kv_indices: NDArray[np.int32] | None = None  "
        "(HiSparse split host/device destinations; capability device_kv_indices)",
        "  + capability device_kv_indices: honours dst_device_kv_indices (HiSparse split host/device destinations)",
        "A backend declaring 1.1 loads adapted: a feature 1.2 added is refused before anything is sent, "
        "a guard is checked by the core, a hook it lacks is not called.",
    ]
    assert _run(capsys, "--diff", "1.3", "1.4") == [
        "spec 1.3 -> 1.4",
        "  + hook remove_peer(session_id: str) -> None",
        "A backend declaring 1.3 loads adapted: a feature 1.4 added is refused before anything is sent, "
        "a guard is checked by the core, a hook it lacks is not called.",
    ]
    assert _run(capsys, "--diff", "1.4", "1.5")[1:4] == [
        "  + hook submit_kvcache(session_id: str, request: TransferRequest, notification: bytes | None = None) "
        "-> Future[int]  (optional: with capability submit)",
        "  + hook send_notification(session_id: str, message: bytes) -> None  "
        "(optional: with capability notifications)",
        "  + hook poll_notifications() -> list[Notification]  (optional: with capability notifications)",
    ]
    assert _run(capsys, "--diff", "1.2", "1.1")[1].startswith("  - send_kvcache: dst_device_kv_indices: ")
    assert _run(capsys, "--diff", "1.2", "1.2") == ["spec 1.2 -> 1.2", "  no changes"]


def test_json_matches_the_spec(capsys: pytest.CaptureFixture[str]) -> None:
    data = json.loads("\n".join(_run(capsys, "--json")))
    assert data["version"] == SPEC_VERSION and data["current"] is True
    assert [h["name"] for h in data["hooks"]] == list(spec_hooks(kvwire.SpecVersion.parse(SPEC_VERSION)))
    send = next(h for h in data["hooks"] if h["name"] == "send_kvcache")
    assert send["parameters"][5] == {
        "name": "dst_layer_ids",
        "annotation": "Sequence[int] | None",
        "required": False,
        "default": "None",
        "since": "1.1",
        "feature": "layer_ids",
        "purpose": "pipeline-parallel layer mapping",
    }
    assert data["capabilities"] == dict(FEATURES)
    assert [r["version"] for r in data["history"]] == [str(r.version) for r in SPEC_HISTORY]
    diff = json.loads("\n".join(_run(capsys, "--diff", "1.3", "1.4", "--json")))
    assert diff["added_hooks"] == ["remove_peer(session_id: str) -> None"]
    assert diff["added_parameters"] == diff["removed_parameters"] == []


@pytest.mark.parametrize("argv", [("--version", "1.9"), ("--diff", "1.1", "2.0"), ("--version", "one")])
def test_unknown_version_is_one_line_error(argv: tuple[str, ...]) -> None:
    parser = argparse.ArgumentParser(prog="kvwire spec")
    spec_view.add_arguments(parser)
    bad = argv[-1]
    with pytest.raises(kvwire.ConfigError) as info:
        spec_view.run(parser.parse_args(argv))
    assert str(info.value) == f"unknown spec version {bad!r}; known: 1.0, 1.1, 1.2, 1.3, 1.4, 1.5"


def test_version_and_diff_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvwire spec")
    spec_view.add_arguments(parser)
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--version", "1.1", "--diff", "1.1", "1.2"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err
