"""kvwire_sglang against sglang's real, released source (read with ast from the wheel, never imported)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvwire.spec import CURRENT, spec_hooks
from kvwire_sglang import KvwireManagerMixin, KvwireSendMixin, layout_from_kv_args

pytestmark = pytest.mark.slow

#: sglang's name for the first parameter, kvwire's for the same value.
RENAMED = {"mooncake_session_id": "session_id"}


def _method(tree: ast.Module, cls: str, name: str) -> ast.FunctionDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} not found")


def _params(func: ast.FunctionDef) -> list[tuple[str, str, str | None, str | None]]:
    """(kind, name, annotation, default) of every parameter, as written in the source."""
    a = func.args
    out: list[tuple[str, str, str | None, str | None]] = []
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults)):
        kind = "positional-only" if i < len(a.posonlyargs) else "positional-or-keyword"
        out.append((kind, arg.arg, _text(arg.annotation), _text(default)))
    if a.vararg:
        out.append(("*args", a.vararg.arg, _text(a.vararg.annotation), None))
    for arg, kw_default in zip(a.kwonlyargs, a.kw_defaults):
        out.append(("keyword-only", arg.arg, _text(arg.annotation), _text(kw_default)))
    if a.kwarg:
        out.append(("**kwargs", a.kwarg.arg, _text(a.kwarg.annotation), None))
    return out


def _text(node: ast.expr | None) -> str | None:
    return None if node is None else ast.unparse(node)


@pytest.fixture(scope="module")
def conn_py(sglang_source: Callable[[str], Path]) -> ast.Module:
    path = sglang_source("0.5.23") / "sglang" / "srt" / "disaggregation" / "mooncake" / "conn.py"
    return ast.parse(path.read_text(), str(path))


def test_the_adapter_has_exactly_sglangs_send_kvcache_parameters(conn_py: ast.Module) -> None:
    sglang = _params(_method(conn_py, "MooncakeKVManager", "send_kvcache"))
    own = ast.parse(textwrap.dedent(inspect.getsource(KvwireSendMixin.send_kvcache)))
    adapter = _params(own.body[0])  # type: ignore[arg-type]
    assert adapter == sglang
    assert [name for _, name, _, _ in sglang] == [
        "self",
        "mooncake_session_id",
        "prefill_kv_indices",
        "dst_kv_ptrs",
        "dst_kv_indices",
        "executor",
        "dst_layer_ids",
        "dst_device_kv_indices",
        "dst_kv_item_len",
        "dst_attn_tp_size",
    ]


def _send_calls(tree: ast.Module, cls: str) -> list[tuple[str, int, ast.Call]]:
    """(calling method, line, call) of every ``self.send_kvcache(...)`` in class ``cls``."""
    calls = []
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for method in node.body:
                if not isinstance(method, ast.FunctionDef):
                    continue
                for sub in ast.walk(method):
                    if (
                        isinstance(sub, ast.Call)
                        and isinstance(sub.func, ast.Attribute)
                        and sub.func.attr == "send_kvcache"
                        and isinstance(sub.func.value, ast.Name)
                        and sub.func.value.id == "self"
                    ):
                        calls.append((method.name, sub.lineno, sub))
    return calls


def test_every_call_of_the_transfer_worker_is_accepted_by_spec_and_adapter(conn_py: ast.Module) -> None:
    calls = _send_calls(conn_py, "MooncakeKVManager")
    assert [(method, len(call.args)) for method, _, call in calls] == [("transfer_worker", 5)]
    spec = [p.name for p in spec_hooks(CURRENT)["send_kvcache"].params]
    adapter = list(inspect.signature(KvwireSendMixin.send_kvcache).parameters)[1:]
    for method, line, call in calls:
        keywords = [k.arg for k in call.keywords]
        assert None not in keywords, f"{method} line {line} passes **kwargs"
        assert keywords == ["dst_layer_ids", "dst_device_kv_indices", "dst_kv_item_len", "dst_attn_tp_size"]
        for keyword in keywords:
            assert keyword in spec, f"spec {CURRENT} lacks {keyword}, passed by {method} line {line}"
            assert keyword in adapter, f"the adapter lacks {keyword}, passed by {method} line {line}"
        positional = [RENAMED.get(name, name) for name in adapter[: len(call.args)]]
        assert positional == spec[: len(call.args)]  # same order: a positional caller lands on the same names


@pytest.fixture(scope="module")
def common_py(sglang_source: Callable[[str], Path]) -> ast.Module:
    path = sglang_source("0.5.23") / "sglang" / "srt" / "disaggregation" / "common" / "conn.py"
    return ast.parse(path.read_text(), str(path))


def test_send_kvcache_slice_has_exactly_sglangs_parameters(conn_py: ast.Module) -> None:
    sglang = _params(_method(conn_py, "MooncakeKVManager", "send_kvcache_slice"))
    own = ast.parse(textwrap.dedent(inspect.getsource(KvwireManagerMixin.send_kvcache_slice)))
    assert _params(own.body[0]) == sglang  # type: ignore[arg-type]


#: Every sglang method the manager mixin overrides, and the class of sglang 0.5.23 that defines it.
OVERRIDDEN = {
    "init_engine": ("mooncake", "MooncakeKVManager"),
    "build_receiver_registration_message": ("mooncake", "MooncakeKVManager"),
    "_publish_peer_registration": ("mooncake", "MooncakeKVManager"),
    "teardown": ("mooncake", "MooncakeKVManager"),
    "_make_worker_recv": ("common", "CommonKVManager"),
}


def test_every_method_the_manager_mixin_overrides_exists_in_sglang_with_the_same_parameters(
    conn_py: ast.Module, common_py: ast.Module
) -> None:
    overridden = {
        name
        for name, value in vars(KvwireManagerMixin).items()
        if callable(value) and not name.startswith(("kvwire", "_kvwire"))  # the mixin's own, not sglang's
    }
    assert overridden - {"send_kvcache_slice"} == set(OVERRIDDEN)
    for name, (module, cls) in OVERRIDDEN.items():
        theirs = _params(_method(conn_py if module == "mooncake" else common_py, cls, name))
        own = ast.parse(textwrap.dedent(inspect.getsource(getattr(KvwireManagerMixin, name))))
        ours = _params(own.body[0])  # type: ignore[arg-type]
        # names, kinds and defaults as sglang calls them; the annotations are the mixin's own
        assert [(k, n, d) for k, n, _, d in ours] == [(k, n, d) for k, n, _, d in theirs], name


# -- draft-model KV and HiSparse: what sglang 0.5.23 builds, as kvwire reads it --------------------------------


@pytest.fixture(scope="module")
def disaggregation_dir(sglang_source: Callable[[str], Path]) -> Path:
    return sglang_source("0.5.23") / "sglang" / "srt" / "disaggregation"


def _function(path: Path, name: str) -> Callable[..., Any]:
    """A pure module-level function of sglang's source, compiled on its own (its module is never imported)."""
    tree = ast.parse(path.read_text(), str(path))
    (node,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == name]
    namespace: dict[str, Any] = {"List": list}
    exec(compile(ast.Module([node], []), str(path), "exec"), namespace)
    function: Callable[..., Any] = namespace[name]
    return function


