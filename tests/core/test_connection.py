"""Runtime registration, connection-time capabilities, and pluggy dispatch."""

from __future__ import annotations

import numpy as np
import pytest
from held_submit import PAGE_BYTES, ids

import kvwire
from kvwire import KVBuffer, KVLayout

from backends_for_tests import Recorder, Recorder11, ReturnsStatus


@pytest.fixture
def registry() -> kvwire.Registry:
    return kvwire.Registry(allow=["local"], policy="strict")


def _layout(memory: str = "host", role: str = "kv") -> KVLayout:
    return KVLayout((KVBuffer(4096, 64, 16, 0, role, memory),))  # type: ignore[arg-type]


def test_every_argument_reaches_the_backend(registry: kvwire.Registry) -> None:
    registry.register("recorder", Recorder)
    conn = registry.connect("recorder", features={"layer_ids", "device_kv_indices"})
    args = {
        "session_id": "peer:1",
        "prefill_kv_indices": np.array([1, 2], np.int32),
        "dst_kv_ptrs": [4096],
        "dst_kv_indices": np.array([3, 4], np.int32),
        "executor": None,
        "dst_layer_ids": [7],
        "dst_device_kv_indices": np.array([5, 6], np.int32),
        "dst_kv_item_len": 64,
        "dst_attn_tp_size": 2,
    }
    assert conn.send_kvcache(**args) == 4096
    name, received = conn.backend.calls[-1]
    assert name == "send_kvcache"
    received.pop("self")
    assert set(received) == set(args)
    for key, value in args.items():
        assert received[key] is value, key  # the very object, not a default


def test_lifecycle_hooks_go_through_pluggy(registry: kvwire.Registry) -> None:
    registry.register("recorder", Recorder)
    layout = _layout()
    with registry.connect("recorder") as conn:
        conn.register_kv_buffers(layout)
        conn.add_peer("peer:1", layout)
        assert conn.endpoint() == "recorder://1"
    assert [c[0] for c in conn.backend.calls] == ["register_kv_buffers", "add_peer", "close"]
    conn.close()  # idempotent
    assert [c[0] for c in conn.backend.calls].count("close") == 1


def test_adapted_backend_refuses_later_feature_before_call(registry: kvwire.Registry) -> None:
    info = registry.register("old", Recorder11)
    assert (info.status, info.spec_version) == ("adapted", "1.1")
    conn = registry.connect("old")
    idx = np.array([1], np.int32)
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        conn.send_kvcache("p", idx, [1], idx, None, None, np.array([2], np.int32))
    assert str(exc.value) == (
        "backend 'old' (spec 1.1) does not support 'device_kv_indices', needed for dst_device_kv_indices; "
        "nothing was sent. Use a backend that supports it (pip install kvwire-hisparse)"
    )
    assert conn.backend.calls == []
    assert conn.send_kvcache("p", idx, [1], idx, None, [0]) == 0  # layer ids are 1.1: they pass
    assert conn.backend.calls[-1][1]["dst_layer_ids"] == [0]


def test_required_feature_missing_fails_at_connect_naming_supporters(registry: kvwire.Registry) -> None:
    registry.register("old", Recorder11)
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        registry.connect("old", features={"device_kv_indices"})
    assert str(exc.value) == (
        "backend 'old' (runtime, spec 1.1) does not support required feature(s) ['device_kv_indices']; "
        "backends that support them: local (kvwire)"
    )
    with pytest.raises(kvwire.ConfigError, match=r"features: unknown feature\(s\) \['split'\]"):
        registry.connect("old", features={"split"})


def test_layout_features_checked_at_registration(registry: kvwire.Registry) -> None:
    registry.register("old", Recorder11)
    conn = registry.connect("old")
    with pytest.raises(kvwire.UnsupportedFeatureError, match="does not support 'mla', needed for the local layout"):
        conn.register_kv_buffers(_layout())
    with pytest.raises(kvwire.UnsupportedFeatureError, match="'device_memory', needed for peer 'p' \\(device"):
        conn.add_peer("p", KVLayout((KVBuffer(4096, 64, 16, 0, "k", "device"), KVBuffer(8192, 64, 16, 0, "v"))))
    assert conn.backend.calls == []


def test_runtime_registration_validates(registry: kvwire.Registry) -> None:
    class Drifted(Recorder11):
        spec_version = "1.2"

    with pytest.raises(kvwire.BackendDriftError) as exc:
        registry.register("drifted", Drifted)
    (finding,) = exc.value.findings
    assert finding.rule == "missing-parameter"
    assert finding.entry_point is not None and finding.entry_point.endswith("Drifted")
    assert "registered at runtime" in str(exc.value)
    quarantine = kvwire.Registry(allow=["local"], policy="quarantine")
    info = quarantine.register("drifted", Drifted)
    assert info.status == "drift"
    with pytest.raises(kvwire.BackendLoadError, match=r"backend 'drifted' is not available \(drift: 1"):
        quarantine.connect("drifted")


