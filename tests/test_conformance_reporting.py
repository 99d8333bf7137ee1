"""The conformance reports' per-case reason: skips say why, failures keep their message."""

import pytest

from shardline.conformance.reporting import MAX_FAILURE_CHARS, case_reason


def _report(outcome: str, longrepr) -> pytest.TestReport:
    return pytest.TestReport(
        "suite.py::case", ("suite.py", 1, "case"), {}, outcome, longrepr, "call"
    )


def _failure(error: BaseException):
    try:
        raise error
    except BaseException:
        return pytest.ExceptionInfo.from_current().getrepr()


def test_a_skipped_case_keeps_its_reason():
    skipped = _report("skipped", ("suite.py", 3, "Skipped: unsupported: no bfloat16"))
    assert case_reason(skipped) == "unsupported: no bfloat16"


def test_a_failed_case_keeps_its_message():
    failed = _report("failed", _failure(AssertionError("rank 1 got 3.0, expected 4.0")))
    assert case_reason(failed) == "AssertionError: rank 1 got 3.0, expected 4.0"


def test_a_failure_raised_by_pytest_fail_keeps_the_message_alone():
    with pytest.raises(pytest.fail.Exception) as raised:
        pytest.fail("2 of 4 ranks reported check 'barrier'", pytrace=False)
    failed = _report("failed", _failure(raised.value))
    assert case_reason(failed) == "2 of 4 ranks reported check 'barrier'"


def test_a_long_failure_message_is_cut():
    failed = _report("failed", _failure(RuntimeError("x" * 10_000)))
    reason = case_reason(failed)
    assert reason.startswith("RuntimeError: xxx")
    assert reason.endswith("... (10014 characters)")
    assert len(reason) < MAX_FAILURE_CHARS + 40


def test_a_passed_case_has_no_reason():
    assert case_reason(_report("passed", None)) == ""
