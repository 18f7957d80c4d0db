"""pytest plugin (entry point ``pytest11: kvwire``): ``--kvwire-backend NAME`` runs the contract suite.

The suite is collected as the module ``kvwire.testing.contract`` (``--pyargs``). Outside
the rootdir pytest prints its node ids as ``::test_x[id]``; rerun one with ``pytest
--kvwire-backend NAME --pyargs 'kvwire.testing.contract::test_x[id]'`` (the report header
says so). Importing the suite into a test file of your own (``from kvwire.testing.contract
import *``) gives node ids under that file, rerunnable as printed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvwire.config import BackendConfig
from kvwire.errors import KvwireError
from kvwire.registry.loading import did_you_mean, is_module_path
from kvwire.registry.manager import default_registry, installed_backends
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
    if is_module_path(name):  # ``package.module:Class``, as ``kvwire check`` and ``kvwire.connect`` take it
        try:
            default_registry().get(name)
        except KvwireError as exc:
            raise pytest.UsageError(f"--kvwire-backend {name}: {exc}") from None
    elif name not in installed:
        raise pytest.UsageError(
            f"--kvwire-backend {name}: no installed kvwire backend is named {name!r}{did_you_mean(name, installed)}; "
            f"installed: {', '.join(installed) or 'none'}. Fix the name, or pip install the backend's distribution"
        )
    contract = Path(__file__).with_name("contract.py")
    if not any(_names_contract(arg, contract) for arg in config.args):
        config.args.append(CONTRACT_MODULE)
    config.option.pyargs = True  # the suite is named by module, wherever kvwire is installed


#: How the suite is named on the command line (with ``--pyargs``), and how to rerun one test.
CONTRACT_MODULE = "kvwire.testing.contract"

#: The fixtures a backend's own tests may override, and the scope each needs (the harness is per module).
OVERRIDABLE_SCOPES = {
    "kvwire_backend_name": ("module", "session"),
    "kvwire_two_process": ("module", "session"),
    "kvwire_backend_config": ("module", "session"),
}


#: The node ids of the items collected from the contract module itself (not imported into a test file).
_CONTRACT_NODEIDS = pytest.StashKey[set[str]]()


def _names_contract(arg: str, contract: Path) -> bool:
    target = arg.split("::", 1)[0]
    return target == CONTRACT_MODULE or Path(target).resolve() == contract.resolve()


def pytest_report_header(config: pytest.Config) -> str | None:
    name = config.getoption("--kvwire-backend")
    if not name:
        return None
    return (
        f"kvwire contract kit: backend {name}; rerun one test with: pytest --kvwire-backend {name} "
        f"--pyargs '{CONTRACT_MODULE}::<test>[<id>]'"
    )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """After a run with failed contract tests, the command that reruns each one alone."""
    name = config.getoption("--kvwire-backend")
    if not name:
        return
    reports = terminalreporter.stats.get("failed", []) + terminalreporter.stats.get("error", [])
    contract = config.stash.get(_CONTRACT_NODEIDS, set())
    failed = sorted({r.nodeid.split("::", 1)[1] for r in reports if r.nodeid in contract})
    if failed:
        terminalreporter.section("kvwire contract kit: rerun one failed test")
        for test in failed:
            terminalreporter.write_line(f"pytest --kvwire-backend {name} --pyargs '{CONTRACT_MODULE}::{test}'")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """A kit fixture overridden with a scope narrower than the harness's is one usage error saying what to write."""
    manager = session._fixturemanager  # no public way to ask which definition an item gets
    contract = Path(__file__).with_name("contract.py")
    config.stash[_CONTRACT_NODEIDS] = {item.nodeid for item in items if item.path == contract}
    for item in items:
        if "kvwire_harness" not in getattr(item, "fixturenames", ()):
            continue
        for name, allowed in OVERRIDABLE_SCOPES.items():
            definitions = manager.getfixturedefs(name, item) or ()
            if definitions and definitions[-1].scope not in allowed:
                where = definitions[-1].baseid or "conftest.py"
                raise pytest.UsageError(
                    f"kvwire contract kit: fixture {name} in {where} is {definitions[-1].scope}-scoped, but the "
                    f'kit\'s harness lives per module: write @pytest.fixture(scope="module") (or "session")'
                )


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