def test_duplicate_runtime_name(registry: kvwire.Registry) -> None:
    with pytest.raises(kvwire.DuplicateBackendError, match=r"backend name 'local' is already taken by kvwire"):
        registry.register("local", Recorder)


def test_status_code_return_is_an_error(registry: kvwire.Registry) -> None:
    registry.register("status", ReturnsStatus)
    conn = registry.connect("status")
    idx = np.array([1], np.int32)
    with pytest.raises(kvwire.BackendError, match="send_kvcache returned None; the spec requires the bytes moved"):
        conn.send_kvcache("p", idx, [1], idx)


def test_bad_arguments_are_typed_errors() -> None:
    with pytest.raises(kvwire.ConfigError, match="policy must be one of"):
        kvwire.Registry(policy="lenient")  # type: ignore[arg-type]
    with pytest.raises(kvwire.ConfigError, match="allow must be a collection"):
        kvwire.Registry(allow="local")
    with pytest.raises(kvwire.ConfigError, match=r"BackendConfig\.timeout_s must be finite and > 0, got 0"):
        kvwire.BackendConfig(timeout_s=0)
    with pytest.raises(kvwire.ConfigError, match=r"^BackendConfig\.process_settings must be a bool, got 'yes'$"):
        kvwire.BackendConfig(process_settings="yes")  # type: ignore[arg-type]
    with pytest.raises(kvwire.ConfigError, match=r"^BackendConfig\.options keys must be non-empty str, got 3$"):
        kvwire.BackendConfig(options={3: "x"})
    with pytest.raises(kvwire.ConfigError, match=r"^BackendConfig\.options cannot be sent to another process: "):
        kvwire.BackendConfig(options={"engine": object()}).to_dict()


def test_closed_connection_refuses_calls(registry: kvwire.Registry) -> None:
    registry.register("recorder", Recorder)
    conn = registry.connect("recorder")
    conn.close()
    idx = np.array([1], np.int32)
    for call in (
        lambda: conn.endpoint(),
        lambda: conn.register_kv_buffers(_layout()),
        lambda: conn.add_peer("p", _layout()),
        lambda: conn.send_kvcache("p", idx, [1], idx),
    ):
        with pytest.raises(kvwire.BackendError, match="connection to backend 'recorder' is closed"):
            call()
    assert [c[0] for c in conn.backend.calls] == ["close"]


def test_dropped_connection_closes_its_backend(registry: kvwire.Registry) -> None:
    import gc

    registry.register("recorder", Recorder)
    conn = registry.connect("recorder")
    backend = conn.backend
    del conn
    gc.collect()
    assert [c[0] for c in backend.calls] == ["close"]


def test_feature_not_declared_is_refused_before_the_call(registry: kvwire.Registry) -> None:
    """A current-spec backend that does not declare layer_ids never sees a dst_layer_ids value."""

    class NoLayerIds(Recorder):
        capabilities = frozenset({"mha", "mla", "host_memory"})

    registry.register("nolayers", NoLayerIds)
    conn = registry.connect("nolayers")
    idx = np.array([1], np.int32)
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        conn.send_kvcache("p", idx, [1], idx, None, [0])
    assert str(exc.value) == (
        f"backend 'nolayers' (spec {kvwire.SPEC_VERSION}) does not support 'layer_ids', needed for dst_layer_ids; "
        "nothing was sent"
    )
    assert conn.backend.calls == []


def test_endpoint_must_be_a_str(registry: kvwire.Registry) -> None:
    class NumericEndpoint(Recorder):
        @kvwire.hookimpl
        def endpoint(self) -> str:
            return 7  # type: ignore[return-value]

    registry.register("numeric", NumericEndpoint)
    with pytest.raises(kvwire.BackendError, match=r"^backend 'numeric': endpoint\(\) returned 7, expected a str$"):
        registry.connect("numeric").endpoint()


def test_connection_arguments_are_checked(registry: kvwire.Registry) -> None:
    registry.register("recorder", Recorder)
    with pytest.raises(kvwire.ConfigError, match=r"^config must be a kvwire.BackendConfig, got dict$"):
        registry.connect("recorder", {"host": "x"})  # type: ignore[arg-type]
    conn = registry.connect("recorder")
    with pytest.raises(kvwire.InvalidTransferError, match=r"^session_id must be a non-empty str, got ''$"):
        conn.add_peer("", _layout())
    with pytest.raises(kvwire.ConfigError, match=r"^layout must be a kvwire.KVLayout, got str$"):
        conn.add_peer("p", "layout")  # type: ignore[arg-type]
    with pytest.raises(kvwire.ConfigError, match=r"^layout must be a kvwire.KVLayout, got NoneType$"):
        conn.register_kv_buffers(None)  # type: ignore[arg-type]
    assert conn.backend.calls == []


