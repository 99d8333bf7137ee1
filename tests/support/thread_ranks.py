"""Ranks of a real world as threads of the test's process."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any


def run_thread_ranks(
    world_size: int, open_rank: Callable[[int], Any], body: Callable[[Any], Any]
) -> dict[int, Any]:
    """``body(comm)`` on every rank, each a thread with the communicator ``open_rank(rank)``
    makes; each rank's result or error (``open_rank``'s own, where it raised). A rank closes
    its communicator only once every rank is done: one that closed first would end the
    others' waits with "a peer went away" before their own deadlines. Fails the test when a
    rank is still running after 30 s."""
    results: dict[int, Any] = {}
    all_done = threading.Barrier(world_size)

    def rank_main(rank: int) -> None:
        try:
            comm = open_rank(rank)
        except Exception as error:  # the result is the error; the others need not wait
            results[rank] = error
            all_done.abort()
            return
        try:
            results[rank] = body(comm)
        except Exception as error:
            results[rank] = error
        finally:
            with contextlib.suppress(threading.BrokenBarrierError):
                all_done.wait(timeout=20)
            comm.close()

    threads = [
        threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(world_size)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results
