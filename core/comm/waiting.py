"""Waiting without burning the CPU: spin briefly, then yield, then sleep with backoff, then
block.

A ready condition is seen within microseconds while the wait is short (spinning); on a machine
with more ranks than cores the yield phase lets the writer run; short sleeps cover waits of a
few milliseconds (a model step); after that a waiter with a ``block`` function sleeps in the
kernel until woken (an idle engine costs nothing), one without keeps sleeping in 2 ms steps.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from shardline.errors import CommTimeoutError

#: Checks before the first yield (the default of ``wait_until``).
SPIN_CHECKS = 200
_YIELD_UNTIL_S = 0.001
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 0.002
_IDLE_CHECK_EVERY_S = 0.05
_BLOCK_AFTER_S = 0.02
_BLOCK_AT_MOST_S = 0.2


def wait_until(
    ready: Callable[[], bool],
    deadline: float | None,
    what: str,
    on_idle: Callable[[], None] | None = None,
    block: Callable[[float], None] | None = None,
    yield_for_s: float = _YIELD_UNTIL_S,
    spin_checks: int = SPIN_CHECKS,
) -> None:
    """Return once ``ready()`` is true. ``deadline`` is a ``time.monotonic()`` value (None:
    wait forever); passing it raises CommTimeoutError naming ``what``. ``on_idle`` runs about
    every 50 ms while waiting (e.g. to check that peers are alive) and may raise.
    ``block(seconds)`` sleeps until woken or ``seconds`` pass; it is used once the wait has
    lasted 20 ms, and must re-check readiness itself before sleeping. ``yield_for_s`` is how
    long the wait keeps the CPU between checks (yielding) before it starts to sleep: longer
    where each check also moves the work forward (polling an MPI request). ``spin_checks``
    is how many checks come before the first yield: 0 where the waiters outnumber the cores,
    so a waiter never holds a core that the rank it waits for needs."""
    for _ in range(spin_checks):
        if ready():
            return
    start = time.monotonic()
    while time.monotonic() - start < yield_for_s:
        if deadline is not None and time.monotonic() >= deadline:
            raise CommTimeoutError(f"timed out waiting for {what}", op=what)
        if ready():
            return
        os.sched_yield()
    sleep = _FIRST_SLEEP_S
    last_idle_check = time.monotonic()
    while not ready():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise CommTimeoutError(f"timed out waiting for {what}", op=what)
        if on_idle is not None and now - last_idle_check >= _IDLE_CHECK_EVERY_S:
            on_idle()
            last_idle_check = now
        if block is not None and now - start >= _BLOCK_AFTER_S:
            limit = _BLOCK_AT_MOST_S if deadline is None else min(_BLOCK_AT_MOST_S, deadline - now)
            block(max(limit, 0.0))
            continue
        time.sleep(sleep)
        sleep = min(sleep * 2, _MAX_SLEEP_S)
