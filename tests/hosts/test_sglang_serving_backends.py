"""Any kvwire backend under sglang: ``KVWIRE_SGLANG_BACKEND`` picks the transport of sglang's KV.

sglang's own prefill and decode servers behind sglang's router, started as the README starts them plus one
variable, generate the same greedy tokens as one plain server, with the KV pages carried by

- kvwire-nixl (NIXL over UCX), an engine kvwire opens itself next to sglang's Mooncake engine;
- a third party's backend, built as a wheel here and installed into sglang's venv: discovered through its
  entry point, validated, and run on an engine of its own.

sglang's bootstrap, registration and auxiliary transfers stay on sglang's Mooncake engine; each decode
publishes the endpoint of kvwire's engine in its registration, and the prefill sends there. The prefill's
``/metrics`` say which backend moved the bytes, and that they are every page of every prompt.
"""

from __future__ import annotations

import re
import subprocess
import textwrap
import urllib.request
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from sglang_serving import (
    LLAMA_PAGE_BYTES,
    PYTHON,
    STRICT_ENV,
    VENV,
    assert_no_leak,
    build_venv,
    load_deploy,
    make_model,
    one_deployment_at_a_time,
    pages,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sglang-servers"), pytest.mark.timeout(1800)]

LENGTHS = [1, 40, 300]
#: The third party's backend: kvwire-mooncake's transport under its own name and distribution.
ACME_SOURCE = '''
"""kvwire-acme: a third party's kvwire backend (a test double of one: kvwire-mooncake's transport, renamed)."""

from kvwire_mooncake.backend import MooncakeBackend


class AcmeBackend(MooncakeBackend):
    """Mooncake's transport on an engine of its own, registered as ``acme``."""
'''
ACME_PROJECT = """
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "kvwire-acme"
version = "0.0.1"
dependencies = ["kvwire", "kvwire-mooncake"]

[project.entry-points."kvwire.backends"]
acme = "kvwire_acme:AcmeBackend"
"""


def sends_by_backend(url: str) -> dict[str, float]:
    """The prefill's ``kvwire_send_bytes_total`` per ``backend`` label."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    found: dict[str, float] = {}
    for m in re.finditer(r"^kvwire_send_bytes_total\{([^}]*)\} (\S+)$", text, re.M):
        backend = re.search(r'backend="([^"]*)"', m.group(1))
        if backend:
            found[backend.group(1)] = found.get(backend.group(1), 0.0) + float(m.group(2))
    return found


@pytest.fixture(scope="module")
def deploy() -> Iterator[Any]:
    build_venv()
    with one_deployment_at_a_time():  # torn down last: held until this module's servers are stopped
        yield load_deploy()


@pytest.fixture(scope="module")
def plain(deploy: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimpleNamespace]:
    work = tmp_path_factory.mktemp("sglang-backends")
    model = make_model(work / "llama")
    single = deploy.start_server(model, "single", work, plugins=deploy.STOCK_PLUGINS, python=PYTHON, name="single")
    try:
        single.wait_ready(900)
        yield SimpleNamespace(model=model, work=work, single=single)
    finally:
        single.stop()


def _pair(deploy: Any, plain: SimpleNamespace, backend: str) -> Iterator[SimpleNamespace]:
    """A kvwire prefill and decode with ``KVWIRE_SGLANG_BACKEND=backend``, behind sglang's router."""
    env = {**STRICT_ENV, "KVWIRE_SGLANG_BACKEND": backend}
    servers: dict[str, Any] = {}
    router = None
    try:
        for role in ("prefill", "decode"):
            servers[role] = deploy.start_server(
                plain.model, role, plain.work, env=env, python=PYTHON, name=f"{role}_{backend}"
            )
        for server in servers.values():
            server.wait_ready(900)
        router = deploy.start_router(
            servers["prefill"], servers["decode"], plain.work, python=PYTHON, name=f"router_{backend}"
        )
        router.wait_ready(300)
        yield SimpleNamespace(router=router, **servers)
        assert_no_leak(*servers.values())
    finally:
        for process in [router, *servers.values()]:
            if process is not None:
                process.stop()


def _serves(deploy: Any, plain: SimpleNamespace, pair: SimpleNamespace, backend: str) -> None:
    """Tokens equal one plain server's, every page moved by ``backend``, both activation lines naming it."""
    before = sends_by_backend(pair.prefill.url)
    for n in LENGTHS:
        ids = deploy.prompt(n, seed=n)
        expected = deploy.output_ids(deploy.generate(plain.single.url, ids))
        assert deploy.output_ids(deploy.generate(pair.router.url, ids)) == expected, n
    after = sends_by_backend(pair.prefill.url)
    moved = {name: after[name] - before.get(name, 0.0) for name in after}
    assert moved == {backend: pages(LENGTHS) * LLAMA_PAGE_BYTES}, moved
    for server in (pair.prefill, pair.decode):
        log = server.log.read_text(errors="replace")
        assert "active in sglang" in log and f"backend {backend!r}" in log, server.tail(40)


@pytest.fixture  # one test: its pair is stopped before the next pair starts (at most 3 servers at once)
def nixl(deploy: Any, plain: SimpleNamespace) -> Iterator[SimpleNamespace]:
    yield from _pair(deploy, plain, "nixl")


def test_sglang_serves_through_kvwire_nixl(deploy: Any, plain: SimpleNamespace, nixl: SimpleNamespace) -> None:
    _serves(deploy, plain, nixl, "nixl")
    ids = deploy.prompt(80, seed=7)  # a prefix-cache hit on the prefill
    expected = deploy.output_ids(deploy.generate(plain.single.url, ids))
    for _ in range(2):
        assert deploy.output_ids(deploy.generate(nixl.router.url, ids)) == expected


@pytest.fixture(scope="module")
def acme_installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """kvwire-acme built as a wheel and installed into sglang's venv (uninstalled afterwards)."""
    src = tmp_path_factory.mktemp("kvwire-acme")
    (src / "pyproject.toml").write_text(textwrap.dedent(ACME_PROJECT))
    (src / "kvwire_acme").mkdir()
    (src / "kvwire_acme" / "__init__.py").write_text(textwrap.dedent(ACME_SOURCE))
    wheels = tmp_path_factory.mktemp("wheels")
    pip = [PYTHON, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)], check=True)
    (wheel,) = wheels.glob("kvwire_acme-*.whl")
    subprocess.run([*pip, "install", "--no-deps", str(wheel)], check=True)
    try:
        check = subprocess.run(
            [str(VENV / "bin" / "kvwire"), "check", "--backends", "acme", "--json"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert check.returncode == 0 and '"status": "ok"' in check.stdout, check.stdout + check.stderr
        yield
    finally:
        subprocess.run([*pip, "uninstall", "-y", "kvwire-acme"], check=False)


@pytest.fixture(scope="module")
def acme(deploy: Any, plain: SimpleNamespace, acme_installed: None) -> Iterator[SimpleNamespace]:
    yield from _pair(deploy, plain, "acme")


def test_sglang_serves_through_a_third_partys_backend(
    deploy: Any, plain: SimpleNamespace, acme: SimpleNamespace
) -> None:
    _serves(deploy, plain, acme, "acme")


def test_a_decode_on_another_backend_is_refused_by_name(
    deploy: Any, plain: SimpleNamespace, acme: SimpleNamespace
) -> None:
    """A decode left on the default (sglang's Mooncake engine) registering with the acme prefill: its requests
    fail as sglang fails them, the prefill says why, and the acme pair goes on serving."""
    stray = deploy.start_server(plain.model, "decode", plain.work, env=STRICT_ENV, python=PYTHON, name="decode_stray")
    router = None
    try:
        stray.wait_ready(900)
        router = deploy.start_router(acme.prefill, stray, plain.work, python=PYTHON, name="router_stray")
        router.wait_ready(300)
        with pytest.raises(Exception):  # noqa: B017 - sglang answers a failed transfer with an HTTP error
            deploy.generate(router.url, deploy.prompt(40, seed=3), timeout_s=120)
        log = acme.prefill.log.read_text(errors="replace")
        assert (
            "the decode's kvwire runs on sglang's Mooncake engine, this prefill's on backend 'acme''s own engine: "
            "set KVWIRE_SGLANG_BACKEND to the same backend on both sides; sends to it are refused"
        ) in log, acme.prefill.tail(40)
    finally:
        for process in (router, stray):
            if process is not None:
                process.stop()
    ids = deploy.prompt(40, seed=3)
    assert deploy.output_ids(deploy.generate(acme.router.url, ids)) == deploy.output_ids(
        deploy.generate(plain.single.url, ids)
    )
