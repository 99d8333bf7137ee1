"""The conformance suite itself: on gloo (world sizes 1-4), on the example third-party plugin
installed from its own package, and on a broken backend it must fail."""

import json
import subprocess
import sys

import pytest

from support.cli import ROOT, shardline

SUITE_TIMEOUT = 900


def _report(path):
    return json.loads(path.read_text())


@pytest.mark.timeout(SUITE_TIMEOUT + 60)
def test_gloo_passes_the_whole_suite(tmp_path):
    report_path = tmp_path / "gloo.json"
    result = shardline("conformance", "gloo", "--report", str(report_path), timeout=SUITE_TIMEOUT)
    assert result.returncode == 0, result.stdout[-3000:]
    report = _report(report_path)
    assert report["summary"].get("failed", 0) == 0
    assert report["summary"]["passed"] > 1000
    sizes = {case["world_size"] for case in report["cases"]}
    assert sizes == {1, 2, 3, 4}
    assert report["matrix"]["all_reduce[sum]"]["bfloat16"] == {
        "1": "passed",
        "2": "passed",
        "3": "passed",
        "4": "passed",
    }
    operations = set(report["matrix"])
    for expected in (
        "gather",
        "broadcast",
        "send/recv",
        "isend/irecv",
        "p2p order",
        "barrier",
        "objects",
        "tensor_dict",
        "tensor_dict async",
        "unsigned objects",
        "subgroups tp2 x pp2",
        "deadline: rank never joins",
    ):
        assert expected in operations


@pytest.mark.timeout(SUITE_TIMEOUT + 180)
def test_third_party_plugin_installs_and_passes(tmp_path):
    target = tmp_path / "site"
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            str(ROOT / "examples" / "storecomm"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert install.returncode == 0, install.stderr
    env = {"PYTHONPATH": str(target)}
    listed = shardline("plugins", env=env)
    assert "communicator storecomm" in listed.stdout
    report_path = tmp_path / "storecomm.json"
    # Every check, at an even and an odd world size (gloo, mpi and custom_ar run all of 1-4;
    # the smallest pair keeps this run short on 2 cores).
    result = shardline(
        "conformance",
        "storecomm",
        "--world-sizes",
        "2,3",
        "--report",
        str(report_path),
        env=env,
        timeout=SUITE_TIMEOUT,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    report = _report(report_path)
    assert report["communicator"] == "storecomm"
    assert report["summary"].get("failed", 0) == 0 and report["summary"]["passed"] > 500
    # Checks that need another world size (subgroups tp2 x pp2: 4) are reported with a reason.
    assert {case["world_size"] for case in report["cases"]} - {None} == {2, 3}
    hidden = shardline("conformance", "storecomm", env={**env, "SHARDLINE_PLUGINS": "gloo"})
    assert hidden.returncode != 0
    assert "is no installed communicator or executor" in hidden.stderr


def test_suite_fails_a_wrong_backend_and_skips_by_capability(tmp_path):
    report_path = tmp_path / "broken.json"
    result = shardline(
        "conformance",
        "broken_comm:BrokenGlooBackend",
        "--world-sizes",
        "2",
        "--report",
        str(report_path),
        "--",
        "-k",
        "test_all_reduce and (odd or empty)",
        env={"PYTHONPATH": str(ROOT / "tests" / "support")},
        timeout=300,
    )
    assert result.returncode == 1, result.stdout[-3000:]
    matrix = _report(report_path)["matrix"]
    assert matrix["all_reduce[sum]"]["float32"]["2"] == "failed"
    assert matrix["all_reduce[sum]"]["bfloat16"]["2"].startswith(
        "unsupported(unsupported: dtype bfloat16 not supported"
    )
    assert matrix["all_reduce[max]"]["float32"]["2"].startswith(
        "unsupported(unsupported: reduce op max not supported"
    )


def test_suite_without_a_communicator_is_a_usage_error():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "--pyargs",
            "shardline.conformance",
            "-q",
            "-p",
            "no:cacheprovider",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 4
    assert "needs --shardline-communicator=NAME" in result.stderr
