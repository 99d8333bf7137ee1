"""What both conformance suites' JSON reports share: why a case did not pass, and the summary."""

from __future__ import annotations

from collections import Counter

import pytest

from shardline.errors import cut

#: The longest failure message a case keeps in the report (a rank's traceback can be long).
MAX_FAILURE_CHARS = 2000


def case_reason(report: pytest.TestReport) -> str:
    """Why a case did not pass: the reason a skipped test gave, the failure message of a
    failed one (cut to :data:`MAX_FAILURE_CHARS` characters), empty for a passed one."""
    if report.skipped:
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        return reason.removeprefix("Skipped: ")
    if report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else report.longreprtext
        return cut(message.removeprefix("Failed: "), MAX_FAILURE_CHARS)
    return ""


def summary(cases: list[dict]) -> dict[str, int]:
    """How many cases had each outcome."""
    return dict(Counter(case["outcome"] for case in cases))
