"""TransportBackend: the spec hooks written once, over a transport; every guard of the base has a test."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from held_submit import HeldTransport, Memory, SubmitWithoutNotifications, ids, refusal

import kvwire
from kvwire import BackendConfig, InvalidTransferError, KVBuffer, KVLayout, TransferPlan, Transport
from kvwire.backends import local
from kvwire.backends.local import LocalBackend

IDX = np.array([1, 2], np.int32)


def _pair(pages: int = 8) -> tuple[LocalBackend, LocalBackend, np.ndarray, np.ndarray]:
    src, dst = np.random.default_rng(0).integers(0, 256, (2, pages, 64), dtype=np.uint8)
    sender, receiver = LocalBackend(BackendConfig()), LocalBackend(BackendConfig())
    sender.register_kv_buffers(KVLayout.mla([src]))
    receiver.register_kv_buffers(KVLayout.mla([dst]))
    return sender, receiver, src, dst


def test_send_needs_a_local_layout_first() -> None:
    backend = LocalBackend(BackendConfig())
    backend.add_peer("p", KVLayout((KVBuffer(1 << 20, 64, 8, 0, "kv"),)))
    with pytest.raises(InvalidTransferError, match=r"^register_kv_buffers\(\) must be called before send_kvcache\(\)$"):
        backend.send_kvcache("p", IDX, [1 << 20], IDX, None)


class NativeLocal(LocalBackend):
    """The local backend declaring submit, so its base ``submit_kvcache`` is reached directly."""

    capabilities = LocalBackend.capabilities | {"submit"}


def test_each_hook_before_register_kv_buffers_names_itself() -> None:
    backend = NativeLocal(BackendConfig())
    backend.add_peer("p", KVLayout((KVBuffer(1 << 20, 64, 8, 0, "kv"),)))
    request = kvwire.TransferRequest(IDX, [1 << 20], IDX)
    with pytest.raises(InvalidTransferError) as exc:
        backend.submit_kvcache("p", request)
    assert str(exc.value) == "register_kv_buffers() must be called before submit_kvcache()"
    with pytest.raises(InvalidTransferError) as exc:
        backend.send_notification("p", b"n")
    assert str(exc.value) == "register_kv_buffers() must be called before send_notification()"


def test_send_needs_the_peer_layout_first() -> None:
    sender, _, _, dst = _pair()
    sender.add_peer("p", KVLayout.mla([dst]))
    with pytest.raises(InvalidTransferError) as exc:
        sender.send_kvcache("q", IDX, [int(dst.ctypes.data)], IDX, None)
    assert str(exc.value) == "session_id 'q' is unknown: call add_peer(session_id, layout) first (known: p)"


def test_bytes_move_and_close_forgets_layouts() -> None:
    sender, receiver, src, dst = _pair()
    endpoint = receiver.endpoint()
    sender.add_peer(endpoint, KVLayout.mla([dst]))
    before = dst.copy()
    assert sender.send_kvcache(endpoint, IDX, [int(dst.ctypes.data)], np.array([5, 6], np.int32), None) == 128
    assert (dst[5:7] == src[1:3]).all()
    assert (np.delete(dst, [5, 6], axis=0) == np.delete(before, [5, 6], axis=0)).all()
    sender.close()
    with pytest.raises(kvwire.BackendError, match=r"^backend LocalBackend is closed; nothing was sent$"):
        sender.send_kvcache(endpoint, IDX, [int(dst.ctypes.data)], IDX, None)


def test_peer_description_larger_than_its_registered_memory_is_refused() -> None:
    """The local backend writes only inside memory the peer registered, whatever add_peer was told."""
    sender, receiver, _, dst = _pair(pages=8)
    endpoint = receiver.endpoint()
    base = int(dst.ctypes.data)
    sender.add_peer(endpoint, KVLayout((KVBuffer(base, 64, 16, 0, "kv"),)))  # claims 16 pages, registered 8
    before = dst.copy()
    with pytest.raises(InvalidTransferError) as exc:
        sender.send_kvcache(endpoint, IDX, [base], np.array([7, 8], np.int32), None)
    assert str(exc.value) == (
        f"dst[0] = {base + 7 * 64:#x} with length[0] = 128 is not inside registered memory of peer {endpoint!r}; "
        f"nearest registered range [{base:#x}, {base + 8 * 64:#x})"
    )
    assert (dst == before).all()


def test_direct_call_refuses_features_the_backend_does_not_declare() -> None:
    class NoLayerIds(LocalBackend):
        capabilities = frozenset({"mla", "host_memory"})

    sender = NoLayerIds(BackendConfig())
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        sender.send_kvcache("p", IDX, [1], IDX, None, [0])
    assert str(exc.value) == (
        "backend 'NoLayerIds' does not support 'layer_ids', needed for dst_layer_ids; nothing was sent"
    )


class _Recording(Transport):
    """A transport that fails to register the buffer at ``fail_at``."""

    def __init__(self, fail_at: int) -> None:
        self.fail_at = fail_at
        self.registered: list[int] = []

    @property
    def endpoint(self) -> str:
        return "rec://1"

    def register_memory(self, base: int, nbytes: int) -> None:
        if base == self.fail_at:
            raise kvwire.TransferError("refused")
        self.registered.append(base)

    def unregister_memory(self, base: int) -> None:
        self.registered.remove(base)

    def write(self, session_id: str, plan: TransferPlan) -> None:
        raise AssertionError("not reached")

    def close(self) -> None:
        pass


def test_registration_is_all_or_nothing() -> None:
    transport = _Recording(fail_at=3 << 12)

    class Backend(LocalBackend):
        def open_transport(self, config: BackendConfig) -> Transport:
            return transport

    backend = Backend(BackendConfig())
    first = KVLayout((KVBuffer(1 << 12, 64, 8, 0, "kv"), KVBuffer(2 << 12, 64, 8, 1, "kv")))
    backend.register_kv_buffers(first)
    assert transport.registered == [1 << 12, 2 << 12]
    broken = KVLayout((KVBuffer(5 << 12, 64, 8, 0, "kv"), KVBuffer(3 << 12, 64, 8, 1, "kv")))
    with pytest.raises(kvwire.TransferError, match="refused"):
        backend.register_kv_buffers(broken)
    assert transport.registered == []  # the old layout was unregistered, the new one rolled back
    with pytest.raises(InvalidTransferError, match="register_kv_buffers"):
        backend.send_kvcache("p", IDX, [1], IDX, None)


class _Plain(kvwire.Transport):
    """A transport with the required operations only (no raw_write)."""

    endpoint = "plain"

    def register_memory(self, base: int, nbytes: int) -> None: ...

    def unregister_memory(self, base: int) -> None: ...

    def write(self, session_id: str, plan: TransferPlan) -> None: ...

    def close(self) -> None: ...


class _PlainBackend(LocalBackend):
    def open_transport(self, config: BackendConfig) -> kvwire.Transport:  # type: ignore[override]
        return _Plain()


def test_raw_write_needs_a_transport_that_offers_it() -> None:
    backend = _PlainBackend(BackendConfig())
    with pytest.raises(kvwire.UnsupportedFeatureError, match="_PlainBackend's transport offers no raw_write"):
        backend.raw_write("p", TransferPlan.empty())


def test_remove_peer_forgets_its_layout_and_is_idempotent() -> None:
    sender, receiver, _, dst = _pair()
    endpoint = receiver.endpoint()
    sender.add_peer(endpoint, KVLayout.mla([dst]))
    assert sender.send_kvcache(endpoint, IDX, [int(dst.ctypes.data)], IDX, None) == 128
    sender.remove_peer(endpoint)
    sender.remove_peer(endpoint)  # idempotent
    with pytest.raises(InvalidTransferError, match=rf"session_id {endpoint!r} is unknown"):
        sender.send_kvcache(endpoint, IDX, [int(dst.ctypes.data)], IDX, None)


def test_closing_a_local_transport_while_its_thread_holds_the_directory_lock_does_not_deadlock() -> None:
    """A garbage collection inside ``LocalTransport.__init__`` (lock held) may finalize a dropped Connection,
    whose close takes the lock again on the same thread: seen as a worker hung for 15 minutes."""
    transport = local.LocalTransport()
    done = threading.Event()

    def close_under_the_lock() -> None:
        with local._lock:
            transport.close()  # what the finalizer does, on the thread that holds the lock
        done.set()

    thread = threading.Thread(target=close_under_the_lock, daemon=True)
    thread.start()
    assert done.wait(5), "LocalTransport.close() deadlocked on the directory lock its own thread holds"


# -- send_kvcache's parameter list is read from BackendProtocol, not spelled in the base ---------


def test_the_bases_send_kvcache_has_the_spec_signature_for_inspect_and_pluggy() -> None:
    import inspect

    from pluggy._hooks import varnames

    from kvwire.spec.request import SEND_PARAMETERS

    assert inspect.signature(LocalBackend.send_kvcache) == inspect.signature(kvwire.BackendProtocol.send_kvcache)
    args, kwargs = varnames(LocalBackend(BackendConfig()).send_kvcache)  # what pluggy passes, by name
    assert (*args, *kwargs) == SEND_PARAMETERS
    assert args == ("session_id", "prefill_kv_indices", "dst_kv_ptrs", "dst_kv_indices", "executor")


@pytest.mark.parametrize("style", ["positional", "keywords", "mixed", "defaults"])
def test_the_bases_send_kvcache_binds_every_calling_style_to_the_same_bytes(style: str) -> None:
    sender, receiver, src, dst = _pair()
    p = receiver.endpoint()
    sender.add_peer(p, KVLayout.mla([dst]))
    ptrs = [int(dst.ctypes.data)]
    src_idx, dst_idx = np.array([1, 2], np.int32), np.array([5, 6], np.int32)
    if style == "positional":
        moved = sender.send_kvcache(p, src_idx, ptrs, dst_idx, None, None, None, None, None)
    elif style == "keywords":
        moved = sender.send_kvcache(
            session_id=p, prefill_kv_indices=src_idx, dst_kv_ptrs=ptrs, dst_kv_indices=dst_idx, executor=None
        )
    elif style == "mixed":
        moved = sender.send_kvcache(p, src_idx, ptrs, dst_kv_indices=dst_idx, executor=None, dst_layer_ids=None)
    else:
        moved = sender.send_kvcache(p, src_idx, ptrs, dst_idx, None)
    assert moved == 128
    assert np.array_equal(dst[[5, 6]], src[[1, 2]])


def test_the_bases_send_kvcache_refuses_a_call_its_signature_refuses() -> None:
    sender, _, _, dst = _pair()
    sender.add_peer("p", KVLayout.mla([dst]))
    with pytest.raises(TypeError) as exc:
        sender.send_kvcache("p", IDX, [int(dst.ctypes.data)], IDX, None, dst_priority=1)
    assert str(exc.value) == "SendAdapter.send_kvcache() got an unexpected keyword argument 'dst_priority'"
    with pytest.raises(TypeError) as exc:
        sender.send_kvcache("p", IDX, [int(dst.ctypes.data)])
    assert str(exc.value) == (
        "SendAdapter.send_kvcache() missing 2 required positional arguments: 'dst_kv_indices' and 'executor'"
    )


def test_request_fields_in_another_order_than_the_spec_fail_at_import() -> None:
    from kvwire.spec.request import SEND_PARAMETERS, check_request_fields

    fields = [p for p in SEND_PARAMETERS if p not in ("session_id", "executor")]
    swapped = [fields[1], fields[0], *fields[2:]]
    with pytest.raises(ImportError) as exc:
        check_request_fields(swapped, SEND_PARAMETERS)
    assert str(exc.value).startswith(f"TransferRequest's fields {tuple(swapped)} must be send_kvcache's parameters")


def test_the_request_defaults_are_send_kvcaches_declared_defaults() -> None:
    import dataclasses
    import inspect

    from kvwire.spec.request import SEND_PARAMETERS, check_request_fields

    declared = {
        n: p.default
        for n, p in inspect.signature(kvwire.BackendProtocol.send_kvcache).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    fields = {
        f.name: f.default for f in dataclasses.fields(kvwire.TransferRequest) if f.default is not dataclasses.MISSING
    }
    assert fields == {n: d for n, d in declared.items() if n != "executor"} and fields  # the same, and some
    names = [p for p in SEND_PARAMETERS if p not in ("session_id", "executor")]
    with pytest.raises(ImportError) as exc:
        check_request_fields(names, SEND_PARAMETERS, {**fields, "dst_layer_ids": ()}, declared)
    assert str(exc.value) == (
        "TransferRequest.dst_layer_ids defaults to () but send_kvcache's dst_layer_ids to None: they must be the "
        "same (kvwire/spec/protocol.py and kvwire/spec/request.py)"
    )


def test_a_request_field_list_that_drifted_from_send_kvcache_fails_at_import() -> None:
    from kvwire.spec.request import SEND_PARAMETERS, check_request_fields

    fields = [p for p in SEND_PARAMETERS if p not in ("session_id", "executor")]
    check_request_fields(fields, SEND_PARAMETERS)
    with pytest.raises(ImportError) as exc:
        check_request_fields(fields, (*SEND_PARAMETERS, "dst_priority"))
    assert str(exc.value) == (
        f"TransferRequest's fields {tuple(fields)} must be send_kvcache's parameters but session_id and executor, "
        f"in spec order: {(*fields, 'dst_priority')}; add a new parameter to both "
        "(kvwire/spec/protocol.py and kvwire/spec/request.py)"
    )


# -- TransportBackend: a direct caller gets the refusal the Connection gives -------------------------------------------


def test_the_base_submit_refuses_a_notification_its_backend_does_not_declare(
    direct: tuple[SubmitWithoutNotifications, LocalBackend, str, Memory],
) -> None:
    sender, receiver, endpoint, memory = direct
    request = kvwire.TransferRequest(ids(1, 2), memory.ptrs, ids(3, 4))
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        sender.submit_kvcache(endpoint, request, notification=b"req-1")
    assert str(exc.value) == refusal("'SubmitWithoutNotifications'", "submit_kvcache")
    transport = sender.transport
    assert isinstance(transport, HeldTransport)
    assert transport.held == []  # nothing reached the transport
    future = sender.submit_kvcache(endpoint, request)  # the same submission without a notification is taken
    assert len(transport.held) == 1 and not future.done()
    assert receiver.poll_notifications() == []


def test_the_base_send_notification_refuses_a_backend_that_does_not_declare_notifications(
    direct: tuple[SubmitWithoutNotifications, LocalBackend, str, Memory],
) -> None:
    sender, receiver, endpoint, _ = direct
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        sender.send_notification(endpoint, b"req-1")
    assert str(exc.value) == refusal("'SubmitWithoutNotifications'", "send_notification")
    assert receiver.poll_notifications() == []  # the transport, which carries them, was never asked
    with pytest.raises(kvwire.UnsupportedFeatureError) as exc:
        sender.poll_notifications()
    assert str(exc.value) == refusal("'SubmitWithoutNotifications'", "poll_notifications")
