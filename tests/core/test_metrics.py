"""kvwire.metrics: Prometheus metrics scraped after real transfers through the ``local`` backend."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import kvwire
from kvwire import KVLayout
from kvwire.transport import telemetry

prometheus_client = pytest.importorskip("prometheus_client", reason="pip install 'kvwire[metrics]'")

from kvwire.metrics import OTHER_PEER, Metrics  # noqa: E402 - after the importorskip

PAGES, PAGE = 16, 64


class Endpoint:
    """A local connection with an MHA layout of one layer on random (or zero) pages."""

    def __init__(self, registry: kvwire.Registry, seed: int | None, middleware: list[object] | None = None) -> None:
        rng = np.random.default_rng(seed)
        self.bufs = [
            rng.integers(0, 256, (PAGES, PAGE), dtype=np.uint8) if seed else np.zeros((PAGES, PAGE), np.uint8)
            for _ in range(2)
        ]
        self.layout = KVLayout.mha([self.bufs[0]], [self.bufs[1]])
        self.conn = registry.connect("local", middleware=middleware or [])
        self.conn.register_kv_buffers(self.layout)
        self.endpoint = self.conn.endpoint()


@pytest.fixture
def scrape() -> Iterator[tuple[Metrics, Any]]:
    registry = prometheus_client.CollectorRegistry()
    yield Metrics(registry, max_peers=1), registry


def _lines(registry: Any) -> list[str]:
    text: str = prometheus_client.generate_latest(registry).decode()
    return [line for line in text.splitlines() if line.startswith("kvwire_")]


def _send(sender: Endpoint, receiver: Endpoint, src: list[int], dst: list[int]) -> int:
    ptrs = [b.base for b in receiver.layout.buffers]
    return sender.conn.send_kvcache(receiver.endpoint, np.array(src, np.int32), ptrs, np.array(dst, np.int32))


def test_scrape_after_local_transfers(scrape: tuple[Metrics, Any]) -> None:
    metrics, registry = scrape
    reg = kvwire.Registry(allow=["local"])
    receiver, other = Endpoint(reg, None), Endpoint(reg, None)
    sender = Endpoint(reg, 7, [metrics.middleware("local")])
    try:
        for end in (receiver, other):
            sender.conn.add_peer(end.endpoint, end.layout)
        assert _send(sender, receiver, [1, 2, 3], [4, 5, 6]) == 3 * PAGE * 2
        assert _send(sender, receiver, [8], [0]) == PAGE * 2
        assert _send(sender, other, [9, 10], [11, 12]) == 2 * PAGE * 2
        with pytest.raises(kvwire.InvalidTransferError, match="prefill_kv_indices"):
            _send(sender, receiver, [PAGES], [0])
        assert np.array_equal(receiver.bufs[0][4:7], sender.bufs[0][1:4])
    finally:
        for end in (sender, receiver, other):
            end.conn.close()
    peer = receiver.endpoint
    lines = _lines(registry)
    for expected in (
        f'kvwire_send_requests_total{{backend="local",peer="{peer}"}} 3.0',
        f'kvwire_send_requests_total{{backend="local",peer="{OTHER_PEER}"}} 1.0',  # max_peers=1
        f'kvwire_send_bytes_total{{backend="local",peer="{peer}"}} 512.0',
        f'kvwire_send_bytes_total{{backend="local",peer="{OTHER_PEER}"}} 256.0',
        f'kvwire_send_failures_total{{backend="local",error="InvalidTransferError",peer="{peer}"}} 1.0',
        f'kvwire_send_seconds_count{{backend="local",peer="{peer}"}} 3.0',
        f'kvwire_send_seconds_bucket{{backend="local",le="+Inf",peer="{peer}"}} 3.0',
    ):
        assert expected in lines, "\n".join(lines)
    assert not any(f'peer="{other.endpoint}"' in line for line in lines)


def test_descriptor_counts_and_times_come_from_the_backend_telemetry(scrape: tuple[Metrics, Any]) -> None:
    """Three consecutive pages on both sides coalesce into one descriptor per buffer pair (K and V: 2)."""
    metrics, registry = scrape
    reg = kvwire.Registry(allow=["local"])
    receiver = Endpoint(reg, None)
    sender = Endpoint(reg, 3, [metrics.middleware("local")])
    try:
        sender.conn.add_peer(receiver.endpoint, receiver.layout)
        marker = telemetry.mark()
        _send(sender, receiver, [1, 2, 3], [4, 5, 6])
        _send(sender, receiver, [9, 4], [1, 8])
        record = telemetry.since(marker)
    finally:
        sender.conn.close()
        receiver.conn.close()
    assert record is not None, "TransportBackend.send_kvcache does not publish kvwire.transport.telemetry records"
    assert (record.session_id, record.nbytes, record.descriptors, record.descriptors_before) == (
        receiver.endpoint,
        2 * PAGE * 2,
        4,
        4,
    )
    assert record.planning_s > 0 and record.transfer_s > 0
    assert telemetry.since(telemetry.mark()) is None
    lines = _lines(registry)
    assert 'kvwire_send_descriptors_total{backend="local"} 6.0' in lines, "\n".join(lines)
    assert 'kvwire_send_descriptors_before_coalescing_total{backend="local"} 10.0' in lines
    assert 'kvwire_send_planning_seconds_count{backend="local"} 2.0' in lines
    assert 'kvwire_send_transfer_seconds_count{backend="local"} 2.0' in lines


def test_a_backend_error_outside_kvwire_is_labelled_as_the_caller_sees_it(scrape: tuple[Metrics, Any]) -> None:
    metrics, registry = scrape
    reg = kvwire.Registry(allow=["local"])
    receiver = Endpoint(reg, None)
    sender = Endpoint(reg, 5, [metrics.middleware("local")])
    try:
        sender.conn.add_peer(receiver.endpoint, receiver.layout)

        def broken(*args: object, **kwargs: object) -> int:
            raise OSError("engine gone")

        sender.conn.backend.transport.write = broken  # an engine failing with a non-kvwire error
        with pytest.raises(kvwire.BackendError, match="raised OSError in send_kvcache"):
            _send(sender, receiver, [1], [1])
    finally:
        sender.conn.close()
        receiver.conn.close()
    line = f'kvwire_send_failures_total{{backend="local",error="BackendError",peer="{receiver.endpoint}"}} 1.0'
    assert line in _lines(registry)


def test_missing_prometheus_client_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(ImportError, match=r"kvwire\.metrics needs prometheus_client: pip install 'kvwire\[metrics\]'"):
        Metrics()


def test_max_peers_is_checked() -> None:
    with pytest.raises(ValueError, match="max_peers must be an int >= 0, got -1"):
        Metrics(prometheus_client.CollectorRegistry(), max_peers=-1)


SERVING = """
import sys, numpy as np, kvwire
from kvwire.metrics import default_metrics, serve
bufs = [[np.arange(256, dtype=np.uint8).reshape(4, 64) * (i + 1) for i in range(2)] for _ in range(2)]
ends = []
for i, (k, v) in enumerate(bufs):
    middleware = [default_metrics().middleware("local")] if i == 0 else []
    conn = kvwire.connect("local", middleware=middleware)
    conn.register_kv_buffers(kvwire.KVLayout.mha([k], [v]))
    ends.append(conn)
