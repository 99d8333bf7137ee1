"""Heartbeats of the mp workers: one word per rank in a small shared segment, where a thread of
each worker writes the time (CLOCK_MONOTONIC, the same in every process of the host) every
:data:`BEAT_S`. A worker whose word stops moving has stopped running as a whole (SIGSTOP, a
frozen host): the driver names it when a call passes its deadline, instead of blaming the
rank it happened to wait on (which is itself waiting on the stopped one).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from multiprocessing import shared_memory

#: How often a worker beats.
BEAT_S = 0.1
_STRIDE = 8  # words per rank: one cache line each, so writers never share a line


class Heartbeats:
    """The driver's side: creates the segment (named by the job) and reads the beats."""

    def __init__(self, name: str, ranks: int) -> None:
        self._segment = shared_memory.SharedMemory(name=name, create=True, size=ranks * 64)
        self._words = self._segment.buf.cast("q")
        self.name = name
        self.ranks = ranks

    def silent_for(self, rank: int) -> float | None:
        """Seconds since ``rank`` last beat; None before its first beat."""
        beat = self._words[rank * _STRIDE]
        return None if beat == 0 else time.monotonic() - beat / 1e9

    def unlink(self) -> None:
        """Remove the segment's name now (once every worker has mapped it); it stays mapped.
        Idempotent."""
        with contextlib.suppress(FileNotFoundError):  # unlinked already
            self._segment.unlink()

    def close(self) -> None:
        if self._segment is None:
            return
        self._words.release()
        self._segment.close()
        self.unlink()
        self._segment = None


def start_beating(name: str, rank: int) -> None:
    """In a worker: a daemon thread that writes this rank's beat until the process ends
    (the segment is mapped directly, without the resource tracker)."""
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        words = memoryview(mmap.mmap(fd, 0)).cast("q")
    finally:
        os.close(fd)

    def beat() -> None:
        while True:
            words[rank * _STRIDE] = time.monotonic_ns()
            time.sleep(BEAT_S)

    threading.Thread(target=beat, name="shardline-heartbeat", daemon=True).start()
