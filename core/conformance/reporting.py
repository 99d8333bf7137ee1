"""What both conformance suites' JSON reports share: a case's skip reason and the summary."""

from __future__ import annotations

from collections import Counter

import pytest


def skip_reason(report: pytest.TestReport) -> str:
    """The reason a skipped test gave (empty for a test that was not skipped)."""
    if not report.skipped:
        return ""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return reason.removeprefix("Skipped: ")


def summary(cases: list[dict]) -> dict[str, int]:
    """How many cases had each outcome."""
    return dict(Counter(case["outcome"] for case in cases))
