"""A deadline on each start-up phase of a rank that no driver watches.

A rank started by a launcher (torchrun, mpiexec, a Ray actor's child) that hangs before it
joins its worlds (in a plugin's ``shardline_rank_starting`` hook, say) is seen by the other
ranks, which raise at their own deadline, but nothing ends it: its launcher's agent on another
host waits for it forever. :class:`StartupGuard` ends such a process: when a phase outlives
its deadline it prints which rank and phase, dumps every thread's stack, and exits with code
1 (its launcher then ends the rest). A second timer in C (``faulthandler``) does the same
without Python's lock, should the hung code hold it.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading

#: How much later the lock-free backstop fires than the Python timer.
_BACKSTOP_S = 5.0


class StartupGuard:
    """Arm with the first phase's name; :meth:`phase` re-arms for the next one; :meth:`done`
    disarms. Each phase gets ``seconds``. Uses the process's one ``faulthandler`` timer."""

    def __init__(self, rank: int, seconds: float, first_phase: str) -> None:
        self.rank = rank
        self.seconds = seconds
        self._timer: threading.Timer | None = None
        self.phase(first_phase)

    def phase(self, name: str) -> None:
        """Start the deadline of phase ``name`` (the previous one is over)."""
        self._cancel()
        self._timer = threading.Timer(self.seconds, self._expire, (name,))
        self._timer.daemon = True
        self._timer.start()
        faulthandler.dump_traceback_later(self.seconds + _BACKSTOP_S, exit=True)

    def done(self) -> None:
        """Start-up is over: nothing fires."""
        self._cancel()

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        faulthandler.cancel_dump_traceback_later()

    def _expire(self, phase: str) -> None:
        print(
            f"error: rank {self.rank}: start-up phase {phase!r} did not end within "
            f"{self.seconds:g} s (parallel.startup_timeout_s); ending this rank. Its threads:",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)