def test_raw_write_needs_a_transport_backend_whose_transport_offers_it(registry: kvwire.Registry) -> None:
    registry.register("recorder", Recorder)
    conn = registry.connect("recorder")
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        conn.raw_write("p", kvwire.TransferPlan.empty())
    assert str(exc.value) == (
        "backend 'recorder' offers no raw_write: it takes a kvwire.TransportBackend whose transport implements "
        "kvwire.RawWriter (raw_write(session_id, plan))"
    )
    assert conn.backend.calls == []


def test_remove_peer_reaches_the_backend_and_forgets_the_layout(registry: kvwire.Registry) -> None:
    registry.register("recorder", Recorder)
    conn = registry.connect("recorder")
    conn.register_kv_buffers(_layout())
    conn.add_peer("p", _layout())
    conn.remove_peer("p")
    assert [c[0] for c in conn.backend.calls] == ["register_kv_buffers", "add_peer", "remove_peer"]
    idx = np.array([1], np.int32)
    conn.send_kvcache("p", idx, [4096], idx, dst_kv_item_len=1)  # no layout recorded any more: not checked here
    with pytest.raises(kvwire.InvalidTransferError, match=r"^session_id must be a non-empty str, got int$"):
        conn.remove_peer(3)  # type: ignore[arg-type]


def test_remove_peer_on_an_adapted_backend_drops_only_the_connection_record(registry: kvwire.Registry) -> None:
    registry.register("old", Recorder11)
    conn = registry.connect("old")
    conn.remove_peer("p")  # spec 1.1: no remove_peer hook; nothing reaches the backend
    assert conn.backend.calls == []


def test_different_attention_tp_needs_head_slicing_before_the_first_send(registry: kvwire.Registry) -> None:
    """A backend that does not declare head_slicing is refused a peer of another TP size at add_peer."""
    registry.register("recorder", Recorder)  # capabilities without head_slicing
    k, v = np.zeros((4, 2 * 4 * 8), np.uint8), np.zeros((4, 2 * 4 * 8), np.uint8)  # 4 heads x 4 B x 2 tokens
    peer_k, peer_v = np.zeros((4, 2 * 2 * 8), np.uint8), np.zeros((4, 2 * 2 * 8), np.uint8)
    local = KVLayout.mha(
        [k], [v], attn_tp_size=1, attn_tp_rank=0, heads=kvwire.HeadLayout(4, 4, 4, 2, 2)
    )
    peer = KVLayout.mha(
        [peer_k], [peer_v], attn_tp_size=2, attn_tp_rank=1, heads=kvwire.HeadLayout(2, 4, 4, 2, 2)
    )
    conn = registry.connect("recorder")
    conn.register_kv_buffers(local)
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        conn.add_peer("p", peer)
    assert str(exc.value) == (
        f"backend 'recorder' (spec {kvwire.SPEC_VERSION}) does not support 'head_slicing', needed for peer 'p': "
        "attention TP size 1 here, 2 there; nothing was sent"
    )
    assert [c[0] for c in conn.backend.calls] == ["register_kv_buffers"]
    with kvwire.connect("local") as local_conn:  # the shipped backends have it, through the base
        local_conn.register_kv_buffers(local)
        local_conn.add_peer("p", peer)


# -- what a backend returns ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("flag", [True, False])
def test_a_bool_returned_as_bytes_moved_is_a_backend_error(flag: bool) -> None:
    registry = kvwire.Registry(allow=["local"], policy="strict")
    registry.register("flag", type("ReturnsFlag", (ReturnsStatus,), {"returns": flag}))
    layout = KVLayout((KVBuffer(4096, PAGE_BYTES, 16, 0, "kv"),))  # the recorder moves nothing: no memory needed
    with registry.connect("flag") as conn:
        conn.register_kv_buffers(layout)
        conn.add_peer("p", layout)
        with pytest.raises(kvwire.BackendError) as exc:
            conn.send_kvcache("p", ids(1), [4096], ids(1))
        assert str(exc.value) == (
            f"backend 'flag': send_kvcache returned {flag}; the spec requires the bytes moved (an int >= 0) "
            "and failures raised as kvwire.TransferError"
        )
        future = conn.submit_kvcache("p", ids(1), [4096], ids(1))  # the core's pool runs the same hook
        with pytest.raises(kvwire.BackendError) as exc:
            future.result(timeout=10)
        assert str(exc.value) == (
            f"backend 'flag': send_kvcache returned {flag}; the spec requires the bytes moved (an int >= 0) "
            "and failures raised as kvwire.TransferError"
        )
