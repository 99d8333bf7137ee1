"""Starting the executors of an engine's data-parallel replicas: one after another, or all at
once where the executor allows it (``Executor.starts_concurrently``), so that the replicas'
ranks load the model together instead of in turn."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

Started = TypeVar("Started")


@dataclass
class _Outcome(Generic[Started]):
    """What one start gave: its value, or the error it raised."""

    value: Started | None = None
    error: BaseException | None = None


def start_all(
    start: Callable[[int], Started],
    count: int,
    concurrently: bool,
    stop: Callable[[Started], None],
) -> list[Started]:
    """``[start(0), ..., start(count - 1)]``. One after another: where one raises, those
    started are stopped (``stop``), the later ones never start, and the error is raised.
    With ``concurrently``: every ``start(i)`` runs at once, each in a thread of its own
    (daemons: an interpreter that exits does not wait for them); once all have returned,
    where any raised, those started are stopped and the first error in index order is
    raised. Where this thread is interrupted meanwhile (KeyboardInterrupt), those started are
    stopped and the interrupt raised at once; one still starting stops itself once started."""
    if not concurrently or count == 1:
        started: list[Started] = []
        try:
            for index in range(count):
                started.append(start(index))
        except BaseException:
            for value in started:
                stop(value)
            raise
        return started
    outcomes: list[_Outcome[Started] | None] = [None] * count
    lock = threading.Lock()
    abandoned = False

    def run(index: int) -> None:
        try:
            outcome = _Outcome(value=start(index))
        except BaseException as error:
            outcome = _Outcome(error=error)
        with lock:
            keep = not abandoned
            outcomes[index] = outcome
        if not keep and outcome.error is None:
            stop(outcome.value)

    threads = [
        threading.Thread(target=run, args=(index,), name=f"shardline-start-{index}", daemon=True)
        for index in range(count)
    ]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    except BaseException:
        with lock:
            abandoned = True
            finished = [outcome for outcome in outcomes if outcome is not None]
        _stop_started(finished, stop)
        raise
    finished = [outcome for outcome in outcomes if outcome is not None]
    errors = [outcome.error for outcome in finished if outcome.error is not None]
    if errors:
        _stop_started(finished, stop)
        raise errors[0]
    return [outcome.value for outcome in finished]


def _stop_started(outcomes: list[_Outcome[Started]], stop: Callable[[Started], None]) -> None:
    for outcome in outcomes:
        if outcome.error is None:
            stop(outcome.value)
