"""``MooncakeOptions.from_config``: the Mooncake keys of ``BackendConfig.options``, parsed and checked."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from kvwire.config import BackendConfig
from kvwire.errors import ConfigError
from kvwire_mooncake.engine import MooncakeEngine
from kvwire_mooncake.engine_double import HostMemoryEngine
from kvwire_mooncake.options import MooncakeOptions


def parse(**options: Any) -> MooncakeOptions:
    return MooncakeOptions.from_config(BackendConfig(options=options))


def fails(message: str, **options: Any) -> None:
    with pytest.raises(ConfigError, match=f"^{re.escape(message)}$"):
        parse(**options)


def test_defaults() -> None:
    assert parse() == MooncakeOptions(max_descriptors_per_call=1024, max_inflight_per_peer=1024, engine=None)


@pytest.mark.parametrize("value", [512, "512", " 512 ", np.int32(512)], ids=["int", "str", "padded-str", "numpy"])
def test_ints_and_decimal_strings_are_accepted(value: object) -> None:
    options = parse(max_descriptors_per_call=value, max_inflight_per_peer="2048")
    assert options.max_descriptors_per_call == 512 and type(options.max_descriptors_per_call) is int
    assert options.max_inflight_per_peer == 2048 and type(options.max_inflight_per_peer) is int


def test_limits_are_inclusive() -> None:
    options = parse(max_descriptors_per_call=1, max_inflight_per_peer=2048)
    assert (options.max_descriptors_per_call, options.max_inflight_per_peer) == (1, 2048)


@pytest.mark.parametrize(
    ("value", "shown"),
    [(True, "bool True"), (1.0, "float 1.0"), ("1e3", "str '1e3'"), ("", "str ''"), (None, "NoneType None")],
)
def test_non_ints_are_refused(value: object, shown: str) -> None:
    fails(
        f"BackendConfig.options['max_descriptors_per_call'] must be an int or a decimal string, got {shown}",
        max_descriptors_per_call=value,
    )


@pytest.mark.parametrize(("value", "shown"), [(0, 0), (4096, 4096), ("-1", -1)])
def test_out_of_range_is_refused(value: object, shown: int) -> None:
    fails(
        f"BackendConfig.options['max_inflight_per_peer'] must be in [1, 2048], got {shown}", max_inflight_per_peer=value
    )


def test_inflight_below_per_call_is_refused() -> None:
    fails(
        "BackendConfig.options['max_inflight_per_peer'] must be >= max_descriptors_per_call, got 512 < 1024",
        max_inflight_per_peer=512,
    )


def test_unknown_key_names_it_lists_the_known_and_suggests() -> None:
    known = (
        "(known: 'engine', 'host_registered', 'max_descriptors_per_call', 'max_inflight_per_peer', "
        "'restrict_listeners')"
    )
    fails(
        f"BackendConfig.options['max_descriptor_per_call'] is not a Mooncake option {known}; "
        "did you mean 'max_descriptors_per_call'?",
        max_descriptor_per_call=512,
    )
    fails(f"BackendConfig.options['colour'] is not a Mooncake option {known}", colour="blue")


class Partial:
    """Has some of the engine's methods; ``get_rpc_port`` is an attribute, not a method."""

    get_rpc_port = 15000

    def initialize(self, *args: str) -> int:
        return 0

    def register_memory(self, ptr: int, size: int) -> int:
        return 0


def test_engine_without_the_engine_methods_is_refused() -> None:
    fails(
        "BackendConfig.options['engine'] must be an initialised Mooncake TransferEngine or None; got Partial, "
        "which lacks get_rpc_port, unregister_memory, batch_transfer_sync_write",
        engine=Partial(),
    )
    fails(
        "BackendConfig.options['engine'] must be an initialised Mooncake TransferEngine or None; got str, "
        "which lacks initialize, get_rpc_port, register_memory, unregister_memory, batch_transfer_sync_write",
        engine="ascend",
    )


def test_engine_with_the_methods_is_kept_as_is() -> None:
    engine = HostMemoryEngine()
    assert parse(engine=engine).engine is engine


class Recording(HostMemoryEngine):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    def batch_transfer_sync_write(
        self, target: str, src: Sequence[int], dst: Sequence[int], length: Sequence[int]
    ) -> int:
        self.calls.append(len(src))
        return super().batch_transfer_sync_write(target, src, dst, length)


def test_the_engine_wrapper_chunks_by_the_options() -> None:
    made: list[Recording] = []

    def factory() -> Recording:
        made.append(Recording())
        return made[-1]

    config = BackendConfig(options={"max_descriptors_per_call": "3", "max_inflight_per_peer": 6})
    src, dst = np.arange(10, dtype=np.uint8), np.zeros(10, dtype=np.uint8)
    peer = HostMemoryEngine()
    assert peer.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert peer.register_memory(int(dst.ctypes.data), dst.size) == 0
    try:
        with MooncakeEngine(config, engine_factory=factory) as eng:
            assert eng.options == MooncakeOptions(3, 6)
            eng.register(int(src.ctypes.data), src.size)
            offsets = np.arange(10, dtype=np.int64)
            eng.write(
                f"127.0.0.1:{peer.get_rpc_port()}",
                offsets + src.ctypes.data,
                offsets + dst.ctypes.data,
                offsets * 0 + 1,
            )
        assert sorted(made[0].calls) == [1, 3, 3, 3]
        assert dst.tolist() == src.tolist()
    finally:
        peer.close()
    with pytest.raises(ConfigError, match=r"options\['max_inflight_per_peer'\] must be >="):
        MooncakeEngine(BackendConfig(options={"max_descriptors_per_call": 8, "max_inflight_per_peer": 4}))
