"""What both conformance suites' JSON reports share: why a case did not pass, and the summary."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

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


def write_report(path: Path, report: dict, session: pytest.Session, exitstatus: int) -> None:
    """Write ``report`` to ``path`` as JSON, with ``complete``: false when the run stopped
    early (interrupted: Ctrl-C, SIGTERM, ``-x``) or some case has no result, so that a
    partial report never reads as a pass; ``collected`` and ``ran`` say how far it got.
    Written whole or not at all."""
    ran = len(report["cases"])
    collected = session.testscollected
    stopped = exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop
    report = {
        **report,
        "complete": not stopped and ran == collected,
        "collected": collected,
        "ran": ran,
    }
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        partial.write_text(json.dumps(report, indent=1, default=str))
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)
