"""kvwire serving across two hosts: the prefill and the decode in network namespaces of their own, on a bridge.

sglang's router (root namespace) reaches both servers at their bridge addresses, and the decode reaches the
prefill's bootstrap server and Mooncake engine there (``SGLANG_HOST_IP`` = the host's own bridge address). A
third host on the same bridge then probes every port the prefill listens on: what it reaches is what an
operator must firewall (sglang's Mooncake engine, which kvwire reuses, binds every interface). The prefill's
link is then shaped with ``tc htb`` and the transfer time at that rate is reported.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from netns import Network, unavailable
from sglang_serving import (
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

RATE_MBIT = 20
PROBE = """
import json, socket, sys
host, ports = sys.argv[1], json.loads(sys.argv[2])
reached = []
for port in ports:
    try:
        socket.create_connection((host, port), timeout=3).close()
        reached.append(port)
    except OSError:
        pass
print(json.dumps(reached))
"""


@pytest.fixture(scope="module", autouse=True)
def _alone() -> Iterator[None]:
    """No other module's sglang servers start while this module's run (autouse: set up first, torn down last)."""
    with one_deployment_at_a_time():
        yield


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    why = unavailable()
    if why is not None:
        pytest.skip(f"no network namespaces on this machine: {why}")
    build_venv()
    deploy = load_deploy()
    work = tmp_path_factory.mktemp("sglang-hosts")
    model = make_model(work / "llama")
    net = Network(["prefill", "decode", "probe"])
    processes: list[Any] = []
    try:
        single = deploy.start_server(
            model, "single", work, plugins=deploy.STOCK_PLUGINS, env=STRICT_ENV, python=PYTHON, name="single"
        )
        processes.append(single)
        roles = {"prefill": 64, "decode": None}
        servers = {}
        for role, chunk in roles.items():
            servers[role] = deploy.start_server(
                model, role, work, host=net.address[role], port=30000, bootstrap_port=30100,
                chunked_prefill_size=chunk, env=STRICT_ENV, python=PYTHON, netns=net.namespace[role], name=role,
            )  # fmt: skip
            processes.append(servers[role])
        for process in processes:
            process.wait_ready(900)
        router = deploy.start_router(servers["prefill"], servers["decode"], work, python=PYTHON)
        processes.append(router)
        router.wait_ready(300)
        yield SimpleNamespace(deploy=deploy, net=net, single=single, router=router, **servers)
        assert_no_leak(single, *servers.values())
    finally:
        for process in reversed(processes):
            process.stop()
        net.close()


def _tokens(deploy: Any, url: str, ids: list[int]) -> list[int]:
    tokens: list[int] = deploy.output_ids(deploy.generate(url, ids))
    return tokens


def test_two_hosts_serve_the_same_tokens_as_one_server(hosts: SimpleNamespace) -> None:
    deploy = hosts.deploy
    before = deploy.metrics(hosts.prefill.url)
    for n in (1, 40, 300):
        ids = deploy.prompt(n, seed=n)
        assert _tokens(deploy, hosts.router.url, ids) == _tokens(deploy, hosts.single.url, ids), n
    moved = counters_delta(before, deploy.metrics(hosts.prefill.url))
    assert moved["kvwire_send_bytes_total"] == pages([1, 40, 300]) * LLAMA_PAGE_BYTES, moved
    # the decode's registration reached the prefill at its bridge address, not loopback
    assert hosts.net.address["prefill"] in hosts.prefill.url


def test_what_a_third_host_on_the_network_reaches_of_the_prefill(hosts: SimpleNamespace) -> None:
    """Every port the prefill listens on beyond loopback is reachable from any host of its network: sglang's
    HTTP and bootstrap servers, its ZMQ sockets and Mooncake's engine (RPC and TCP transport), which has no
    authentication and answers with the registered KV buffers' addresses. Loopback listeners are not."""
    net = hosts.net
    listening = net.listening("prefill")
    public = sorted({port for address, port in listening if not address.startswith("127.") and address != "::1"})
    loopback = sorted({port for address, port in listening if address.startswith("127.") or address == "::1"})
    every = sorted({port for _, port in listening})
    probe = net.run("probe", [sys.executable, "-c", PROBE, net.address["prefill"], json.dumps(every)], 120)
    assert probe.returncode == 0, probe.stderr
    reached = json.loads(probe.stdout)
    print(f"\nprefill listens on {listening}; a third host reaches {reached}")
    assert reached == public and set(reached).isdisjoint(loopback), (listening, reached)
    # sglang's own listeners are among them: the HTTP server and the bootstrap server the router names
    assert {30000, 30100} <= set(reached)
    # and Mooncake's engine (more than sglang's two servers): the operator must firewall this network
    assert len(reached) > 2, reached


def test_a_shaped_link_gives_the_same_tokens_and_a_transfer_time_at_its_rate(hosts: SimpleNamespace) -> None:
    deploy = hosts.deploy
    ids = deploy.prompt(1500, seed=15)
    expected = _tokens(deploy, hosts.single.url, ids)
    timings = {}
    for label in ("unshaped", f"{RATE_MBIT} Mbit/s"):
        if label != "unshaped":
            hosts.net.shape("prefill", f"{RATE_MBIT}mbit")
        before = deploy.metrics(hosts.prefill.url)
        assert _tokens(deploy, hosts.router.url, ids) == expected, label
        moved = counters_delta(before, deploy.metrics(hosts.prefill.url))
        assert moved["kvwire_send_bytes_total"] == pages([1500]) * LLAMA_PAGE_BYTES, moved
        seconds = moved["kvwire_send_transfer_seconds_sum"]
        timings[label] = (moved["kvwire_send_bytes_total"], seconds, moved["kvwire_send_requests_total"])
    for label, (moved_bytes, seconds, sends) in timings.items():
        print(
            f"\n{label}: {moved_bytes:.0f} bytes in {sends:.0f} kvwire sends, transfer time {seconds * 1000:.1f} ms "
            f"({moved_bytes * 8 / seconds / 1e6:.1f} Mbit/s)"
        )
