"""An executor ``prestart`` hook that records its calls and the undoing of its head start
(tests/test_engine.py)."""

from collections.abc import Callable
from typing import Any

#: The configs the hook was called with, in order.
CALLS: list[Any] = []
#: The configs whose head start was undone, in order.
UNDONE: list[Any] = []


def record(config: Any) -> Callable[[], None]:
    CALLS.append(config)
    return lambda: UNDONE.append(config)
