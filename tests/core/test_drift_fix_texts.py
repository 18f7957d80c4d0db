"""Drift fix texts suggest only what applies, and each pair of signatures is printed once per hook."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor

import numpy as np
from numpy.typing import NDArray

import kvwire
from kvwire.registry.findings import BackendOrigin, Finding, render_findings

from backends_for_tests import Recorder, Recorder11

ORIGIN = BackendOrigin("t", "kvtest", "1.0", "mod:Cls")
ADD = "add `dst_device_kv_indices: NDArray[np.int32] | None = None` after `dst_layer_ids`"


def _missing(cls: type) -> Finding:
    (finding,) = [f for f in kvwire.validate_backend(cls, ORIGIN).findings if f.rule == "missing-parameter"]
    return finding


def test_a_capability_never_declared_is_not_to_be_dropped() -> None:
    class Undeclared(Recorder11):  # a 1.1 signature, no 'device_kv_indices' among its capabilities
        spec_version = "1.2"

    assert _missing(Undeclared).fix == f"{ADD}, or declare spec_version = '1.1' to load adapted with that feature off"


def test_every_declared_capability_the_older_version_lacks_is_to_be_dropped() -> None:
    class Declared(Recorder11):
        spec_version = "1.2"
        capabilities = frozenset({"layer_ids", "device_kv_indices", "notifications", "mha", "host_memory"})

    assert _missing(Declared).fix == (
        f"{ADD}, or declare spec_version = '1.1' and drop 'device_kv_indices' and 'notifications' from capabilities "
        "to load adapted with that feature off"
    )


def test_no_older_version_is_suggested_when_none_has_these_parameters() -> None:
    """The sglang #33523 shape: the 1.3 parameters are there, the 1.2 one is not: declaring 1.1 would not load."""

    class Ascend(Recorder):
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

    assert _missing(Ascend).fix == ADD
    declared_older = type("AscendOlder", (Ascend,), {"spec_version": "1.1"})
    assert kvwire.validate_backend(declared_older, ORIGIN).status == "drift"  # why it is not suggested


class KeywordOnly(Recorder):
    """Every parameter after the first keyword-only, and the later ones missing: many findings, one hook."""

    @kvwire.hookimpl
    def send_kvcache(  # type: ignore[override]
        self,
        session_id: str,
        *,
        prefill_kv_indices: NDArray[np.int32],
        dst_kv_ptrs: Sequence[int],
        dst_kv_indices: NDArray[np.int32],
        executor: Executor | None,
        dst_layer_ids: Sequence[int] | None = None,
    ) -> int:
        return 0


def test_one_hooks_findings_print_both_signatures_once() -> None:
    findings = kvwire.validate_backend(KeywordOnly, ORIGIN).findings
    kinds = [f for f in findings if f.rule == "parameter-kind"]
    assert len(kinds) == 5
    text = render_findings(findings)
    lines = text.splitlines()
    assert [line for line in lines if line.startswith("    spec: ")] == [f"    spec: {findings[0].spec_signature}"]
    assert [line for line in lines if line.startswith("    impl: ")] == [f"    impl: {findings[0].impl_signature}"]
    assert lines[0] == f"backend 't' (kvtest 1.0, entry point mod:Cls), hook send_kvcache: {len(findings)} findings"
    for finding in findings:  # every rule, message and fix is still there, once
        assert lines.count(f"    [{finding.rule}] {finding.message}") == 1
        assert lines.count(f"        fix:  {finding.fix}") == 1


def test_a_finding_alone_renders_as_before() -> None:
    class Drifted(Recorder11):
        spec_version = "1.2"

    findings = kvwire.validate_backend(Drifted, ORIGIN).findings
    assert len(findings) == 1
    assert render_findings(findings) == findings[0].render()


def test_findings_of_different_hooks_keep_their_own_signatures() -> None:
    class TwoHooks(KeywordOnly):
        @kvwire.hookimpl
        def add_peer(self, session_id: str, *, layout: kvwire.KVLayout) -> None:  # type: ignore[override]
            pass

    findings = kvwire.validate_backend(TwoHooks, ORIGIN).findings
    assert {f.hook for f in findings} == {"send_kvcache", "add_peer"}
    lines = render_findings(findings).splitlines()
    assert sum(line.lstrip().startswith("spec: ") for line in lines) == 2
    assert sum(line.lstrip().startswith("impl: ") for line in lines) == 2
