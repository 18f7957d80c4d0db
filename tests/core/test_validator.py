"""Validator details that need no installed wheel: normalisation, inference, capabilities."""

from __future__ import annotations

import typing
from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
import pytest
from numpy.typing import NDArray

import kvwire
from kvwire.registry.annotations import annotation_key
from kvwire.registry.findings import BackendOrigin

from backends_for_tests import Recorder, Recorder11

ORIGIN = BackendOrigin("t", "kvtest", "1.0", "mod:Cls")


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (typing.Optional[int], int | None),  # noqa: UP045
        (typing.Union[None, str], str | None),  # noqa: UP007
        (typing.Sequence[int], Sequence[int]),
        (typing.List[int], list[int]),  # noqa: UP006
        (typing.Optional[NDArray[np.int32]], NDArray[np.int32] | None),  # noqa: UP045
    ],
)
def test_equivalent_annotations(a: object, b: object) -> None:
    assert annotation_key(a) == annotation_key(b)


@pytest.mark.parametrize(
    ("a", "b"),
    [(int, str), (Sequence[int], list[int]), (NDArray[np.int32], NDArray[np.int64]), (int | None, int)],
)
def test_different_annotations(a: object, b: object) -> None:
    assert annotation_key(a) != annotation_key(b)


def test_inferred_version_and_explicit_adapted() -> None:
    class Undeclared(Recorder11):
        spec_version = None

    result = kvwire.validate_backend(Undeclared, ORIGIN)
    assert (result.status, result.spec_version, result.declared_spec_version) == ("adapted", "1.1", None)
    assert kvwire.validate_backend(Recorder, ORIGIN).status == "ok"


def test_unresolvable_string_annotation() -> None:
    namespace: dict[str, object] = {}
    exec(
        "import kvwire\nclass B:\n    @kvwire.hookimpl\n    def endpoint(self) -> 'Missing': ...\n",
        namespace,
    )

    class Bad(Recorder):
        endpoint = namespace["B"].endpoint  # type: ignore[attr-defined]

    findings = [f for f in kvwire.validate_backend(Bad, ORIGIN).findings if f.hook == "endpoint"]
    assert [f.rule for f in findings] == ["annotation-mismatch"]
    assert findings[0].message == (
        "the return value cannot resolve annotation 'Missing': NameError: name 'Missing' is not defined (spec: `str`)"
    )


def test_capability_findings() -> None:
    class Claims(Recorder11):
        capabilities = frozenset({"layer_ids", "device_kv_indices", "layer_id"})

    messages = [f.message for f in kvwire.validate_backend(Claims, ORIGIN).findings]
    assert messages == [
        "unknown feature 'layer_id'; did you mean 'layer_ids'?",
        "declares 'device_kv_indices', but spec 1.1 has no parameter or hook for it",
    ]


def test_unmarked_hook_and_non_class() -> None:
    class Unmarked(Recorder):
        def close(self) -> None:  # not marked: pluggy would never call it
            pass

    (finding,) = kvwire.validate_backend(Unmarked, ORIGIN).findings
    assert (finding.rule, finding.fix) == ("missing-hook", "decorate `close` with @kvwire.hookimpl")
    (finding,) = kvwire.validate_backend(lambda config: None, ORIGIN).findings
    assert finding.rule == "constructor"
    assert finding.message == "the entry point names a function, not a class"


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        ("1.7", f"spec_version 1.7 is newer than this kvwire's spec {kvwire.SPEC_VERSION}"),
        ("one", "spec version must look like '1.2', got 'one'"),
        ("0.9", f"spec_version 0.9 is of major version 0; this kvwire implements {kvwire.SPEC_VERSION}"),
    ],
)
def test_spec_version_rule(declared: str, message: str) -> None:
    cls = type("V", (Recorder,), {"spec_version": declared})
    findings = kvwire.validate_backend(cls, ORIGIN).findings
    assert [(f.rule, f.message) for f in findings] == [("spec-version", message)]


def test_finding_render_names_everything() -> None:
    class Drifted(Recorder11):
        spec_version = "1.2"

    (finding,) = kvwire.validate_backend(Drifted, ORIGIN).findings
    text = finding.render()
    assert text.splitlines()[0] == (
        "[missing-parameter] backend 't' (kvtest 1.0, entry point mod:Cls), hook send_kvcache "
        "(inherited from backends_for_tests:Recorder11): "
        "parameter `dst_device_kv_indices` added in spec 1.2 is missing (the caller's value would be dropped)"
    )
    assert text.splitlines()[1].startswith("    spec: send_kvcache(session_id: str, ")
    assert text.splitlines()[2].startswith("    impl: send_kvcache(session_id: str, ")
    assert text.splitlines()[3] == (
        "    fix:  add `dst_device_kv_indices: NDArray[np.int32] | None = None` after `dst_layer_ids`, "
        "or declare spec_version = '1.1' to load adapted with that feature off"  # it never declared the feature
    )
    assert finding.defined_in == "backends_for_tests:Recorder11"


