"""Mooncake's Python binding as the wrapper sees it: call surface, return codes, import, creation.

``mooncake.engine`` is imported only when kvwire creates an engine (never when
``kvwire_mooncake`` is imported), and a failed import becomes a
:class:`~kvwire.BackendUnavailableError` saying what to install: the engine
wheels fail to import in several distinct ways (missing wheel, missing system
library, CUDA build on a machine without CUDA).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping
from typing import Final, Protocol

from kvwire.config import BackendConfig
from kvwire.errors import BackendUnavailableError
from kvwire_mooncake.engine import confine
from kvwire_mooncake.engine.environment import prepare_environment
from kvwire_mooncake.engine.stderr import captured_stderr

__all__ = [
    "ENGINE_ERROR_CODES",
    "ENGINE_METHODS",
    "P2P_HANDSHAKE",
    "TransferEngineLike",
    "create_engine",
    "default_engine_factory",
    "p2p_endpoint",
    "unavailable_message",
]

#: Mooncake's ``mooncake-transfer-engine/include/error.h``. Register/unregister and
#: ``send_probe`` return these; ``batch_transfer_sync_write`` returns only 0 or -1.
ENGINE_ERROR_CODES: Final[Mapping[int, str]] = {
    -1: "ERR_INVALID_ARGUMENT",
    -2: "ERR_TOO_MANY_REQUESTS",
    -3: "ERR_ADDRESS_NOT_REGISTERED",
    -4: "ERR_BATCH_BUSY",
    -6: "ERR_DEVICE_NOT_FOUND",
    -7: "ERR_ADDRESS_OVERLAPPED",
    -101: "ERR_DNS",
    -102: "ERR_SOCKET",
    -103: "ERR_MALFORMED_JSON",
    -104: "ERR_REJECT_HANDSHAKE",
    -200: "ERR_METADATA",
    -201: "ERR_ENDPOINT",
    -202: "ERR_CONTEXT",
    -300: "ERR_NUMA",
    -301: "ERR_CLOCK",
    -302: "ERR_MEMORY",
    -303: "ERR_NOT_IMPLEMENTED",
}

P2P_HANDSHAKE: Final = "P2PHANDSHAKE"

#: Debian packages the non-CUDA wheel needs and does not bundle.
_SYSTEM_PACKAGES: Final = "libibverbs1 libnuma1 libcurl4"
_LIB_PACKAGES: Final[Mapping[str, str]] = {
    "libibverbs": "libibverbs1",
    "libnuma": "libnuma1",
    "libcurl": "libcurl4",
    "librdmacm": "librdmacm1",
}


class TransferEngineLike(Protocol):
    """The call surface of ``mooncake.engine.TransferEngine`` the wrapper uses (all return codes).

    Engine doubles passed through ``engine_factory`` implement these methods. An
    optional ``send_probe(session_id) -> int`` (0 = peer answers) lets failures be
    classified as unreachable vs rejected; without it a failure is a plain
    :class:`~kvwire.TransferError`.
    """

    def initialize(self, local_hostname: str, metadata_server: str, protocol: str, device_name: str, /) -> int: ...

    def get_rpc_port(self) -> int: ...

    def register_memory(self, buffer_addr: int, capacity: int, /) -> int: ...

    def unregister_memory(self, buffer_addr: int, /) -> int: ...

    def batch_transfer_sync_write(
        self,
        target_hostname: str,
        buffers: list[int],
        peer_buffer_addresses: list[int],
        lengths: list[int],
        /,
    ) -> int: ...


#: The methods of :class:`TransferEngineLike`, which an engine handed in by the host must have.
ENGINE_METHODS: Final = (
    "initialize",
    "get_rpc_port",
    "register_memory",
    "unregister_memory",
    "batch_transfer_sync_write",
)


def unavailable_message(exc: ImportError) -> str:
    """What to install, from the import error of ``mooncake.engine``."""
    text = str(exc)
    lib = re.search(r"(lib[\w+-]+)\.so[\w.]*", text)
    if lib is not None:
        name = lib.group(1)
        if name.startswith(("libcudart", "libcuda", "libcublas", "libnvidia")):
            return (
                f"cannot load the Mooncake transfer engine: {text}. The CUDA build of the engine is "
                "installed on a machine without CUDA: pip uninstall mooncake-transfer-engine and "
                "pip install 'kvwire-mooncake[cpu]' (mooncake-transfer-engine-non-cuda)"
            )
        package = _LIB_PACKAGES.get(name)
        which = f" ({name} is in the Debian package {package})" if package else ""
        return (
            f"cannot load the Mooncake transfer engine: {text}. A system library is missing{which}: "
            f"apt-get update && apt-get install -y {_SYSTEM_PACKAGES}"
        )
    return (
        f"the Mooncake transfer engine is not installed ({text}): pip install 'kvwire-mooncake[cpu]' "
        "(installs mooncake-transfer-engine-non-cuda; [cuda] or [cuda13] for GPU machines)"
    )


def default_engine_factory() -> Callable[[], TransferEngineLike]:
    """``mooncake.engine.TransferEngine``, imported now (never when kvwire_mooncake is imported)."""
    try:
        module = importlib.import_module("mooncake.engine")
    except ImportError as exc:
        raise BackendUnavailableError(unavailable_message(exc)) from exc
    factory: Callable[[], TransferEngineLike] = module.TransferEngine
    return factory


def create_engine(
    factory: Callable[[], TransferEngineLike], config: BackendConfig, *, restrict_listeners: bool = True
) -> tuple[TransferEngineLike, confine.Confinement]:
    """A new engine from ``factory``, initialised with ``config``'s host, metadata server, protocol, device.

    With ``config.process_settings`` Mooncake's environment is set first
    (``MC_TRANSFER_TIMEOUT`` is read by the constructor) and, unless verbose, fd 2
    is captured around creation so the engine's creation log stays off the
    terminal (it is quoted in the error when initialisation fails). Without it,
    neither the environment nor fd 2 is touched.

    The listeners the engine opens (on every interface, whatever the host) are
    then filtered to ``config.host``'s addresses unless ``restrict_listeners`` is
    False; the returned :class:`~kvwire_mooncake.engine.confine.Confinement`
    says what was done (and :class:`~kvwire_mooncake.engine.confine.ExposedListenerWarning`
    is shown once per process if some stayed exposed). Per-socket, not process-wide.
    """
    if config.process_settings:
        prepare_environment(config)
    name = config.host
    with confine.watch() as created, captured_stderr(config.process_settings and not config.verbose) as log:
        engine: TransferEngineLike | None = factory()
        assert engine is not None
        rc = int(engine.initialize(name, config.metadata_server, config.protocol, config.device))
        if rc != 0:
            engine = None  # destroyed here, so its shutdown log is captured too
    if engine is None:
        detail = ("; engine log: " + " | ".join(log[-8:])) if log else ""
        raise BackendUnavailableError(
            f"Mooncake engine initialize({name!r}, {config.metadata_server!r}, {config.protocol!r}, "
            f"{config.device!r}) returned {rc}{detail}"
        )
    confinement = confine.confine(
        created,
        host=config.host,
        rpc_port=int(engine.get_rpc_port()),
        protocol=config.protocol,
        restrict=restrict_listeners,
    )
    return engine, confinement


def p2p_endpoint(host: str, port: int) -> str:
    """The engine's own P2P session name: ``host`` without any port, IPv6 in brackets, then the rpc port."""
    host = confine.bare_host(host)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
