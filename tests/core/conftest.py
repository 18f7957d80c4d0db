"""Fixtures of tests/core: a native-submit backend whose engine futures the test completes (:mod:`held_submit`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from held_submit import HeldSubmit, HeldTransport, Memory, SubmitWithoutNotifications

import kvwire
from kvwire import BackendConfig
from kvwire.backends.local import LocalBackend


@pytest.fixture
def direct() -> Iterator[tuple[SubmitWithoutNotifications, LocalBackend, str, Memory]]:
    """A submit-only backend called directly, its layout registered and a receiving local backend as its peer."""
    memory = Memory()
    sender, receiver = SubmitWithoutNotifications(BackendConfig()), LocalBackend(BackendConfig())
    endpoint = memory.pair(sender, receiver)
    yield sender, receiver, endpoint, memory
    sender.close()
    receiver.close()


@pytest.fixture
def held_registry() -> kvwire.Registry:
    registry = kvwire.Registry(allow=["local"], policy="strict")
    registry.register("held", HeldSubmit)
    return registry


@pytest.fixture
def held(held_registry: kvwire.Registry) -> Iterator[tuple[kvwire.Connection, HeldTransport, str, Memory]]:
    """A connection to a native-submit backend whose engine futures the test completes, and its peer."""
    memory = Memory()
    sender, receiver = held_registry.connect("held"), kvwire.connect("local")
    endpoint = memory.pair(sender, receiver)
    transport = sender.backend.transport
    assert isinstance(transport, HeldTransport)
    yield sender, transport, endpoint, memory
    for future in transport.held:
        if not future.done() and not future.cancel():
            future.set_result(None)  # started: complete it
    sender.close()
    receiver.close()
