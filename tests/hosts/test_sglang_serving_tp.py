"""kvwire serves across attention TP sizes: a TP-1 prefill into a ``--tp-size 2`` decode, sglang's own servers.

Each decode rank holds one of the tiny llama's two KV heads; kvwire's planner slices every page of the
prefill's two-head buffers by head and sends each slice to the rank that holds it. A slice sent to the
wrong rank, or the wrong head of a page, is read by the decode as its own KV and changes its tokens.
A module of its own: a TP-2 decode is two schedulers (about 2.5 GB) and starts in about 95 s here.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from sglang_serving import (
    LLAMA_BUFFERS,
    LLAMA_PAGE_BYTES,
    PAGE,
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
#: sglang's CPU engine binds each TP rank's OpenMP threads to the cores this names, one group per rank.
TP2_ENV = {**STRICT_ENV, "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
#: kvwire's own configuration, read by the kvwire plugin inside sglang's scheduler (docs/configuration.md).
PREFILL_ENV = {**STRICT_ENV, "KVWIRE_TIMEOUT_S": "20"}


@pytest.fixture(scope="module")
def deploy() -> Iterator[Any]:
    build_venv()
    with one_deployment_at_a_time():  # torn down last: held until this module's servers are stopped
        yield load_deploy()


@pytest.fixture(scope="module")
def tp(deploy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """One plain server, a TP-1 kvwire prefill and a TP-2 kvwire decode behind sglang's router."""
    work = tmp_path_factory.mktemp("sglang-serving-tp")
    model = make_model(work / "llama")
    servers: dict[str, Any] = {}
    router = None
    try:
        servers["single"] = deploy.start_server(
            model, "single", work, plugins=deploy.STOCK_PLUGINS, env=STRICT_ENV, python=PYTHON, name="single"
        )
        servers["prefill"] = deploy.start_server(
            model, "prefill", work, chunked_prefill_size=64, env=PREFILL_ENV, python=PYTHON, name="prefill"
        )
        servers["decode"] = deploy.start_server(
            model, "decode", work, tp_size=2, env=TP2_ENV, python=PYTHON, name="decode_tp2"
        )
        for server in servers.values():
            server.wait_ready(900)
        router = deploy.start_router(servers["prefill"], servers["decode"], work, python=PYTHON, name="router")
        router.wait_ready(300)
        yield SimpleNamespace(router=router, model=model, work=work, **servers)
        assert_no_leak(*servers.values())
    finally:
        for process in [router, *servers.values()]:
            if process is not None:
                process.stop()


def test_a_tp1_prefill_serves_a_tp2_decode_through_kvwire(deploy: Any, tp: SimpleNamespace) -> None:
    before = deploy.metrics(tp.prefill.url)
    for n in LENGTHS:
        ids = deploy.prompt(n, seed=n)
        expected = deploy.output_ids(deploy.generate(tp.single.url, ids))
        assert deploy.output_ids(deploy.generate(tp.router.url, ids)) == expected, n
    moved = counters_delta(before, deploy.metrics(tp.prefill.url))
    # Every head of every page once, split between the two decode ranks: the same bytes as an equal-TP pair.
    # sglang's buffers are token-major ([token, head, dim]): one head of a page is 16 runs of one token's head,
    # so each page of each buffer is 16 tokens x 2 ranks descriptors before coalescing.
    assert moved["kvwire_send_bytes_total"] == pages(LENGTHS) * LLAMA_PAGE_BYTES, moved
    runs = pages(LENGTHS) * LLAMA_BUFFERS * PAGE * 2
    assert moved["kvwire_send_descriptors_before_coalescing_total"] == runs, moved
    assert moved.get("kvwire_send_failures_total", 0.0) == 0.0, moved


def test_the_tp2_decode_serves_a_repeated_prompt(deploy: Any, tp: SimpleNamespace) -> None:
    """A prompt seen before (a prefix-cache hit on the prefill) still lands on the right ranks."""
    ids = deploy.prompt(80, seed=7)
    expected = deploy.output_ids(deploy.generate(tp.single.url, ids))
    for _ in range(2):
        assert deploy.output_ids(deploy.generate(tp.router.url, ids)) == expected


def test_kvwires_configuration_is_read_inside_sglangs_scheduler(deploy: Any, tp: SimpleNamespace) -> None:
    """The prefill's activation line names the setting its variable made; a bad value stops a server at start."""
    log = tp.prefill.log.read_text(errors="replace")
    assert "; configured: timeout_s=20.0 ($KVWIRE_TIMEOUT_S)" in log, tp.prefill.tail(40)
    bad = deploy.start_server(
        tp.model, "prefill", tp.work, env={**STRICT_ENV, "KVWIRE_TIMEOUT_S": "five"}, python=PYTHON, name="bad"
    )
    try:
        bad.popen.wait(timeout=600)
        text = bad.log.read_text(errors="replace")
        assert "ConfigError: $KVWIRE_TIMEOUT_S='five' is not a number; write e.g. KVWIRE_TIMEOUT_S=5" in text, bad.tail(
            40
        )
    finally:
        bad.stop()