ends[0].add_peer(ends[1].endpoint(), kvwire.KVLayout.mha([bufs[1][0]], [bufs[1][1]]))
ptrs = [bufs[1][0].ctypes.data, bufs[1][1].ctypes.data]
print(ends[0].send_kvcache(ends[1].endpoint(), np.array([0, 1], np.int32), ptrs, np.array([2, 3], np.int32)))
server = serve(0)
print(server.server_port, flush=True)
sys.stdin.read()
"""


def test_serve_exposes_the_default_metrics_over_http() -> None:
    """A standalone process: its sends through default_metrics() read back from serve()'s /metrics."""
    import subprocess
    import urllib.request

    proc = subprocess.Popen([sys.executable, "-c", SERVING], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == str(2 * 2 * 64)  # 2 pages x K and V x 64 bytes
        port = int(proc.stdout.readline())
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            text = response.read().decode()
    finally:
        proc.kill()
        proc.wait(30)
    sent = [line for line in text.splitlines() if line.startswith("kvwire_send_bytes_total{")]
    assert len(sent) == 1 and sent[0].endswith(" 256.0"), sent


@pytest.mark.parametrize(("args", "message"), [((-1,), "port must be an int in 0..65535, got -1"), ((80, ""), "host")])
def test_serve_refuses_a_bad_port_or_host(args: tuple[Any, ...], message: str) -> None:
    from kvwire.metrics import serve

    with pytest.raises(ValueError, match=message):
        serve(*args)
