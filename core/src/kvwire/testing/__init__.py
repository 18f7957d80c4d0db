"""The contract test kit: prove a backend moves the right bytes and refuses the wrong ones.

Run it against an installed backend with ``pytest --kvwire-backend NAME``
(add ``--kvwire-two-process`` when the two endpoints must live in separate
processes, as with any real transport), or import the suite into your own
tests with ``from kvwire.testing.contract import *`` and provide the
``kvwire_backend_name`` fixture.
"""

from kvwire.testing.harness import ContractHarness, expected_buffers
from kvwire.testing.receiver import LayoutSpec, Receiver

__all__ = ["ContractHarness", "LayoutSpec", "Receiver", "expected_buffers"]
