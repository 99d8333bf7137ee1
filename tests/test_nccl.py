"""The NCCL communicator where this machine cannot run it: registered, unavailable with the
reason, the conformance suite skipping every check with that reason, and config validation
refusing it with the reason. (On a GPU host: ``python benchmarks/nccl_check.py``.)"""

import json

import pytest
import torch

from shardline.registry import Registry
from support.cli import shardline

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="this host has CUDA: run benchmarks/nccl_check.py instead"
)


def test_nccl_is_registered_and_says_why_it_is_unavailable():
    reason = Registry.load().get("communicator", "nccl").unavailable_reason()
    assert reason is not None and ("NCCL" in reason or "CUDA" in reason)


def test_the_suite_skips_nccl_with_the_reason(tmp_path):
    report_path = tmp_path / "nccl.json"
    result = shardline("conformance", "nccl", "--report", str(report_path), timeout=300)
    assert result.returncode == 0, result.stdout[-2000:]
    report = json.loads(report_path.read_text())
    assert set(report["summary"]) == {"unsupported"}
    reason = Registry.load().get("communicator", "nccl").unavailable_reason()
    assert all(reason in case["reason"] for case in report["cases"])


def test_config_validation_refuses_nccl_with_the_reason():
    result = shardline(
        "config",
        "validate",
        "--set",
        "parallel.communicator=nccl",
        "--set",
        "parallel.tensor_parallel_size=2",
    )
    assert result.returncode == 2
    assert "parallel.communicator = 'nccl'" in result.stderr and "unavailable" in result.stderr
