"""sglang's own servers as a prefill/decode pair behind sglang's router, with kvwire carrying the KV.

Everything here starts processes the way an sglang user does: ``python -m sglang.launch_server`` (a prefill
and a decode, or one plain server) and ``python -m sglang_router.launch_router --pd-disaggregation``. The
flags are those of sglang's CPU server (``SGLANG_USE_CPU_ENGINE=1``) with a tiny model (:mod:`tiny_model`);
on a GPU drop :data:`CPU_FLAGS` and the ``kvwire_cpu`` plugin. kvwire is selected on a side by
``SGLANG_PLUGINS=kvwire`` (plus ``kvwire_cpu``, sglang's CPU PD gaps; see ``kvwire_sglang.cpu``).

Used by ``run.py`` (the example) and by kvwire's deployment tests, so both start the same processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: sglang's CPU server (measured on a 2-core machine; see TRANSPORT-FACTS.md in the kvwire repository).
#: ``--max-total-tokens`` sizes the KV pool; ``--mem-fraction-static`` only has to pass sglang's check that free
#: memory after loading exceeds ``(1 - fraction)`` x free memory before it, which counts the whole machine: at 0.05
#: a second server loading at the same time on a machine with 8 GB free failed that check.
CPU_FLAGS: tuple[str, ...] = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-cuda-graph",
    "--dtype", "float32",
    "--mem-fraction-static", "0.5",
    "--max-total-tokens", "4096",
    "--skip-tokenizer-init",
)  # fmt: skip
#: Every server, GPU or not: without ``--sleep-on-idle`` an idle scheduler polls its sockets in a busy loop, one
#: whole core per server (measured: 1.01 cores idle, 0.01 with it); six servers on two cores then starved each
#: other until sglang's own start-up warmup gave up and killed one. sglang sleeps only when fully idle: never
#: with a transfer queued or in flight.
IDLE_FLAGS: tuple[str, ...] = ("--sleep-on-idle",)
#: The environment of every CPU server: sglang's CPU engine, Mooncake over TCP, and sglang's CPU PD gap 3
#: (a prefix-cache hit's early send makes a torch.cuda.Event; ``disaggregation/prefill.py``).
CPU_ENV: dict[str, str] = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "MC_FORCE_TCP": "1",
    "MOONCAKE_PROTOCOL": "tcp",
    "SGLANG_DISAGG_PREFILL_EARLY_SEND_CACHED_PREFIX": "false",
}
#: ``SGLANG_PLUGINS`` of a side that sends or receives through kvwire, and of one that uses sglang's own path.
KVWIRE_PLUGINS = "kvwire,kvwire_cpu"
STOCK_PLUGINS = "kvwire_cpu"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` just now."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Process:
    """One server or router process (its own process group: stopping it stops sglang's schedulers too)."""

    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path
    ports: dict[str, int] = field(default_factory=dict)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = 300.0, path: str = "/health") -> None:
        """Poll ``path`` until it answers 200; RuntimeError with the log's tail if the process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{self.tail()}")
            try:
                with urllib.request.urlopen(self.url + path, timeout=5) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} not ready at {self.url}{path} after {timeout_s:.0f}s:\n{self.tail()}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signal the whole process group (sglang's scheduler subprocesses included) and reap the leader."""
        if self.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, sig)
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(timeout=30)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL of whatever of the group is left."""
        self.kill(signal.SIGTERM)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.popen.pid, signal.SIGKILL)


def _spawn(
    name: str, argv: Sequence[str], env: Mapping[str, str], log_dir: Path, url: str, netns: str | None
) -> Process:
    log = log_dir / f"{name}.log"
    command = [*(["ip", "netns", "exec", netns] if netns else []), *argv]
    with log.open("wb") as out:
        popen = subprocess.Popen(
            command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
        )
    return Process(name, url, popen, log)


def start_server(
    model: str | Path,
    role: str,
    log_dir: Path,
    *,
    plugins: str = KVWIRE_PLUGINS,
    host: str = "127.0.0.1",
    port: int | None = None,
    bootstrap_port: int | None = None,
    page_size: int = 16,
    chunked_prefill_size: int | None = None,
    tp_size: int = 1,
    extra: Iterable[str] = (),
    env: Mapping[str, str] | None = None,
    netns: str | None = None,
    python: str = sys.executable,
    name: str | None = None,
) -> Process:
    """``python -m sglang.launch_server`` as ``role`` (``single``, ``prefill`` or ``decode``); not yet ready.

    ``host`` is where the server listens and what it advertises to peers (``SGLANG_HOST_IP``). With
    ``netns`` the server runs in that network namespace (``ip netns exec``) and its ports are chosen by
    the caller (pass ``port`` and ``bootstrap_port``). ``name`` (default: ``role``) names the process and
    its log, ``log_dir/<name>.log``.
    """
    if role not in ("single", "prefill", "decode"):
        raise ValueError(f"role must be 'single', 'prefill' or 'decode', got {role!r}")
    port = port or free_port(host)
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", host, "--port", str(port)]
    argv += [*CPU_FLAGS, *IDLE_FLAGS, "--page-size", str(page_size), "--enable-metrics"]
    argv += ["--nccl-port", str(free_port(host) if netns is None else port + 3)]
    if tp_size != 1:
        argv += ["--tp-size", str(tp_size)]
    if chunked_prefill_size is not None:
        argv += ["--chunked-prefill-size", str(chunked_prefill_size)]
    ports = {"http": port}
    if role != "single":
        bootstrap_port = bootstrap_port or free_port(host)
        ports["bootstrap"] = bootstrap_port
        argv += ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "mooncake"]
        argv += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
        if role == "decode":  # sglang's CPU PD gap 1: the retraction backup pool is pinned (a CUDA call)
            argv += ["--disaggregation-decode-retraction-backup", "none"]
    argv += list(extra)
    full_env = {**CPU_ENV, "SGLANG_HOST_IP": host, "SGLANG_PLUGINS": plugins, **(env or {})}
    process = _spawn(name or role, argv, full_env, log_dir, f"http://{host}:{port}", netns)
    process.ports = ports
    return process


def start_router(
    prefill: Process,
    decode: Process,
    log_dir: Path,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    python: str = sys.executable,
    netns: str | None = None,
    name: str = "router",
) -> Process:
    """sglang's router in PD mode (``sglang_router.launch_router --pd-disaggregation --mini-lb``)."""
    port = port or free_port(host)
    argv = [python, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--mini-lb"]
    argv += ["--prefill", prefill.url, str(prefill.ports["bootstrap"]), "--decode", decode.url]
    argv += ["--host", host, "--port", str(port)]
    return _spawn(name, argv, {}, log_dir, f"http://{host}:{port}", netns)


def generate(url: str, input_ids: Sequence[int], *, max_new_tokens: int = 16, timeout_s: float = 300.0) -> Any:
    """``POST /generate`` with token ids, greedy; the response's JSON (HTTPError for a failed request)."""
    body = {
        "input_ids": list(input_ids),
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    request = urllib.request.Request(
        url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as r:
        return json.loads(r.read())


def output_ids(response: Any) -> list[int]:
    """The generated token ids of one ``/generate`` response."""
    ids = response.get("output_ids") if isinstance(response, dict) else None
    if not isinstance(ids, list):
        raise ValueError(f"no output_ids in {str(response)[:300]}")
    return [int(i) for i in ids]


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")


def metrics(url: str, prefix: str = "kvwire_") -> dict[str, float]:
    """The samples of ``url``'s ``/metrics`` whose names start with ``prefix``, summed over labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    totals: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1).startswith(prefix):
            totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
    return totals


def prompt(length: int, seed: int = 0, vocab: int = 512) -> list[int]:
    """``length`` token ids, deterministic per ``seed`` (no tokenizer: the model is random anyway)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]
