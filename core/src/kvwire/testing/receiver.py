"""The receiving (decode) side of a contract test, in this process or another one.

A receiver allocates host buffers from a :class:`LayoutSpec`, fills them with
seeded random bytes, registers them with the backend and reports sha256
hashes of every buffer on request. In a subprocess it speaks JSON lines over
stdin/stdout (``python -m kvwire.testing.serve``): no pickle on the wire.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, Protocol, cast

import numpy as np
from numpy.typing import NDArray

from kvwire.config import BackendConfig
from kvwire.control import ChildProcess, read_command, reply
from kvwire.layout import KVBuffer, KVLayout, MemoryKind, Role

__all__ = ["InProcessReceiver", "LayoutSpec", "Receiver", "SubprocessReceiver", "allocate", "fill_random"]


@dataclass(frozen=True)
class LayoutSpec:
    """The shape of a KV layout to allocate: attention kind, layers, pages, page size, memory kinds.

    ``device_layers`` get a second buffer per (layer, role) marked ``"device"``
    (host memory here, addressed by device page ids): HiSparse's split destination.
    """

    attention: Literal["mha", "mla"]
    layers: tuple[int, ...]
    num_pages: int
    page_bytes: int
    device_layers: tuple[int, ...] = ()

    def roles(self) -> tuple[Role, ...]:
        return ("k", "v") if self.attention == "mha" else ("kv",)

    def entries(self) -> list[tuple[int, Role, MemoryKind]]:
        """(layer, role, memory) per buffer, in layout order (K of all layers, then V, ...)."""
        out: list[tuple[int, Role, MemoryKind]] = []
        for role in self.roles():
            out += [(layer, role, "host") for layer in self.layers]
            out += [(layer, role, "device") for layer in self.device_layers]
        return out

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
        )


def allocate(spec: LayoutSpec) -> tuple[list[NDArray[np.uint8]], KVLayout]:
    """Buffers (pages x page_bytes, uint8) and the layout describing them."""
    arrays = [np.empty((spec.num_pages, spec.page_bytes), np.uint8) for _ in spec.entries()]
    buffers = tuple(
        KVBuffer(int(a.ctypes.data), spec.page_bytes, spec.num_pages, layer, role, memory)
        for a, (layer, role, memory) in zip(arrays, spec.entries())
    )
    return arrays, KVLayout(buffers)


def fill_random(arrays: Sequence[NDArray[np.uint8]], seed: int) -> None:
    """Fill every buffer with seeded random bytes (never zeros: a no-op transfer must show)."""
    rng = np.random.default_rng(seed)
    for a in arrays:
        a[...] = rng.integers(0, 256, size=a.shape, dtype=np.uint8)


def hashes(arrays: Sequence[NDArray[np.uint8]]) -> list[str]:
    return [hashlib.sha256(a.tobytes()).hexdigest() for a in arrays]


class Receiver(Protocol):
    """What the harness needs of a receiving endpoint."""

    endpoint: str
    layout: KVLayout

    def hashes(self) -> list[str]: ...
    def close(self) -> None: ...


class InProcessReceiver:
    """A receiver in this process (for in-process backends such as ``local``)."""

    def __init__(self, backend: str, spec: LayoutSpec, seed: int, config: BackendConfig | None = None) -> None:
        from kvwire.registry import connect

        self.arrays, self.layout = allocate(spec)
        fill_random(self.arrays, seed)
        self.connection = connect(backend, config)
        self.connection.register_kv_buffers(self.layout)
        self.endpoint = self.connection.endpoint()

    def hashes(self) -> list[str]:
        return hashes(self.arrays)

    def close(self) -> None:
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
            hello = self.child.read()
            self.endpoint = cast(str, hello["endpoint"])
            self.layout = KVLayout.from_dict(hello["layout"])
        except BaseException:
            self.child.close()
            raise

    @property
    def pid(self) -> int:
        return self.child.pid

    def hashes(self) -> list[str]:
        return cast(list[str], self.child.request({"cmd": "hashes"})["hashes"])

    def close(self) -> None:
        self.child.close()


def serve(backend: str, spec_json: str, seed: int, config_json: str = "{}") -> int:
    """Run a receiver for the parent process over stdin/stdout (``python -m kvwire.testing.serve``)."""
    try:
        config = BackendConfig.from_dict(json.loads(config_json))
        receiver = InProcessReceiver(backend, LayoutSpec.from_dict(json.loads(spec_json)), seed, config)
    except Exception as exc:
        reply({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    reply({"endpoint": receiver.endpoint, "layout": receiver.layout.to_dict()})
    try:
        while (command := read_command()) is not None and command.get("cmd") != "quit":
            if command.get("cmd") == "hashes":
                reply({"hashes": receiver.hashes()})
            else:
                reply({"error": f"unknown command {command.get('cmd')!r}"})
    finally:
        receiver.close()
    if command is not None:
        reply({"ok": True})
    return 0
