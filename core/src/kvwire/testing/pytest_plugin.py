"""pytest plugin (entry point ``pytest11: kvwire``): ``--kvwire-backend NAME`` runs the contract suite."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvwire.config import BackendConfig
from kvwire.registry.loading import did_you_mean
from kvwire.registry.manager import installed_backends
from kvwire.testing.harness import ContractHarness


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvwire", "kvwire backend contract test kit")
    group.addoption(
        "--kvwire-backend",
        default=None,
        metavar="NAME",
        help="run the kvwire contract suite against the installed backend NAME",
    )
    group.addoption(
        "--kvwire-two-process",
        action="store_true",
        default=False,
        help="run the receiving endpoint in a separate process (needed by real transports)",
    )


def pytest_configure(config: pytest.Config) -> None:
    """Add the contract suite when a backend is named; a name that is not installed is one usage error."""
    name = config.getoption("--kvwire-backend")
    if not name:
        return
    installed = installed_backends()
    if name not in installed:
        raise pytest.UsageError(
            f"--kvwire-backend {name}: no installed kvwire backend is named {name!r}{did_you_mean(name, installed)}; "
            f"installed: {', '.join(installed) or 'none'}. Fix the name, or pip install the backend's distribution"
        )
    config.args.append(str(Path(__file__).with_name("contract.py")))


@pytest.fixture(scope="session")
def kvwire_backend_name(request: pytest.FixtureRequest) -> str:
    """The backend under test; override this fixture to run the suite from your own tests."""
    name = request.config.getoption("--kvwire-backend")
    if not name:
        pytest.skip("no backend given: pass --kvwire-backend NAME or override the kvwire_backend_name fixture")
    return str(name)


@pytest.fixture(scope="session")
def kvwire_two_process(request: pytest.FixtureRequest) -> bool:
    """Whether receivers run in their own process; override to force it."""
    return bool(request.config.getoption("--kvwire-two-process"))


@pytest.fixture(scope="session")
def kvwire_backend_config() -> BackendConfig | None:
    """The BackendConfig both endpoints are created with (None: defaults); override to set options."""
    return None


@pytest.fixture(scope="module")  # module: test modules may each override the backend under test
def kvwire_harness(
    kvwire_backend_name: str, kvwire_two_process: bool, kvwire_backend_config: BackendConfig | None
) -> ContractHarness:
    return ContractHarness(kvwire_backend_name, two_process=kvwire_two_process, config=kvwire_backend_config)
