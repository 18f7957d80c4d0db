"""The bench's decode side: allocate, register, publish, then scramble and verify pages on request.

Run by ``kvwire bench`` as a child, ``python -m kvwire.benchmark.decode '<json args>'``
(control channel on stdin/stdout), or on another machine as
``kvwire bench --role decode --listen HOST:PORT`` (control channel over TCP,
authenticated by the shared control key before anything else is read;
the prefill side's first command, ``start``, carries the same arguments;
``tp``: ``[size, rank]`` makes it one decode rank of an attention-TP group).
``scramble`` sets the target pages to a byte value (memset speed) and records a
digest of their guard pages (the pages just before and after every target
run); ``verify`` then checks the target pages against the sender's digest and
that the guard pages did not change, so a write that fell short or overran is
caught. A ``key`` keeps the guards of several requests in flight apart.
``watch`` starts polling arrival notifications in a thread (noting when each
was seen); ``confirm`` waits for one request's notification, then verifies it.
``landing``: ``[prefill TP, pages]`` adds a :class:`kvwire.landing.Landing`
pool on a second connection (its description under ``"landing"``):
``reserve`` hands out landing pages for each sender, ``scatter`` copies one
sender's landing pages into the KV pages and releases them.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from typing import IO, Any

import numpy as np
from numpy.typing import NDArray

from kvwire.benchmark.presets import get_preset
from kvwire.config import BackendConfig
from kvwire.connection import Connection
from kvwire.connection.watcher import NotificationWatcher
from kvwire.control import accept_one, check_listen_key, claim_stdout, parse_address, read_command, reply, serve
from kvwire.landing import Landing
from kvwire.layout.buffers import MemoryKind
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer import PeerDescription
from kvwire.registry.manager import connect
from kvwire.workload.memory import KVMemory, allocate

PageSets = list[tuple[MemoryKind | None, NDArray[np.int64]]]


def page_sets(memory: KVMemory, message: dict[str, Any]) -> PageSets:
    """(memory kind, pages) addressed by a request: a split layout has two page-id spaces."""
    host = np.asarray(message["host_pages"], np.int64)
    if not memory.layout.is_split:
        return [(None, host)]
    return [("host", host), ("device", np.asarray(message["device_pages"], np.int64))]


def guard_pages(pages: NDArray[np.int64], num_pages: int) -> NDArray[np.int64]:
    """The pages next to ``pages`` that are not in it: where a write off by one page would land."""
    near = np.concatenate([pages - 1, pages + 1])
    near = near[(near >= 0) & (near < num_pages)]
    return np.setdiff1d(near, pages)


class DecodeSide:
    """The decode side's memory and the scramble/verify/watch/confirm commands."""

    def __init__(self, memory: KVMemory, conn: Connection | None = None, landing: Landing | None = None) -> None:
        self.memory = memory
        self.conn = conn
        self.landing = landing
        self.fill = 0
        self.guards: dict[str, list[str]] = {}
        self._watcher: NotificationWatcher | None = None

    def scramble(self, message: dict[str, Any]) -> dict[str, Any]:
        self.fill = (self.fill + 1) % 256  # a different value each time: stale bytes never pass
        guards = self.guards[str(message.get("key", ""))] = []
        for kind, pages in page_sets(self.memory, message):
            self.memory.fill_pages(pages, self.fill, kind)
            guards.append(self.memory.digest(guard_pages(pages, self.memory.num_pages), kind))
        return {"ok": True}

    def verify(self, message: dict[str, Any]) -> dict[str, Any]:
        sets = page_sets(self.memory, message)
        targets = [self.memory.digest(pages, kind) for kind, pages in sets]
        guards = [self.memory.digest(guard_pages(pages, self.memory.num_pages), kind) for kind, pages in sets]
        # every page set holds a full copy of the sender's pages (split presets mirror all layers per kind)
        ok = all(t == message["digest"] for t in targets)
        recorded = self.guards.get(str(message.get("key", "")))
        return {"ok": ok, "guards_ok": not recorded or guards == recorded}

    def reserve(self, message: dict[str, Any]) -> dict[str, Any]:
        """Landing pages of ``count`` for each of this rank's senders, all or none: ``{"pages": {sender: [ids]}}``."""
        landing = self._landing()
        got = landing.reserve(int(message["count"]))
        if got is None:
            raise RuntimeError(f"too few free landing pages ({landing.credits.free}) for {message['count']} per sender")
        return {"ok": True, "pages": {str(p): pages.tolist() for p, pages in got.items()}}

    def scatter(self, message: dict[str, Any]) -> dict[str, Any]:
        """Scatter one sender's landing pages into ``host_pages``; release them whatever happens."""
        landing = self._landing()
        land = np.asarray(message["landing_pages"], np.int64)
        try:
            landing.scatter(int(message["sender"]), land, np.asarray(message["host_pages"], np.int64))
        finally:
            landing.release(land)
        return {"ok": True}

    def _landing(self) -> Landing:
        if self.landing is None:
            raise RuntimeError("this decode side has no landing pool (start it with 'landing')")
        return self.landing

    def watch(self, message: dict[str, Any]) -> dict[str, Any]:
        if self.conn is None:
            raise RuntimeError("no connection to watch")
        if self._watcher is None:
            self._watcher = NotificationWatcher(self.conn, name="bench-watch")
        return {"ok": True}

    def confirm(self, message: dict[str, Any]) -> dict[str, Any]:
        """Wait for the request's notification (``note``, hex), then verify its pages; when it was seen."""
        if self._watcher is None:
            raise RuntimeError("confirm before watch")
        arrival = self._watcher.wait_for(bytes.fromhex(message["note"]), float(message.get("timeout_s", 30.0)))
        if arrival is None:
            return {"ok": False, "guards_ok": False, "seen": None, "error": "no notification"}
        return {**self.verify(message), "seen": arrival.seen}

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.stop()
        if self.landing is not None:
            self.landing.close()


