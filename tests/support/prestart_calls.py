"""An executor ``prestart`` hook that records its calls (tests/test_engine.py)."""

from typing import Any

#: The configs the hook was called with, in order.
CALLS: list[Any] = []


def record(config: Any) -> None:
    CALLS.append(config)
