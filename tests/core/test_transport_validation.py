"""The short path validated at load: a TransportBackend's transport class against kvwire.Transport."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

import kvwire
from kvwire import BackendConfig, Notification, TransferPlan, Transport, TransportBackend
from kvwire.registry.findings import BackendOrigin
from kvwire.registry.transport_check import transport_methods

ORIGIN = BackendOrigin("third", "kvwire-third", "0.3.0", "kvwire_third:Backend")
CAPS = frozenset({"mha", "host_memory"})


class Good(Transport):
    @property
    def endpoint(self) -> str:
        return "good"

    def register_memory(self, base: int, nbytes: int) -> None: ...

    def unregister_memory(self, base: int) -> None: ...

    def write(self, session_id: str, plan: TransferPlan) -> None: ...

    def close(self) -> None: ...


def backend_of(transport: type, capabilities: frozenset[str] = CAPS, version: str = "1.5") -> type:
    def open_transport(self: TransportBackend, config: BackendConfig) -> Transport:
        return transport()  # type: ignore[no-any-return]

    open_transport.__annotations__["return"] = transport
    attrs = {"spec_version": version, "capabilities": capabilities, "open_transport": open_transport}
    return type("Backend", (TransportBackend,), attrs)


def findings(cls: type) -> list[tuple[str, str, str]]:
    result = kvwire.validate_backend(cls, ORIGIN)
    return [(f.hook, f.rule, f.message) for f in result.findings]


def test_a_transport_as_in_the_contract_is_ok() -> None:
    assert kvwire.validate_backend(backend_of(Good), ORIGIN).status == "ok"


def test_an_extra_required_write_parameter_is_drift_with_both_signatures_and_the_fix() -> None:
    class Flags(Good):
        def write(self, session_id: str, plan: TransferPlan, flags: int) -> None: ...  # type: ignore[override]

    result = kvwire.validate_backend(backend_of(Flags), ORIGIN)
    assert result.status == "drift"
    (finding,) = result.findings
    assert (finding.hook, finding.rule, finding.message) == (
        "Flags.write",
        "unknown-parameter",
        "parameter `flags` is not in kvwire.Transport.write",
    )
    assert finding.spec_signature == "write(session_id: str, plan: TransferPlan) -> None"
    assert finding.impl_signature.startswith("write(session_id: str, plan: ") and "flags: int" in finding.impl_signature
    assert finding.fix == (
        "remove `flags`: kvwire.TransportBackend calls `write(session_id: str, plan: TransferPlan) -> None`, never "
        "with it"
    )
    assert "kvwire-third 0.3.0" in finding.render()


def test_a_missing_write_parameter_is_drift() -> None:
    class NoPlan(Good):
        def write(self, session_id: str) -> None: ...  # type: ignore[override]

    assert findings(backend_of(NoPlan)) == [
        ("NoPlan.write", "missing-parameter", "parameter `plan` is missing (the caller's value would be dropped)")
    ]


def test_renamed_reordered_and_keyword_only_parameters_are_drift() -> None:
    class Renamed(Good):
        def write(self, session: str, plan: TransferPlan) -> None: ...  # type: ignore[override]

    class Reordered(Good):
        def write(self, plan: TransferPlan, session_id: str) -> None: ...  # type: ignore[override]

    class KeywordOnly(Good):
        def write(self, session_id: str, *, plan: TransferPlan) -> None: ...  # type: ignore[override]

    assert [r for _, r, _ in findings(backend_of(Renamed))] == ["unknown-parameter"]
    assert [r for _, r, _ in findings(backend_of(Reordered))] == ["parameter-order"]
    assert findings(backend_of(KeywordOnly)) == [
        (
            "KeywordOnly.write",
            "parameter-kind",
            "parameter `plan` is keyword-only, the spec's is positional-or-keyword",
        )
    ]


def test_a_default_an_annotation_and_var_args_that_differ_are_drift() -> None:
    class Defaulted(Good):
        def register_memory(self, base: int, nbytes: int = 0) -> None: ...

    class Annotated(Good):
        def unregister_memory(self, base: str) -> None: ...  # type: ignore[override]

    class Swallows(Good):
        def write(self, *args: object, **kwargs: object) -> None: ...

    assert [r for _, r, _ in findings(backend_of(Defaulted))] == ["default-mismatch"]
    assert [r for _, r, _ in findings(backend_of(Annotated))] == ["annotation-mismatch"]
    assert [r for _, r, _ in findings(backend_of(Swallows))][:2] == ["var-args", "var-args"]


def test_an_endpoint_that_is_not_a_property_is_drift() -> None:
    class Method(Good):
        def endpoint(self) -> str:  # type: ignore[override]
            return "x"

    assert findings(backend_of(Method)) == [
        ("Method.endpoint", "parameter-kind", "`endpoint` must be a property, as in kvwire.Transport")
    ]


@pytest.mark.parametrize(
    ("feature", "methods"),
    [("submit", ["submit"]), ("notifications", ["notify", "poll_notifications"])],
)
def test_a_declared_capability_without_its_transport_method_is_drift_with_the_fix(
    feature: str, methods: list[str]
) -> None:
    result = kvwire.validate_backend(backend_of(Good, CAPS | {feature}), ORIGIN)
    assert result.status == "drift"
    assert [(f.hook, f.rule, f.message) for f in result.findings] == [
        (f"Good.{m}", "missing-method", f"declares {feature!r} but its transport Good does not implement `{m}`")
        for m in methods
    ]
    for finding, method in zip(result.findings, methods):
        assert finding.fix.startswith(f"add `def {method}(self")
        assert finding.fix.endswith(f"to Good, or drop {feature!r} from capabilities")


def test_declared_capabilities_with_their_methods_are_ok_and_their_signatures_checked() -> None:
    class Full(Good):
        def submit(self, session_id: str, plan: TransferPlan, notification: bytes | None) -> Future[None]:
            raise NotImplementedError

        def notify(self, session_id: str, message: bytes) -> None: ...

        def poll_notifications(self) -> list[Notification]:
            return []

        def raw_write(self, session_id: str, plan: TransferPlan) -> None: ...

    every = CAPS | {"submit", "notifications"}
    assert kvwire.validate_backend(backend_of(Full, every), ORIGIN).status == "ok"

    class LateNotify(Full):
        def notify(self, session_id: str, message: bytes, urgent: bool) -> None: ...  # type: ignore[override]

    assert findings(backend_of(LateNotify, every)) == [
        ("LateNotify.notify", "unknown-parameter", "parameter `urgent` is not in kvwire.Transport.notify")
    ]


def test_methods_a_later_spec_added_are_not_asked_of_an_older_backend() -> None:
    class Old(Good):
        def forget_peer(self, session_id: str, why: str) -> None: ...  # type: ignore[override]

    assert transport_methods()["forget_peer"][1] == kvwire.SpecVersion(1, 4)
    assert findings(backend_of(Old, version="1.3")) == []
    assert [r for _, r, _ in findings(backend_of(Old, version="1.4"))] == ["unknown-parameter"]


def test_a_missing_abstract_method_is_drift() -> None:
    class NoClose(Transport):
        @property
        def endpoint(self) -> str:
            return "x"

        def register_memory(self, base: int, nbytes: int) -> None: ...

        def unregister_memory(self, base: int) -> None: ...

        def write(self, session_id: str, plan: TransferPlan) -> None: ...

    assert findings(backend_of(NoClose)) == [
        ("NoClose.close", "missing-method", "required method `close` of kvwire.Transport is not implemented")
    ]


def test_an_unannotated_open_transport_is_read_from_its_return_statement() -> None:
    class Flags(Good):
        def write(self, session_id: str, plan: TransferPlan, flags: int) -> None: ...  # type: ignore[override]

    class Unannotated(TransportBackend):
        spec_version = "1.5"
        capabilities = CAPS

        def open_transport(self, config):  # type: ignore[no-untyped-def]
            return Flags()

    assert [r for _, r, _ in findings(Unannotated)] == ["unknown-parameter"]


def test_a_transport_class_that_cannot_be_told_is_drift_with_the_fix() -> None:
    class Opaque(TransportBackend):
        spec_version = "1.5"
        capabilities = CAPS

        def open_transport(self, config: BackendConfig) -> Transport:
            return self.make()

        def make(self) -> Transport:
            return Good()

    ((hook, rule, message),) = findings(Opaque)
    assert (hook, rule) == ("open_transport", "transport-class")
    assert message.startswith("cannot tell which kvwire.Transport subclass `open_transport` returns")


def test_inherited_transport_methods_name_the_parent() -> None:
    class Parent(Good):
        def write(self, session_id: str, plan: TransferPlan, flags: int) -> None: ...  # type: ignore[override]

    class Child(Parent):
        pass

    (finding,) = kvwire.validate_backend(backend_of(Child), ORIGIN).findings
    assert finding.hook == "Child.write"
    assert finding.defined_in is not None
    assert finding.defined_in.endswith("test_inherited_transport_methods_name_the_parent.<locals>.Parent")


def test_the_shipped_backends_stay_ok() -> None:
    registry = kvwire.Registry()
    statuses = {info.name: info.status for info in registry.scan()}
    for name in ("local", "mooncake", "nixl", "ascend", "hisparse"):
        assert statuses.get(name) == "ok", (name, statuses)
