"""``shardline conformance NAME``: the pytest-based suite on one communicator."""

from __future__ import annotations

import pytest


def run(name: str, world_sizes: str, timeout_s: float, report: str | None, extra: list[str]) -> int:
    args = [
        "--pyargs",
        "shardline.conformance",
        f"--shardline-communicator={name}",
        f"--shardline-world-sizes={world_sizes}",
        f"--shardline-timeout={timeout_s}",
        "-p",
        "no:cacheprovider",
        "-q",
    ]
    if report:
        args.append(f"--shardline-report={report}")
    return int(pytest.main(args + extra))
