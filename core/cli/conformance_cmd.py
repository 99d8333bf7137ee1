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
        # The CLI has imported shardline already, so pytest cannot rewrite its asserts; the
        # suite's checks raise their own messages and do not need it.
        "-W",
        "ignore::pytest.PytestAssertRewriteWarning",
    ]
    if report:
        args.append(f"--shardline-report={report}")
    return int(pytest.main(args + extra))