def _start(args: dict[str, Any], host: str | None = None) -> tuple[Connection, KVMemory]:
    """Allocate the preset's decode-side pools, fill them, connect and register (``host``: this side's own)."""
    preset = get_preset(args["preset"])
    device = args.get("device", "cpu")
    entries = preset.entries(decode_side=True, device=device)
    tp = args.get("tp")  # [size, rank]: one decode rank of an attention-TP group, holding its heads
    page_bytes = preset.page_bytes if tp is None else preset.heads(int(tp[0])).page_bytes
    memory = allocate(entries, int(args["pages"]), page_bytes, backing="auto", device=device)
    if tp is not None:
        memory.layout = preset.rank_layout(memory.layout, int(tp[0]), int(tp[1]), bool(args.get("head_major")))
    memory.fill_random(int(args["seed"]))
    return _connect(args, host, memory.layout), memory


def _connect(args: dict[str, Any], host: str | None, layout: KVLayout) -> Connection:
    """A connection of the bench's backend and config (``host``: this side's own), ``layout`` registered."""
    settings = dict(args.get("config", {}))
    if host is not None:
        settings["host"] = host
    conn = connect(args["backend"], BackendConfig.from_dict(settings))
    conn.register_kv_buffers(layout)
    return conn


def _start_landing(
    args: dict[str, Any], memory: KVMemory, host: str | None
) -> tuple[Connection, Landing] | tuple[None, None]:
    """``landing``: ``[prefill TP, pages]``: a landing pool for this rank's senders, on a connection of its own."""
    spec = args.get("landing")
    if not spec:
        return None, None
    landing = Landing(memory.layout, int(spec[0]), int(spec[1]))
    return _connect(args, host, landing.layout), landing


def _session(
    args: dict[str, Any],
    stdin: IO[bytes] | None,
    stdout: IO[str] | None,
    host: str | None,
    step: Callable[[str], None] | None = None,
) -> int:
    if step is not None:
        step(f"allocating and registering {args.get('pages')} pages ({args.get('backend')}, {args.get('preset')})")
    try:
        conn, memory = _start(args, host)
        landing_conn, landing = _start_landing(args, memory, host)
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}"}, stdout)
        return 1
    described = PeerDescription(conn.endpoint(), memory.layout).to_dict()
    if landing_conn is not None and landing is not None:
        described["landing"] = PeerDescription(landing_conn.endpoint(), landing.layout).to_dict()
    reply(described, stdout)
    if step is not None:
        step(f"serving the prefill side ({memory.backing} pools, endpoint {conn.endpoint()})")
    side = DecodeSide(memory, conn, landing)
    handlers = {
        "scramble": side.scramble,
        "verify": side.verify,
        "watch": side.watch,
        "confirm": side.confirm,
        "reserve": side.reserve,
        "scatter": side.scatter,
    }
    with conn, landing_conn if landing_conn is not None else contextlib.nullcontext():
        try:
            serve(handlers, stdin=stdin, stdout=stdout)
        finally:
            side.stop()
    return 0


def main(raw: str) -> int:
    """Child mode: arguments on the command line, the channel on stdin/stdout."""
    return _session(json.loads(raw), None, claim_stdout(), None)


def listen(address: str, host: str, key: bytes | None = None, step: Callable[[str], None] | None = None) -> int:
    """Two-machine mode: serve one prefill side that connects to ``address``; ``host`` is this side's engine address.

    ``key``: the control key the prefill side must prove it holds (None: loopback only, with a warning).
    """
    bind_host, port = parse_address(address, "--listen")
    warning = check_listen_key(bind_host, key)
    sock, reader, writer = accept_one(bind_host, port, sys.stderr, key, notice=warning)
    with sock, reader, writer:
        if step is not None:
            peer = sock.getpeername()
            step(f"prefill side connected from {peer[0]}:{peer[1]} ({'key verified' if key else 'no control key'})")
        start = read_command(reader)
        if start is None or start.get("cmd") != "start":
            reply({"error": f"expected a 'start' command first, got {str(start)[:200]}"}, writer)
            return 1
        return _session(start, reader, writer, host, step)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
