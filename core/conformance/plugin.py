"""The conformance suite's pytest plugin: options, the ``conformance`` fixture, capability
skips and the JSON report. Registered through the ``pytest11`` entry point, so it is active in
any pytest run where Shardline is installed; it only acts on tests of this package.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from shardline.config.capacity import checked_world_sizes
from shardline.conformance.reporting import case_reason, summary, write_report
from shardline.errors import CommTimeoutError, ConfigError, PeerLostError, WorkerError
from shardline.interfaces import Capabilities
from shardline.launch.comm_world import CommunicatorSetup
from shardline.launch.local_world import LocalWorld
from shardline.registry import Component, Registry

_RESULTS = pytest.StashKey[list]()
_REPORT_PATH = pytest.StashKey[str]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardline", "Shardline communicator conformance")
    group.addoption(
        "--shardline-communicator",
        default=None,
        help="communicator to check: a registered name or package.module:Class",
    )
    group.addoption(
        "--shardline-world-sizes",
        default="1,2,3,4",
        help="comma-separated world sizes to check (default 1,2,3,4)",
    )
    group.addoption(
        "--shardline-timeout",
        type=float,
        default=30.0,
        help="deadline in seconds of every operation in the worlds (default 30)",
    )
    group.addoption(
        "--shardline-report",
        default=None,
        help="where to write the JSON report (default shardline-conformance-NAME.json)",
    )


_SUITE_DIR = Path(__file__).resolve().parent


def _in_suite(node: Any) -> bool:
    """True for tests defined in this package (judged by file: pytest may import the
    modules under another name, depending on its import mode and rootdir)."""
    path = getattr(node, "path", None)
    return path is not None and Path(path).resolve().parent == _SUITE_DIR


def world_sizes(config: pytest.Config) -> list[int]:
    try:
        return checked_world_sizes(
            "--shardline-world-sizes", config.getoption("--shardline-world-sizes")
        )
    except ConfigError as error:
        raise pytest.UsageError(str(error)) from None


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``world_size`` from ``--shardline-world-sizes``; a test marked
    ``shardline_world_sizes(...)`` keeps only those sizes."""
    if "world_size" not in metafunc.fixturenames or not _in_suite(metafunc.definition):
        return
    sizes = world_sizes(metafunc.config)
    marker = metafunc.definition.get_closest_marker("shardline_world_sizes")
    if marker is not None:
        applicable = [size for size in sizes if size in marker.args]
        if not applicable:
            reason = f"applies to world sizes {list(marker.args)}; this run has {sizes}"
            metafunc.parametrize(
                "world_size", [pytest.param(None, marks=pytest.mark.skip(reason=reason))]
            )
            return
        sizes = applicable
    metafunc.parametrize("world_size", sizes)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items) -> None:
    if any(_in_suite(item) for item in items) and not config.getoption("--shardline-communicator"):
        raise pytest.UsageError(
            "the Shardline conformance suite needs --shardline-communicator=NAME "
            "(see `shardline plugins` for the installed names)"
        )


class Conformance:
    """Session state: the backend under test and one reused world per size."""

    def __init__(self, config: pytest.Config) -> None:
        self.name: str = config.getoption("--shardline-communicator")
        self.timeout_s: float = config.getoption("--shardline-timeout")
        allow = os.environ.get("SHARDLINE_PLUGINS")
        self.allow = tuple(p.strip() for p in allow.split(",") if p.strip()) if allow else None
        self.registry = Registry.load(allow=self.allow)
        self.component: Component = self.registry.get("communicator", self.name)
        self.unavailable = self.component.unavailable_reason()
        self.capabilities: Capabilities = self.component.capabilities or Capabilities()
        self._worlds: dict[int, LocalWorld] = {}

    def require(self, **capability: Any) -> None:
        """Skip the current test, with the capability as the reason, unless supported."""
        if self.unavailable is not None:
            pytest.skip(f"unsupported: {self.name} unavailable: {self.unavailable}")
        reason = self.capabilities.unsupported_reason(**capability)
        if reason is not None:
            pytest.skip(f"unsupported: {reason}")

    def run(self, world_size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """Run ``fn`` on every rank of the (reused) world of ``world_size``; rank failures
        become this test's failure, naming the rank."""
        self.require(world_size=world_size)
        world = self._worlds.get(world_size)
        if world is None or world.broken is not None:
            if world is not None:
                world.close()
            try:
                world = LocalWorld(
                    world_size,
                    CommunicatorSetup(self.name, self.timeout_s, self.allow),
                    call_timeout_s=self.timeout_s + 30.0,
                    launcher=self.capabilities.launcher,
                )
            except WorkerError as error:
                if error.exc_type == "BackendUnavailableError":
                    # The backend cannot form this world here (e.g. fewer devices than ranks).
                    pytest.skip(f"unsupported: {error.args[0]}")
                raise
            self._worlds[world_size] = world
        try:
            return world.run(fn, *args, **kwargs)
        except WorkerError as error:
            pytest.fail(f"{error}\n\n{error.remote_traceback}", pytrace=False)
        except (CommTimeoutError, PeerLostError) as error:
            pytest.fail(f"{type(error).__name__}: {error}", pytrace=False)

    def close(self) -> None:
        for world in self._worlds.values():
            world.close()
        self._worlds.clear()


@pytest.fixture(scope="session")
def conformance(request: pytest.FixtureRequest):
    state = Conformance(request.config)
    yield state
    state.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if not _in_suite(item):
        return report
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        params = dict(getattr(item, "callspec", None).params) if hasattr(item, "callspec") else {}
        marker = item.get_closest_marker("shardline_op")
        operation = marker.args[0] if marker else item.originalname
        if "op" in params:
            operation = f"{operation}[{params['op']}]"
        reason = case_reason(report)
        item.config.stash.setdefault(_RESULTS, []).append(
            {
                "test": item.nodeid,
                "operation": operation,
                "dtype": params.get("dtype", "-"),
                "world_size": params.get("world_size"),
                "shape": params.get("shape", "-"),
                "outcome": "unsupported" if report.skipped else report.outcome,
                "reason": reason,
                "seconds": round(report.duration, 4),
            }
        )
    return report


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "shardline_op(name): the operation a conformance test checks"
    )
    config.addinivalue_line(
        "markers", "shardline_world_sizes(*sizes): world sizes a conformance test applies to"
    )


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    results = session.config.stash.get(_RESULTS, None)
    name = session.config.getoption("--shardline-communicator", None)
    if not results or not name:
        return
    path = Path(
        session.config.getoption("--shardline-report")
        or f"shardline-conformance-{_safe(name)}.json"
    )
    matrix: dict[str, dict[str, dict[str, str]]] = {}
    for case in results:
        cell = matrix.setdefault(case["operation"], {}).setdefault(case["dtype"], {})
        key = str(case["world_size"])
        verdict = (
            case["outcome"]
            if case["outcome"] != "unsupported"
            else f"unsupported({case['reason']})"
        )
        if cell.get(key, "passed") == "passed" or verdict == "failed":
            cell[key] = verdict
    report = {"communicator": name, "summary": summary(results), "matrix": matrix, "cases": results}
    write_report(path, report, session, exitstatus)
    session.config.stash[_REPORT_PATH] = str(path)


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    path = config.stash.get(_REPORT_PATH, None)
    if path:
        terminalreporter.write_line(f"shardline conformance report: {path}")


def _safe(name: str) -> str:
    return "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)
