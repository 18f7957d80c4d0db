"""The receiving (decode) side of a contract test, in this process or another one.

A receiver allocates buffers from a :class:`LayoutSpec`, fills them with
seeded random bytes, registers them with the backend, publishes a
:class:`kvwire.PeerDescription` and reports a digest of every buffer on
request. In a subprocess it speaks JSON lines over stdin/stdout
(``python -m kvwire.testing.serve``, :mod:`kvwire.control`): no pickle.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal, Protocol

import numpy as np
from numpy.typing import NDArray

from kvwire.config import BackendConfig
from kvwire.connection import Connection
from kvwire.connection.watcher import Arrival as WatchedArrival
from kvwire.connection.watcher import NotificationWatcher
from kvwire.control import ChildProcess, ControlProtocolError, claim_stdout, reply, serve
from kvwire.layout.buffers import HeadLayout, MemoryKind, Role
from kvwire.layout.kv_layout import KVLayout
from kvwire.layout.peer import PeerDescription
from kvwire.workload.memory import KVMemory, allocate, digest

__all__ = [
    "Arrival",
    "InProcessReceiver",
    "LayoutSpec",
    "Receiver",
    "SubprocessReceiver",
    "buffer_digests",
    "run_receiver",
]

#: (sender, message, digest of the message's pages in every buffer when it was seen, or None if it named no pages)
Arrival = tuple[str, bytes, str | None]


@dataclass(frozen=True)
class LayoutSpec:
    """The shape of a KV layout to allocate: attention kind, layers, pages, page size, memory kinds.

    ``device_layers`` get a second buffer per (layer, role) marked ``"device"``
    (host memory here, addressed by device page ids): HiSparse's split destination.
    ``tp`` is the rank's ``(attn_tp_size, attn_tp_rank)`` and ``heads`` its
    :class:`~kvwire.HeadLayout` fields, for transfers across TP sizes.
    """

    attention: Literal["mha", "mla"]
    layers: tuple[int, ...]
    num_pages: int
    page_bytes: int
    device_layers: tuple[int, ...] = ()
    tp: tuple[int, int] | None = None
    heads: tuple[int, int, int, int, int] | None = None

    def roles(self) -> tuple[Role, ...]:
        return ("k", "v") if self.attention == "mha" else ("kv",)

    def entries(self) -> list[tuple[int, Role, MemoryKind]]:
        """(layer, role, memory) per buffer, in layout order (K of all layers, then V, ...)."""
        out: list[tuple[int, Role, MemoryKind]] = []
        for role in self.roles():
            out += [(layer, role, "host") for layer in self.layers]
            out += [(layer, role, "device") for layer in self.device_layers]
        return out

    def allocate(self, seed: int) -> KVMemory:
        """Host buffers of this shape, filled with random bytes from ``seed``."""
        memory = allocate(self.entries(), self.num_pages, self.page_bytes)
        if self.tp is not None:
            heads = None if self.heads is None else HeadLayout(*self.heads)
            memory.layout = replace(memory.layout, attn_tp_size=self.tp[0], attn_tp_rank=self.tp[1], heads=heads)
        memory.fill_random(seed)
        return memory

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LayoutSpec:
        return cls(
            data["attention"],
            tuple(data["layers"]),
            data["num_pages"],
            data["page_bytes"],
            tuple(data.get("device_layers", ())),
            None if data.get("tp") is None else (int(data["tp"][0]), int(data["tp"][1])),
            None if data.get("heads") is None else tuple(int(x) for x in data["heads"]),  # type: ignore[arg-type]
        )


def buffer_digests(arrays: Sequence[NDArray[np.uint8]]) -> list[str]:
    """One digest per buffer, in order (what :meth:`Receiver.hashes` reports)."""
    return [digest([a]) for a in arrays]


class Receiver(Protocol):
    """What the harness needs of a receiving endpoint."""

    endpoint: str
    layout: KVLayout

    def hashes(self) -> list[str]: ...
    def start_watch(self, pages: Mapping[bytes, Sequence[int]]) -> None: ...
    def collect(self, count: int, timeout_s: float) -> list[Arrival]: ...
    def close(self) -> None: ...


class _Watcher:
    """Digests each notification's pages the moment the connection's watcher sees it."""

    def __init__(self, connection: Connection, memory: KVMemory, pages: Mapping[bytes, Sequence[int]]) -> None:
        self._memory, self._pages = memory, dict(pages)
        self._digests: list[str | None] = []  # one per arrival, in arrival order
        # poll_s=0: only yield between polls, so a notification is digested as early as it can be
        self._watcher = NotificationWatcher(connection, self._digest, poll_s=0, name="kvwire-kit-watch")

    def _digest(self, arrival: WatchedArrival) -> None:
        ids = self._pages.get(arrival.notification.message)
        self._digests.append(None if ids is None else self._memory.digest(np.asarray(ids, dtype=np.int64)))

    def wait(self, count: int, timeout_s: float) -> list[Arrival]:
        arrivals = self._watcher.wait(count, timeout_s)
        return [
            (a.notification.sender, a.notification.message, digest)
            for a, digest in zip(arrivals, self._digests, strict=False)
        ]

    def stop(self) -> None:
        self._watcher.stop()


class InProcessReceiver:
    """A receiver in this process (for in-process backends such as ``local``)."""

    def __init__(self, backend: str, spec: LayoutSpec, seed: int, config: BackendConfig | None = None) -> None:
        from kvwire.registry.manager import connect

        self.memory = spec.allocate(seed)
        self.layout = self.memory.layout
        self.connection = connect(backend, config)
        self.connection.register_kv_buffers(self.layout)
        self.endpoint = self.connection.endpoint()
        self._watcher: _Watcher | None = None

    def hashes(self) -> list[str]:
        return buffer_digests(self.memory.views)

    def start_watch(self, pages: Mapping[bytes, Sequence[int]]) -> None:
        """Start polling notifications in a thread; each one's pages are digested the moment it is seen.

        The digest shows whether a notification's data was complete when it
        arrived. Polling has begun when this returns, so senders may start.
        """
        self.stop_watch()
        self._watcher = _Watcher(self.connection, self.memory, pages)

    def collect(self, count: int, timeout_s: float) -> list[Arrival]:
        """The arrivals once ``count`` were seen or ``timeout_s`` passed; stops the watch."""
        watcher = self._watcher
        if watcher is None:
            raise RuntimeError("collect() without start_watch()")
        arrivals = watcher.wait(count, timeout_s)
        self.stop_watch()
        return arrivals

    def stop_watch(self) -> None:
        watcher, self._watcher = getattr(self, "_watcher", None), None
        if watcher is not None:
            watcher.stop()

    def close(self) -> None:
        self.stop_watch()
        self.connection.close()


class SubprocessReceiver:
    """A receiver in a child process (``python -m kvwire.testing.serve``), over the control channel."""

    def __init__(
        self, backend: str, spec: LayoutSpec, seed: int, config: BackendConfig | None = None, timeout_s: float = 60.0
    ) -> None:
        settings = json.dumps((config or BackendConfig()).to_dict())
        self.child = ChildProcess(
            "kvwire.testing.serve",
            [backend, json.dumps(spec.to_dict()), str(seed), settings],
            what=f"receiver of backend {backend!r}",
            timeout_s=timeout_s,
        )
        try:
            peer = PeerDescription.from_dict(self.child.read())
        except BaseException:
            self.child.close()
            raise
        self.endpoint, self.layout = peer.endpoint, peer.layout

    @property
    def pid(self) -> int:
        return self.child.pid

    def hashes(self) -> list[str]:
        answer = self.child.request({"cmd": "hashes"}).get("hashes")
        if not isinstance(answer, list) or not all(isinstance(h, str) for h in answer):
            raise ControlProtocolError(f"{self.child.what} answered 'hashes' with {answer!r:.200}, not a list of str")
        return answer

    def start_watch(self, pages: Mapping[bytes, Sequence[int]]) -> None:
        pages_hex = {m.hex(): [int(i) for i in ids] for m, ids in pages.items()}
        self.child.request({"cmd": "start_watch", "pages": pages_hex})

    def collect(self, count: int, timeout_s: float) -> list[Arrival]:
        answer = self.child.request({"cmd": "collect", "count": count, "timeout_s": timeout_s}).get("arrivals")
        if not isinstance(answer, list):
            raise ControlProtocolError(f"{self.child.what} answered 'collect' with {answer!r:.200}, not a list")
        return [(str(a[0]), bytes.fromhex(a[1]), None if a[2] is None else str(a[2])) for a in answer]

    def close(self) -> None:
        self.child.close()


def run_receiver(backend: str, spec_json: str, seed: int, config_json: str = "{}") -> int:
    """Run a receiver for the parent process over stdin/stdout (``python -m kvwire.testing.serve``).

    It takes the process's fd 1 over for its replies (:func:`~kvwire.control.claim_stdout`): a child's entry point.
    """
    channel = claim_stdout()
    try:
        config = BackendConfig.from_dict(json.loads(config_json))
        receiver = InProcessReceiver(backend, LayoutSpec.from_dict(json.loads(spec_json)), seed, config)
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}"}, channel)
        return 1
    reply(PeerDescription(receiver.endpoint, receiver.layout).to_dict(), channel)

    def start_watch(request: dict[str, Any]) -> dict[str, Any]:
        receiver.start_watch({bytes.fromhex(m): ids for m, ids in request["pages"].items()})
        return {"ok": True}

    def collect(request: dict[str, Any]) -> dict[str, Any]:
        found = receiver.collect(int(request["count"]), float(request["timeout_s"]))
        return {"arrivals": [[sender, message.hex(), seen] for sender, message, seen in found]}

    handlers = {"hashes": lambda _: {"hashes": receiver.hashes()}, "start_watch": start_watch, "collect": collect}
    try:
        serve(handlers, stdout=channel)
    finally:
        receiver.close()
    return 0