def test_an_override_that_drops_a_parameter_is_one_finding_of_this_class() -> None:
    """sglang #33523: the subclass overrides send_kvcache without the new parameter; the rest is inherited."""

    class Override(Recorder):
        @kvwire.hookimpl
        def send_kvcache(
            self,
            session_id: str,
            prefill_kv_indices: NDArray[np.int32],
            dst_kv_ptrs: Sequence[int],
            dst_kv_indices: NDArray[np.int32],
            executor: Executor | None,
            dst_layer_ids: Sequence[int] | None = None,
            dst_kv_item_len: int | None = None,
            dst_attn_tp_size: int | None = None,
        ) -> int:
            return 0

    (finding,) = kvwire.validate_backend(Override, ORIGIN).findings
    assert (finding.rule, finding.hook, finding.defined_in, finding.where) == (
        "missing-parameter",
        "send_kvcache",
        None,
        "this class",
    )
    assert "hook send_kvcache: parameter `dst_device_kv_indices`" in finding.render()


def test_array_default_is_a_finding_not_a_crash() -> None:
    namespace: dict[str, object] = {}
    exec(
        "from __future__ import annotations\n"
        "import numpy as np\n"
        "from numpy.typing import NDArray\n"
        "def send_kvcache(self, session_id: str, prefill_kv_indices: NDArray[np.int32], dst_kv_ptrs, dst_kv_indices,"
        " executor, dst_layer_ids=None, dst_device_kv_indices: NDArray[np.int32] | None = np.zeros(1)) -> int: ...\n",
        namespace,
    )
    cls = type("ArrayDefault", (Recorder,), {"send_kvcache": kvwire.hookimpl(namespace["send_kvcache"])})
    rules = {(f.rule, f.message.split(" has ")[0]) for f in kvwire.validate_backend(cls, ORIGIN).findings}
    assert ("default-mismatch", "parameter `dst_device_kv_indices`") in rules


def test_capability_findings_show_both_sides() -> None:
    class Claims(Recorder11):
        capabilities = frozenset({"layer_ids", "device_kv_indices"})

    (finding,) = kvwire.validate_backend(Claims, ORIGIN).findings
    assert finding.spec_signature == "spec 1.1: send_kvcache parameters honour ['layer_ids']"
    assert finding.impl_signature == "capabilities = {device_kv_indices, layer_ids}"


def test_raw_write_is_a_retired_capability_accepted_and_dropped() -> None:
    """raw_write is a bench seam now, not a capability: a backend that still declares it loads, without it."""
    from kvwire.spec.capabilities import RETIRED_FEATURES

    cls = type("Raw", (Recorder,), {"capabilities": frozenset({"mha", "raw_write"})})
    result = kvwire.validate_backend(cls, ORIGIN)
    assert (result.status, result.findings) == ("ok", ())
    assert result.capabilities == frozenset({"mha"})
    assert "raw_write" not in kvwire.FEATURES and "kvwire.RawWriter" in RETIRED_FEATURES["raw_write"]
    typo = type("Typo", (Recorder,), {"capabilities": frozenset({"mha", "raw_writes"})})
    (finding,) = kvwire.validate_backend(typo, ORIGIN).findings  # a name that never was a feature: drift
    assert finding.message == "unknown feature 'raw_writes'"


def test_a_base_written_for_the_current_spec_serves_a_backend_declaring_an_older_one() -> None:
    """A TransportBackend subclass declaring 1.2 accepts the later optional parameters and hooks: adapted, no drift."""
    from kvwire.backends.local import LocalBackend

    class Older(LocalBackend):
        spec_version = "1.2"
        capabilities = frozenset({"layer_ids", "device_kv_indices", "mla", "host_memory"})

    result = kvwire.validate_backend(Older, ORIGIN)
    assert (result.status, result.spec_version, result.findings) == ("adapted", "1.2", ())


def test_a_later_parameter_out_of_place_is_still_drift() -> None:
    class Shuffled(Recorder):
        spec_version = "1.2"

        @kvwire.hookimpl
        def send_kvcache(
            self,
            session_id: str,
            prefill_kv_indices: NDArray[np.int32],
            dst_kv_ptrs: Sequence[int],
            dst_kv_indices: NDArray[np.int32],
            executor: Executor | None,
            dst_kv_item_len: int | None = None,
            dst_layer_ids: Sequence[int] | None = None,
            dst_device_kv_indices: NDArray[np.int32] | None = None,
        ) -> int:
            return 0

    rules = {f.rule for f in kvwire.validate_backend(Shuffled, ORIGIN).findings}
    assert rules == {"unknown-parameter"}


def test_a_hook_that_swallows_arguments_is_refused_in_process() -> None:
    """The in-process twin of the entry-point test: ``**kwargs`` in a hook hides every spec parameter."""

    class Swallows(Recorder):
        @kvwire.hookimpl
        def send_kvcache(self, session_id: str, **kwargs: object) -> int:  # type: ignore[override]
            return 0

    result = kvwire.validate_backend(Swallows, ORIGIN)
    assert result.status == "drift"
    swallowed = [f for f in result.findings if f.rule == "var-args"]
    assert [(f.hook, f.message) for f in swallowed] == [
        ("send_kvcache", "`**kwargs` would swallow arguments (pluggy passes it nothing, so values are lost)")
    ]
    assert swallowed[0].fix.startswith(
        "replace `**kwargs` with the spec's parameters: session_id, prefill_kv_indices, dst_kv_ptrs"
    )
