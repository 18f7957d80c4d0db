"""``MooncakeEngine``: a small, well-behaved wrapper around ``mooncake.engine.TransferEngine``.

Mooncake's Python binding returns an int from every call and has sharp edges
every backend built on it would otherwise meet again. The wrapper raises
kvwire's exceptions (classifying the engine's bare ``-1`` by elapsed time and a
probe), checks that local sources lie in registered memory (the TCP transport
never does), chunks writes and bounds the descriptors in flight per peer, puts
a Python-side deadline on every call, renews its sending engine when a
session to a live peer broke for good (or when it holds the connections of
too many forgotten peers), and makes the engines it creates accept
connections only on ``BackendConfig.host``. Process-wide settings (``MC_*``
variables, capturing fd 2) are changed only with
``BackendConfig.process_settings``, and a host may hand in its own engine
(``options['engine']``). The measured behaviour behind each of these is in the
plugin's README ("Field notes").

Modules, one concern each: ``binding`` (call surface, return codes, import and
creation), ``environment`` (``MC_*`` variables), ``stderr`` (fd 2 capture),
``listening`` (the process's sockets, from ``/proc``), ``confine`` (filtering
the engine's listeners to ``BackendConfig.host``; the exposure warning),
``workers`` (threads for blocking calls), ``arrays`` (address-array checks;
registered memory and the local-source check: the core's ``RegionSet``),
``slots`` (the engines driven, their teardown),
``dispatch`` (chunking, in-flight bound, deadlines), ``failures``
(classification and probing), ``wrapper`` (:class:`MooncakeEngine`).
"""

from kvwire_mooncake.engine.binding import ENGINE_ERROR_CODES, P2P_HANDSHAKE, TransferEngineLike
from kvwire_mooncake.engine.confine import Confinement, ExposedListenerWarning
from kvwire_mooncake.engine.environment import engine_timeout_s, prepare_environment
from kvwire_mooncake.engine.wrapper import MooncakeEngine

__all__ = [
    "ENGINE_ERROR_CODES",
    "Confinement",
    "ExposedListenerWarning",
    "P2P_HANDSHAKE",
    "MooncakeEngine",
    "TransferEngineLike",
    "engine_timeout_s",
    "prepare_environment",
]
