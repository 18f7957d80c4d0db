"""kvwire serves an MLA model (a tiny DeepSeek-V2) through sglang's own servers, and the example runs as documented.

A module of its own so that its servers do not run beside the llama deployment's (test_sglang_serving.py).
sglang's CPU path needs the ``kvwire_cpu`` plugin's MLA handler for ``torch_native`` (see ``kvwire_sglang.cpu``).
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sglang_serving import (
    EXAMPLE,
    LLAMA_PAGE_BYTES,
    MLA_BUFFERS,
    MLA_PAGE_BYTES,
    PYTHON,
    STRICT_ENV,
    assert_no_leak,
    build_venv,
    counters_delta,
    load_deploy,
    make_model,
    one_deployment_at_a_time,
    pages,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sglang-servers"), pytest.mark.timeout(1800)]

LENGTHS = [1, 40, 300]


@pytest.fixture(scope="module")
def deploy() -> Iterator[Any]:
    build_venv()
    with one_deployment_at_a_time():  # torn down last: held until this module's servers are stopped
        yield load_deploy()


def _start(deploy: Any, model: Path, role: str, work: Path, plugins: str | None = None, *, name: str) -> Any:
    plugins = plugins or deploy.KVWIRE_PLUGINS
    chunk = 64 if role != "decode" else None
    return deploy.start_server(
        model, role, work, plugins=plugins, chunked_prefill_size=chunk, env=STRICT_ENV, python=PYTHON, name=name
    )


def _tokens(deploy: Any, url: str, ids: list[int]) -> list[int]:
    tokens: list[int] = deploy.output_ids(deploy.generate(url, ids))
    return tokens


@pytest.fixture(scope="module")
def mla(deploy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """A tiny DeepSeek-V2 (MLA): one plain server, a kvwire pair and a kvwire prefill of other latent weights."""
    work = tmp_path_factory.mktemp("sglang-serving-mla")
    model = make_model(work / "mla", "mla")
    other_kv = make_model(work / "mla-other-kv", "mla", kv_seed=1)
    servers: dict[str, Any] = {}
    routers: dict[str, Any] = {}
    try:
        servers.update(
            {
                "single": _start(deploy, model, "single", work, deploy.STOCK_PLUGINS, name="single"),
                "prefill": _start(deploy, model, "prefill", work, name="prefill"),
                "decode": _start(deploy, model, "decode", work, name="decode"),
                "prefill_other_kv": _start(deploy, other_kv, "prefill", work, name="prefill_other_kv"),
            }
        )
        for server in servers.values():
            server.wait_ready(900)
        for name, prefill in (("kvwire", "prefill"), ("other_kv", "prefill_other_kv")):
            routers[name] = deploy.start_router(
                servers[prefill], servers["decode"], work, python=PYTHON, name=f"router_{name}"
            )
        for router in routers.values():
            router.wait_ready(300)
        yield SimpleNamespace(work=work, routers=routers, **servers)
        assert_no_leak(*servers.values())
    finally:
        for process in [*routers.values(), *servers.values()]:
            process.stop()


def test_an_mla_model_served_through_kvwire(deploy: Any, mla: SimpleNamespace) -> None:
    before = deploy.metrics(mla.prefill.url)
    seen: set[int] = set()
    for n in LENGTHS:
        ids = deploy.prompt(n, seed=n)
        expected = _tokens(deploy, mla.single.url, ids)
        seen.update(expected)
        assert _tokens(deploy, mla.routers["kvwire"].url, ids) == expected, n
        assert _tokens(deploy, mla.routers["other_kv"].url, ids) != expected, n
    assert len(seen) > 10, seen  # the model is not degenerate
    moved = counters_delta(before, deploy.metrics(mla.prefill.url))
    assert moved["kvwire_send_bytes_total"] == pages(LENGTHS) * MLA_PAGE_BYTES, moved
    assert moved["kvwire_send_descriptors_before_coalescing_total"] == pages(LENGTHS) * MLA_BUFFERS, moved


def test_the_example_runs_as_documented(deploy: Any, tmp_path: Path) -> None:
    """``examples/pd-sglang/run.py --compare``, as the README runs it (with --json to read its result)."""
    proc = subprocess.run(
        [PYTHON, str(EXAMPLE / "run.py"), "--compare", "--json", "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["tokens_equal"] is True and len(result["output_ids"]) == 16, result
    assert result["kvwire"]["kvwire_send_bytes_total"] == pages([100]) * LLAMA_PAGE_BYTES, result
