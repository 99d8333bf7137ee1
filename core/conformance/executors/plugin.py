"""The executor suite's pytest plugin: options, the ``executor_conformance`` fixture, capability
skips and the JSON report. Registered through the ``pytest11`` entry point; it only acts on
tests of this package.

Executors driven from one process (``uni``, ``mp``, most third-party ones) are built here and
checked in this process. For a launched executor (``launched = True``) the suite starts one
world per size with a real launcher (torchrun by default) and every rank runs the checks
(:mod:`shardline.conformance.executors.launched`); a check passes when it passes on every rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

from shardline.config.capacity import checked_world_sizes
from shardline.conformance.executors.checks import (
    CHECKS,
    Subject,
    not_applicable,
    probe_config,
)
from shardline.conformance.reporting import case_reason, summary, write_report
from shardline.errors import ConfigError
from shardline.interfaces import Executor
from shardline.launch import launchers, private_shm
from shardline.registry import Registry

_RESULTS = pytest.StashKey[list]()
_SUITE_DIR = Path(__file__).resolve().parent


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("shardline-executors", "Shardline executor conformance")
    group.addoption(
        "--shardline-executor",
        default=None,
        help="executor to check: a registered name or package.module:Class",
    )
    group.addoption(
        "--shardline-executor-world-sizes",
        default="1,2,4",
        help="comma-separated world sizes to check (default 1,2,4)",
    )
    group.addoption(
        "--shardline-executor-timeout",
        type=float,
        default=20.0,
        help="parallel.timeout_s of the worlds checked (default 20)",
    )
    group.addoption(
        "--shardline-launcher",
        default="torchrun",
        choices=launchers.LAUNCHERS,
        help="launcher that starts the ranks of a launched executor (default torchrun)",
    )
    group.addoption(
        "--shardline-executor-report",
        default=None,
        help="JSON report path (default shardline-executor-conformance-NAME.json)",
    )


def _in_suite(node: Any) -> bool:
    path = getattr(node, "path", None)
    return path is not None and Path(path).resolve().parent == _SUITE_DIR


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "world_size" not in metafunc.fixturenames or not _in_suite(metafunc.definition):
        return
    flag = "--shardline-executor-world-sizes"
    try:
        sizes = checked_world_sizes(flag, metafunc.config.getoption(flag))
    except ConfigError as error:
        raise pytest.UsageError(str(error)) from None
    metafunc.parametrize("world_size", sizes)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items) -> None:
    """Without ``--shardline-executor``, the suite's tests are an error when they are all
    that was collected, and are left out otherwise, or when the communicator suite runs
    (``--pyargs shardline.conformance`` collects this package too; should its own tests fail
    to collect, theirs is the error to see)."""
    ours = [item for item in items if _in_suite(item)]
    if not ours or config.getoption("--shardline-executor"):
        return
    if len(ours) < len(items) or config.getoption("--shardline-communicator", default=None):
        items[:] = [item for item in items if not _in_suite(item)]
        config.hook.pytest_deselected(items=ours)
        return
    raise pytest.UsageError(
        "the Shardline executor suite needs --shardline-executor=NAME "
        "(see `shardline plugins` for the installed names)"
    )


class ExecutorConformance:
    """Session state: the executor under test, one reused executor per world size (driver
    mode) or one launched run per world size (launched mode)."""

    def __init__(self, config: pytest.Config) -> None:
        self.name: str = config.getoption("--shardline-executor")
        self.timeout_s: float = config.getoption("--shardline-executor-timeout")
        self.launcher: str = config.getoption("--shardline-launcher")
        allow = os.environ.get("SHARDLINE_PLUGINS")
        self.allow = tuple(p.strip() for p in allow.split(",") if p.strip()) if allow else None
        component = Registry.load(allow=self.allow).get("executor", self.name)
        self.unavailable = component.unavailable_reason()
        self.executor_class: type[Executor] | None = (
            component.load_available() if self.unavailable is None else None
        )
        self._shared: dict[int, Executor] = {}
        self._launched: dict[int, tuple[dict[str, list[dict]], str]] = {}

    def check(self, name: str, world_size: int) -> None:
        """Run check ``name`` at ``world_size``: skip when it does not apply, fail naming the
        rank (launched mode) when it does not pass."""
        if self.executor_class is None:
            pytest.skip(f"unsupported: {self.name} unavailable: {self.unavailable}")
        reason = not_applicable(self.executor_class, name, world_size)
        if reason is not None:
            pytest.skip(f"unsupported: {self.name} {reason}")
        if self.executor_class.launched:
            self._check_launched(name, world_size)
            return
        config = probe_config(self.name, world_size, self.timeout_s, self.allow)
        subject = Subject(
            self.executor_class,
            world_size,
            shared=lambda: self._shared_executor(world_size),
            fresh=lambda: self.executor_class(config),
        )
        try:
            CHECKS[name][0](subject)
        finally:
            self._drop_if_broken(world_size)

    def _shared_executor(self, world_size: int) -> Executor:
        if world_size not in self._shared:
            config = probe_config(self.name, world_size, self.timeout_s, self.allow)
            self._shared[world_size] = self.executor_class(config)
        return self._shared[world_size]

    def _drop_if_broken(self, world_size: int) -> None:
        executor = self._shared.get(world_size)
        if executor is None:
            return
        try:
            executor.check_health()
        except Exception:
            executor.shutdown()
            del self._shared[world_size]

    def _check_launched(self, name: str, world_size: int) -> None:
        if world_size not in self._launched:
            self._launched[world_size] = self._launch(world_size)
        results, details = self._launched[world_size]
        reports = results.get(name, [])
        if len(reports) != world_size:
            pytest.fail(
                f"{len(reports)} of {world_size} ranks reported check {name!r}\n{details}",
                pytrace=False,
            )
        failures = [r for r in reports if r["outcome"] == "failed"]
        if failures:
            pytest.fail(
                "\n".join(
                    f"rank {r['rank']}: {r['message']}\n{r.get('traceback', '')}" for r in failures
                ),
                pytrace=False,
            )
        if all(r["outcome"] == "unsupported" for r in reports):
            pytest.skip(f"unsupported: {reports[0]['message']}")

    def _launch(self, world_size: int) -> tuple[dict[str, list[dict]], str]:
        """One world of ``world_size`` ranks under the launcher, running every check: the
        ranks' reports per check, and the launcher's output (for a failure message)."""
        results: dict[str, list[dict]] = {}
        with (
            tempfile.TemporaryDirectory(prefix="shardline-executor-suite-") as reports,
            contextlib.ExitStack() as stack,
        ):
            shm = None
            if private_shm.unavailable_reason() is None:
                shm = stack.enter_context(private_shm.PrivateShm())
            run = launchers.run_launched(
                self.launcher,
                world_size,
                [
                    "-m",
                    "shardline.conformance.executors.launched",
                    self.name,
                    f"--timeout={self.timeout_s}",
                    f"--reports={reports}",
                ],
                timeout_s=120 + 30 * world_size,
                wrap=shm.wrap if shm is not None else None,
            )
            left_segments = shm.entries() if shm is not None else []
            for path in sorted(Path(reports).glob("rank-*.jsonl")):
                for line in path.read_text().splitlines():
                    report = json.loads(line)
                    results.setdefault(report["check"], []).append(report)
        if run.leftovers or left_segments:
            for report in results.get("shutdown", []):
                report |= {
                    "outcome": "failed",
                    "message": f"after the world ended: processes {run.leftovers} and "
                    f"shared-memory segments {left_segments} were left",
                }
        output = (
            f"{self.launcher} exit code {run.returncode}\n{run.stdout[-3000:]}\n"
            f"{run.stderr[-3000:]}"
        )
        return results, output

    def close(self) -> None:
        for executor in self._shared.values():
            executor.shutdown()
        self._shared.clear()


@pytest.fixture(scope="session")
def executor_conformance(request: pytest.FixtureRequest):
    state = ExecutorConformance(request.config)
    yield state
    state.close()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    report = yield
    if not _in_suite(item):
        return report
    if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
        params = item.callspec.params if hasattr(item, "callspec") else {}
        reason = case_reason(report)
        item.config.stash.setdefault(_RESULTS, []).append(
            {
                "check": params.get("check"),
                "world_size": params.get("world_size"),
                "outcome": "unsupported" if report.skipped else report.outcome,
                "reason": reason,
                "seconds": round(report.duration, 3),
            }
        )
    return report


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    results = session.config.stash.get(_RESULTS, None)
    name = session.config.getoption("--shardline-executor", None)
    if not results or not name:
        return
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in name)
    path = Path(
        session.config.getoption("--shardline-executor-report")
        or f"shardline-executor-conformance-{safe}.json"
    )
    report = {"executor": name, "summary": summary(results), "cases": results}
    write_report(path, report, session, exitstatus)
