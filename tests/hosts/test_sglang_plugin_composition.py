"""The class kvwire-sglang's plugin puts in place of sglang's Mooncake manager, checked without sglang (fast).

``kvwire_sglang.plugin.register`` runs as sglang's plugin loader runs it, against stand-ins of the two sglang
modules it imports (the manager it subclasses, with the methods it hooks into, and sglang's hook registry);
the real sglang run is ``tests/hosts/test_sglang_real.py`` (slow). What is checked: the target it replaces,
the hook type, the replacement's bases in their order, and that its method resolution reaches kvwire's mixin
before sglang's class for every method kvwire overrides.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

import pytest

from kvwire_sglang import KvwireManagerMixin, KvwireSendMixin, plugin


class MooncakeKVManager:
    """sglang 0.5.23's manager, as far as the plugin looks at it: the methods kvwire hooks into."""

    def init_engine(self) -> None: ...
    def build_receiver_registration_message(self) -> list[bytes]: ...
    def _make_worker_recv(self, socket: Any, timeout_ms: int = 500) -> Any: ...
    def _publish_peer_registration(self, session_id: str, decode_kv_args: Any) -> Any: ...
    def send_kvcache(self, *args: Any) -> int: ...
    def send_kvcache_slice(self, *args: Any) -> int: ...
    def teardown(self) -> None: ...


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, type, str]]:
    """sglang's modules as stand-ins, the host range answering "use"; what the plugin registers."""
    calls: list[tuple[str, type, str]] = []
    conn = ModuleType("sglang.srt.disaggregation.mooncake.conn")
    conn.MooncakeKVManager = MooncakeKVManager  # type: ignore[attr-defined]
    hooks = ModuleType("sglang.srt.plugins.hook_registry")

    class HookType:
        REPLACE = "replace"

    class HookRegistry:
        @staticmethod
        def register(target: str, cls: type, kind: str) -> None:
            calls.append((target, cls, kind))

    hooks.HookType = HookType  # type: ignore[attr-defined]
    hooks.HookRegistry = HookRegistry  # type: ignore[attr-defined]
    for name in ("sglang", "sglang.srt", "sglang.srt.disaggregation", "sglang.srt.disaggregation.mooncake",
                 "sglang.srt.plugins"):  # fmt: skip
        monkeypatch.setitem(sys.modules, name, ModuleType(name))
    monkeypatch.setitem(sys.modules, conn.__name__, conn)
    monkeypatch.setitem(sys.modules, hooks.__name__, hooks)
    monkeypatch.setattr("kvwire.hosts.host_range.host_decision", lambda host: "use")
    plugin.register()
    return calls


def test_the_plugin_replaces_sglangs_mooncake_manager_by_kvwires_subclass(registered: list[Any]) -> None:
    ((target, cls, kind),) = registered
    assert (target, kind) == ("sglang.srt.disaggregation.mooncake.conn.MooncakeKVManager", "replace")
    assert (cls.__module__, cls.__qualname__) == ("kvwire_sglang.plugin", "KvwireKVManager")
    assert cls.__bases__ == (KvwireManagerMixin, MooncakeKVManager)  # kvwire first: its methods win
    assert issubclass(cls, MooncakeKVManager)  # sglang's isinstance checks keep working
    mro = cls.__mro__
    assert mro.index(KvwireManagerMixin) < mro.index(KvwireSendMixin) < mro.index(MooncakeKVManager)


@pytest.mark.parametrize(
    ("method", "owner"),
    [
        ("init_engine", KvwireManagerMixin),
        ("build_receiver_registration_message", KvwireManagerMixin),
        ("_make_worker_recv", KvwireManagerMixin),
        ("_publish_peer_registration", KvwireManagerMixin),
        ("send_kvcache_slice", KvwireManagerMixin),
        ("teardown", KvwireManagerMixin),
        ("send_kvcache", KvwireSendMixin),
    ],
)
def test_every_method_kvwire_overrides_resolves_to_kvwire(registered: list[Any], method: str, owner: type) -> None:
    ((_, cls, _),) = registered
    found = next(klass for klass in cls.__mro__ if method in vars(klass))
    assert found is owner


def test_an_sglang_without_the_methods_kvwire_hooks_into_stops_the_process(
    registered: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    class Older:
        def init_engine(self) -> None: ...

    monkeypatch.setattr(sys.modules["sglang.srt.disaggregation.mooncake.conn"], "MooncakeKVManager", Older)
    with pytest.raises(SystemExit) as exc:
        plugin.register()
    assert str(exc.value).startswith(
        "kvwire-sglang: this sglang's MooncakeKVManager has no build_receiver_registration_message, "
        "_make_worker_recv, _publish_peer_registration"
    )
