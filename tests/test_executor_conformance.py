"""The executor suite run on every registered executor (third-party ones included), on
external_launcher under both launchers, and on a careless executor it must fail."""

import importlib.util
import json

import pytest

from shardline.conformance.executors.checks import CHECKS
from shardline.registry import Registry
from support.cli import ROOT, shardline

SUITE_TIMEOUT = 600
#: The ray executor must pass every check where ray is installed (the test extra brings it).
WITH_RAY = ("ray",) if importlib.util.find_spec("ray") is not None else ()
#: Checks that do not apply to a built-in executor, and the words of the reason.
NOT_APPLICABLE = {
    "uni": {
        "call deadline": "caller's thread",
        "death detection": "does not own",
        "concurrent start": "after another",
    },
    "external_launcher": {"death detection": "does not own", "concurrent start": "after another"},
    "ray": {"concurrent start": "after another"},
}


def _run_suite(tmp_path, name, *options, env=None):
    report_path = tmp_path / "report.json"
    result = shardline(
        "conformance",
        name,
        "--report",
        str(report_path),
        *options,
        env=env,
        timeout=SUITE_TIMEOUT,
    )
    return result, json.loads(report_path.read_text())


@pytest.mark.timeout(SUITE_TIMEOUT + 60)
@pytest.mark.parametrize("name", [c.name for c in Registry.load().components("executor")])
def test_every_registered_executor_keeps_the_contract(tmp_path, name):
    result, report = _run_suite(tmp_path, name)
    assert result.returncode == 0, result.stdout[-3000:]
    assert report["executor"] == name and report["summary"].get("failed", 0) == 0
    cases = {(case["check"], case["world_size"]): case for case in report["cases"]}
    assert {check for check, _ in cases} == set(CHECKS)
    assert {size for _, size in cases} == {1, 2, 4}
    for (check, size), case in cases.items():
        expected_skip = NOT_APPLICABLE.get(name, {}).get(check)
        if name == "uni" and size > 1:
            expected_skip = "at most 1 rank"
        if expected_skip is None and name in ("uni", "mp", "external_launcher", *WITH_RAY):
            assert case["outcome"] == "passed", case
        elif case["outcome"] == "unsupported":
            assert expected_skip is None or expected_skip in case["reason"], case


@pytest.mark.timeout(SUITE_TIMEOUT + 60)
def test_external_launcher_keeps_the_contract_under_mpiexec(tmp_path):
    result, report = _run_suite(
        tmp_path, "external_launcher", "--launcher", "mpiexec", "--world-sizes", "2"
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert report["summary"] == {"passed": len(CHECKS) - 2, "unsupported": 2}


def test_suite_fails_a_careless_executor(tmp_path):
    result, report = _run_suite(
        tmp_path,
        "broken_executor:CarelessExecutor",
        "--world-sizes",
        "1",
        env={"PYTHONPATH": str(ROOT / "tests" / "support")},
    )
    assert result.returncode == 1, result.stdout[-3000:]
    outcomes = {case["check"]: case["outcome"] for case in report["cases"]}
    assert outcomes == {
        "rank assignment": "passed",
        "reply rank": "failed",
        "broadcast order": "failed",
        "exception envelope": "failed",
        "call deadline": "unsupported",
        "death detection": "unsupported",
        "shutdown": "failed",
        "concurrent start": "unsupported",
    }
