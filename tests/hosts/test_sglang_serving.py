"""kvwire serves real requests: sglang 0.5.23's own servers, a prefill and a decode behind sglang's router.

Started as sglang's users start them (``python -m sglang.launch_server``, ``sglang_router.launch_router
--pd-disaggregation``), by the example's own helpers (``examples/pd-sglang/deploy.py``), on sglang's CPU path
with a tiny random model. A decode's greedy tokens are compared with one plain server's: only a KV page that
landed in the right place, of the right layer, reads back as the single server's KV. kvwire's counters come
from the prefill's own ``/metrics`` (sglang ``--enable-metrics``). The check can fail: a prefill whose
KV-making weights differ gives other tokens (the decode follows the transferred KV, it does not recompute).

One deployment per module (``xdist_group``: one worker; ``make test-all`` runs ``--dist loadgroup``).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from sglang_serving import (
    LLAMA_BUFFERS,
    LLAMA_PAGE_BYTES,
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

CHUNK = 64
#: Prompt lengths: one token, several pages, and long enough for several chunks of chunked prefill.
LENGTHS = [1, 40, 300]


@pytest.fixture(scope="module")
def deploy() -> Iterator[Any]:
    build_venv()
    with one_deployment_at_a_time():  # torn down last: held until this module's servers are stopped
        yield load_deploy()


def _start(deploy: Any, model: Path, role: str, work: Path, plugins: str | None = None, *, name: str, **kw: Any) -> Any:
    return deploy.start_server(
        model,
        role,
        work,
        name=name,
        plugins=plugins or deploy.KVWIRE_PLUGINS,
        chunked_prefill_size=CHUNK if role != "decode" else None,
        env=STRICT_ENV,
        python=PYTHON,
        **kw,
    )


@pytest.fixture(scope="module")
def llama(deploy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    """One plain server; kvwire, kvwire-with-other-KV-weights and stock prefills; kvwire and stock decodes."""
    work = tmp_path_factory.mktemp("sglang-serving")
    model = make_model(work / "llama")
    other_kv = make_model(work / "llama-other-kv", kv_seed=1)
    stock = deploy.STOCK_PLUGINS
    servers: dict[str, Any] = {}
    routers: dict[str, Any] = {}
    try:
        servers.update(
            {
                "single": _start(deploy, model, "single", work, stock, name="single"),
                "prefill": _start(deploy, model, "prefill", work, name="prefill"),
                "decode": _start(deploy, model, "decode", work, name="decode"),
                "prefill_other_kv": _start(deploy, other_kv, "prefill", work, name="prefill_other_kv"),
                "prefill_stock": _start(deploy, model, "prefill", work, stock, name="prefill_stock"),
                "decode_stock": _start(deploy, model, "decode", work, stock, name="decode_stock"),
            }
        )
        for server in servers.values():
            server.wait_ready(900)
        pairs = {
            "kvwire": ("prefill", "decode"),
            "other_kv": ("prefill_other_kv", "decode"),
            "stock": ("prefill_stock", "decode_stock"),
            "stock_to_kvwire": ("prefill_stock", "decode"),
            "kvwire_to_stock": ("prefill", "decode_stock"),
        }
        for name, (p, d) in pairs.items():
            routers[name] = deploy.start_router(servers[p], servers[d], work, python=PYTHON, name=f"router_{name}")
        for router in routers.values():
            router.wait_ready(300)
        yield SimpleNamespace(work=work, model=model, routers=routers, servers=servers, **servers)
        assert_no_leak(*servers.values())  # the decode restarted by a test replaces the killed one here
    finally:
        for process in [*routers.values(), *servers.values()]:
            process.stop()


def _tokens(deploy: Any, url: str, ids: list[int], max_new_tokens: int = 16) -> list[int]:
    tokens: list[int] = deploy.output_ids(deploy.generate(url, ids, max_new_tokens=max_new_tokens))
    return tokens


def test_decode_tokens_equal_one_servers_and_kvwire_carried_every_page(deploy: Any, llama: SimpleNamespace) -> None:
    router = llama.routers["kvwire"].url
    prompts = [deploy.prompt(n, seed=n) for n in LENGTHS]
    prompts.append(prompts[1])  # the same prompt again: a prefix-cache hit on the prefill
    before = deploy.metrics(llama.prefill.url)
    seen: set[int] = set()
    for ids in prompts:
        expected = _tokens(deploy, llama.single.url, ids)
        seen.update(expected)
        assert _tokens(deploy, router, ids) == expected, len(ids)
    assert len(seen) > 10, seen  # the model is not degenerate: the comparison means something
    moved = counters_delta(before, deploy.metrics(llama.prefill.url))
    lengths = [len(p) for p in prompts]
    assert moved["kvwire_send_bytes_total"] == pages(lengths) * LLAMA_PAGE_BYTES, moved
    assert moved["kvwire_send_descriptors_before_coalescing_total"] == pages(lengths) * LLAMA_BUFFERS, moved
    # each chunk of a chunked prefill is its own send; coalescing never makes more descriptors than pages
    assert moved["kvwire_send_requests_total"] >= sum(-(-n // CHUNK) for n in lengths), moved
    assert 0 < moved["kvwire_send_descriptors_total"] <= moved["kvwire_send_descriptors_before_coalescing_total"]
    assert moved.get("kvwire_send_failures_total", 0.0) == 0.0, moved


def test_eight_requests_in_flight_at_once(deploy: Any, llama: SimpleNamespace) -> None:
    router = llama.routers["kvwire"].url
    prompts = [deploy.prompt(n, seed=1000 + n) for n in (1, 17, 33, 64, 90, 150, 220, 300)]
    expected = [_tokens(deploy, llama.single.url, ids) for ids in prompts]
    before = deploy.metrics(llama.prefill.url)
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(lambda ids: _tokens(deploy, router, ids), prompts))
    assert got == expected
    moved = counters_delta(before, deploy.metrics(llama.prefill.url))
    assert moved["kvwire_send_bytes_total"] == pages([len(p) for p in prompts]) * LLAMA_PAGE_BYTES, moved


def test_the_decode_follows_the_transferred_kv_not_a_recomputation(deploy: Any, llama: SimpleNamespace) -> None:
    """A prefill whose v_proj differs: the decode's tokens differ from one server's (and so from a decode that
    recomputed the prompt with its own weights), and they are the same on every run: the KV moved and is read."""
    router = llama.routers["other_kv"].url
    before = deploy.metrics(llama.prefill_other_kv.url)
    for n in (40, 300):
        ids = deploy.prompt(n, seed=7 + n)
        followed = _tokens(deploy, router, ids)
        assert followed != _tokens(deploy, llama.single.url, ids), n
        assert _tokens(deploy, router, ids) == followed, n
    moved = counters_delta(before, deploy.metrics(llama.prefill_other_kv.url))
    assert moved["kvwire_send_bytes_total"] == 2 * pages([40, 300]) * LLAMA_PAGE_BYTES, moved


def test_stock_sglang_pair_gives_the_same_tokens(deploy: Any, llama: SimpleNamespace) -> None:
    """The reference path (sglang's own Mooncake manager on both sides) under the same CPU flags."""
    before = deploy.metrics(llama.prefill_stock.url)
    for n in LENGTHS:
        ids = deploy.prompt(n, seed=n)
        assert _tokens(deploy, llama.routers["stock"].url, ids) == _tokens(deploy, llama.single.url, ids)
    assert "kvwire_send_requests_total" not in deploy.metrics(llama.prefill_stock.url)
    assert "kvwire_send_requests_total" not in before


def test_a_stock_prefill_into_a_kvwire_decode_gives_the_right_tokens(deploy: Any, llama: SimpleNamespace) -> None:
    """kvwire on the decode only: it publishes its layout as an extra registration frame, which stock sglang
    ignores, and receives through sglang's own engine."""
    for n in LENGTHS:
        ids = deploy.prompt(n, seed=n)
        assert _tokens(deploy, llama.routers["stock_to_kvwire"].url, ids) == _tokens(deploy, llama.single.url, ids)


def test_a_kvwire_prefill_into_a_stock_decode_fails_the_request_visibly(deploy: Any, llama: SimpleNamespace) -> None:
    """kvwire on the prefill only: the decode published no layout, so kvwire refuses its sends (status -22)
    and sglang fails the request; the client gets an error, never tokens decoded from unwritten pages."""
    ids = deploy.prompt(40, seed=40)
    before = deploy.metrics(llama.prefill.url)
    with pytest.raises(urllib.error.HTTPError) as failed:
        response = deploy.generate(llama.routers["kvwire_to_stock"].url, ids, timeout_s=120)
        # a response with tokens would have to be the right ones; record it for the failure message
        pytest.fail(f"the request was answered: {json.dumps(response)[:400]}")
    assert failed.value.code >= 400
    moved = counters_delta(before, deploy.metrics(llama.prefill.url))
    assert moved.get("kvwire_send_bytes_total", 0.0) == 0.0, moved
    assert "registered without a kvwire layout" in llama.prefill.log.read_text(errors="replace")
    # the prefill serves its kvwire decode as before
    assert _tokens(deploy, llama.routers["kvwire"].url, ids) == _tokens(deploy, llama.single.url, ids)


def _wait_for_send(deploy: Any, url: str, before: float, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while deploy.metrics(url).get("kvwire_send_requests_total", 0.0) <= before:
        assert time.monotonic() < deadline, "no kvwire send started"
        time.sleep(0.01)


def test_a_request_aborted_mid_prefill_frees_its_pages_on_both_sides(deploy: Any, llama: SimpleNamespace) -> None:
    """The client aborts (sglang's /abort_request with its rid) once the first chunk went out; sglang's strict
    idle check would stop a server that kept its pages (checked after the module), and later requests are right."""
    router = llama.routers["kvwire"].url
    ids = deploy.prompt(1500, seed=3)
    rid = "kvwire-abort-test"
    body = {"input_ids": ids, "rid": rid, "sampling_params": {"temperature": 0, "max_new_tokens": 200}}
    sent = deploy.metrics(llama.prefill.url).get("kvwire_send_requests_total", 0.0)
    outcome: dict[str, Any] = {}

    def request() -> None:
        req = urllib.request.Request(
            router + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                outcome["response"] = json.loads(r.read())
        except urllib.error.HTTPError as exc:
            outcome["error"] = exc.code

    thread = threading.Thread(target=request)
    thread.start()
    _wait_for_send(deploy, llama.prefill.url, sent)
    for server in (llama.prefill, llama.decode):
        abort = urllib.request.Request(
            server.url + "/abort_request", json.dumps({"rid": rid}).encode(), {"Content-Type": "application/json"}
        )
        urllib.request.urlopen(abort, timeout=30).close()
    thread.join(300)
    assert not thread.is_alive()
    finished = outcome.get("response", {}).get("meta_info", {}).get("finish_reason", {})
    assert "error" in outcome or finished.get("type") == "abort", outcome
    for n in LENGTHS:
        ids = deploy.prompt(n, seed=n)
        assert _tokens(deploy, router, ids) == _tokens(deploy, llama.single.url, ids)
    assert_no_leak(llama.prefill, llama.decode)


def test_a_decode_killed_during_a_transfer_and_restarted(deploy: Any, llama: SimpleNamespace) -> None:
    """SIGKILL of the decode's process group while its request is being sent: the request fails, the prefill
    keeps serving, and once a decode is back on the same ports the requests through the router are right."""
    router = llama.routers["kvwire"].url
    sent = deploy.metrics(llama.prefill.url).get("kvwire_send_requests_total", 0.0)
    failure: dict[str, Any] = {}

    def request() -> None:
        try:
            deploy.generate(router, deploy.prompt(1500, seed=5), max_new_tokens=200, timeout_s=300)
        except (urllib.error.HTTPError, urllib.error.URLError, OSError) as exc:
            failure["error"] = repr(exc)

    thread = threading.Thread(target=request)
    thread.start()
    _wait_for_send(deploy, llama.prefill.url, sent)
    llama.decode.kill()
    thread.join(300)
    assert not thread.is_alive() and "error" in failure, failure
    assert_no_leak(llama.prefill)  # the prefill survived its peer's death
    with urllib.request.urlopen(llama.prefill.url + "/health", timeout=30) as health:
        assert health.status == 200
    restarted = _start(
        deploy, llama.model, "decode", llama.work, port=llama.decode.ports["http"],
        bootstrap_port=llama.decode.ports["bootstrap"], name="decode_restarted",
    )  # fmt: skip
    llama.decode = llama.servers["decode"] = restarted
    restarted.wait_ready(600)
    for n in LENGTHS:
        ids = deploy.prompt(n, seed=n)
        assert _tokens(deploy, router, ids) == _tokens(deploy, llama.single.url, ids)
    assert_no_leak(llama.prefill, restarted)
