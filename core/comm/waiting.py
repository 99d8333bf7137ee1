"""Waiting without burning the CPU: spin briefly, then yield, then sleep with backoff, then
block.

A ready condition is seen within microseconds while the wait is short (spinning); on a machine
with more ranks than cores the yield phase lets the writer run; short sleeps cover waits of a
few milliseconds (a model step); after that a waiter with a ``block`` function sleeps in the
kernel until woken (an idle engine costs nothing), one without keeps sleeping in 2 ms steps.
:class:`Polling` says how the first two phases use the CPU, from how many ranks share the
host's cores.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardline.errors import CommTimeoutError

_SPIN_CHECKS = 200
_YIELD_UNTIL_S = 0.001
_FIRST_SLEEP_S = 20e-6
_MAX_SLEEP_S = 0.002
_IDLE_CHECK_EVERY_S = 0.05
_BLOCK_AFTER_S = 0.02
_BLOCK_AT_MOST_S = 0.2


def host_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class Polling:
    """How a wait uses the CPU: ``spin_checks`` checks in a row, then checks until
    ``yield_for_s`` (of :func:`wait_until`) has passed, yielding the CPU between them when
    ``share_cpu``, then sleeps between checks, ``first_sleep_s`` at first, doubling up to
    ``max_sleep_s`` (waits written in C take them from here too)."""

    spin_checks: int = _SPIN_CHECKS
    share_cpu: bool = True
    first_sleep_s: float = _FIRST_SLEEP_S
    max_sleep_s: float = _MAX_SLEEP_S

    @classmethod
    def for_ranks_on_host(cls, ranks: int, only_thread: bool = False) -> Polling:
        """More ranks than cores: yield at once, so a waiter never holds a core that the rank
        it waits for needs. A core each: spin first, then yield between checks, so this
        process's other threads (a gloo base's I/O thread, which the peers may be waiting
        on) can run; with ``only_thread`` (nothing else in the process moves the work: MPI,
        whose operations advance only when polled) keep the core instead, so a busy
        neighbour process cannot take it for a time slice in the middle of a transfer."""
        if ranks > host_cores():
            return cls(spin_checks=0, share_cpu=True)
        return cls(spin_checks=_SPIN_CHECKS, share_cpu=not only_thread)


def wait_until(
    ready: Callable[[], bool],
    deadline: float | None,
    what: str,
    on_idle: Callable[[], None] | None = None,
    block: Callable[[float], None] | None = None,
    yield_for_s: float = _YIELD_UNTIL_S,
    polling: Polling = Polling(),
    block_after_s: float = _BLOCK_AFTER_S,
) -> None:
    """Return once ``ready()`` is true. ``deadline`` is a ``time.monotonic()`` value (None:
    wait forever); passing it raises CommTimeoutError naming ``what``. ``on_idle`` runs about
    every 50 ms while waiting (e.g. to check that peers are alive) and may raise.
    ``block(seconds)`` sleeps until woken or ``seconds`` pass; it is used once the wait has
    lasted ``block_after_s`` (20 ms), and must re-check readiness itself before sleeping; with
    ``on_idle`` it sleeps at most until ``on_idle`` is due. ``yield_for_s`` is how
    long the wait keeps the CPU between checks (yielding) before it starts to sleep: longer
    where each check also moves the work forward (polling an MPI request). ``polling`` says
    whether the CPU is yielded between checks (see :class:`Polling`)."""
    for _ in range(polling.spin_checks):
        if ready():
            return
    start = time.monotonic()
    while time.monotonic() - start < yield_for_s:
        if deadline is not None and time.monotonic() >= deadline:
            raise CommTimeoutError(f"timed out waiting for {what}", op=what)
        if ready():
            return
        if polling.share_cpu:
            os.sched_yield()
    sleep = polling.first_sleep_s
    last_idle_check = time.monotonic()
    while not ready():
        now = time.monotonic()
        if deadline is not None and now >= deadline:
            raise CommTimeoutError(f"timed out waiting for {what}", op=what)
        if on_idle is not None and now - last_idle_check >= _IDLE_CHECK_EVERY_S:
            on_idle()
            last_idle_check = now
        if block is not None and now - start >= block_after_s:
            limit = _BLOCK_AT_MOST_S if deadline is None else min(_BLOCK_AT_MOST_S, deadline - now)
            if on_idle is not None:
                limit = min(limit, last_idle_check + _IDLE_CHECK_EVERY_S - now)
            block(max(limit, 0.0))
            continue
        time.sleep(sleep)
        sleep = min(sleep * 2, polling.max_sleep_s)