def test_kvwire_reads_a_hybrid_pools_draft_band_as_sglangs_own_remap_builds_it(disaggregation_dir: Path) -> None:
    """build_kv_layer_ids: target ids (``layer_ids * 2`` for MHA), then _remap_draft_layer_ids of the draft's."""
    remap = _function(disaggregation_dir / "utils.py", "_remap_draft_layer_ids")
    mha = [3, 5, 3, 5, *remap([0, 1, 0, 1], 6)]  # a draft pool of 2 layers registers k0 k1 v0 v1
    mla = [3, 5, *remap([0, 1], 61)]
    assert (mha, mla) == ([3, 5, 3, 5, 6, 7, 6, 7], [3, 5, 61, 62])
    n = len(mha)
    layout = layout_from_kv_args(
        [4096 * (i + 1) for i in range(n)],
        [1024] * n,
        [256] * n,
        mha,
        attention="mha",
        memory="host",
        num_draft_entries=4,
    )
    assert [(b.layer, b.role) for b in layout.buffers] == [
        (3, "k"),
        (5, "k"),
        (3, "v"),
        (5, "v"),
        (6, "k"),
        (7, "k"),
        (6, "v"),
        (7, "v"),
    ]
    latent = layout_from_kv_args(
        [4096, 8192, 12288, 16384], [1024] * 4, [256] * 4, mla, attention="mla", memory="host", num_draft_entries=2
    )
    assert [b.layer for b in latent.buffers] == [3, 5, 61, 62]


def test_sglang_appends_draft_kv_after_the_targets_and_a_hisparse_decode_registers_it_from_the_device(
    disaggregation_dir: Path,
) -> None:
    """The orders kvwire-sglang's labels rely on, in sglang 0.5.23's own source (drift here means relabelling)."""
    prefill = " ".join((disaggregation_dir / "prefill.py").read_text().split())
    decode = " ".join((disaggregation_dir / "decode.py").read_text().split())
    conn = " ".join((disaggregation_dir / "mooncake" / "conn.py").read_text().split())
    for source in (prefill, decode):
        assert "kv_data_ptrs += draft_kv_data_ptrs" in source
        assert "num_draft_entries = len(draft_kv_data_ptrs)" in source
    # the decode: the target's buffers from the HiSparse host pool (DRAM), the draft's from the device (VRAM)
    assert "self.scheduler.hisparse_coordinator.mem_pool_host if self.scheduler.enable_hisparse" in decode
    assert 'kv_data_mem_kinds += ["VRAM"] * len(draft_kv_data_ptrs)' in decode
    # the prefill's send: the last num_draft_entries destination buffers take the device page ids
    assert "host_backed_kv_count = len(dst_kv_ptrs) - num_draft_entries" in conn
