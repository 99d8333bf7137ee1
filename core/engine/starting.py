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
    (daemons: an interpreter that exits does not wait for them). As soon as one raises, or
    this thread is interrupted (KeyboardInterrupt), that error is raised without waiting for
    the starts still running: those that ended are stopped here, and each still running stops
    its value itself once it returns (its own deadline bounds that). Where none raises, the
    values in order."""
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
    ended = threading.Condition()
    failures: list[BaseException] = []
    abandoned = False

    def run(index: int) -> None:
        try:
            outcome = _Outcome(value=start(index))
        except BaseException as error:
            outcome = _Outcome(error=error)
        with ended:
            keep = not abandoned
            outcomes[index] = outcome
            if outcome.error is not None:
                failures.append(outcome.error)
            ended.notify()
        if not keep and outcome.error is None:
            stop(outcome.value)

    def settled() -> bool:
        return bool(failures) or all(outcome is not None for outcome in outcomes)

    try:
        for index in range(count):
            name = f"shardline-start-{index}"
            threading.Thread(target=run, args=(index,), name=name, daemon=True).start()
        with ended:
            ended.wait_for(settled)
            if not failures:
                return [outcome.value for outcome in outcomes]  # type: ignore[union-attr]
            abandoned = True
            finished = [outcome for outcome in outcomes if outcome is not None]
    except BaseException:
        with ended:
            abandoned = True
            finished = [outcome for outcome in outcomes if outcome is not None]
        _stop_started(finished, stop)
        raise
    _stop_started(finished, stop)
    raise failures[0]


def _stop_started(outcomes: list[_Outcome[Started]], stop: Callable[[Started], None]) -> None:
    for outcome in outcomes:
        if outcome.error is None:
            stop(outcome.value)
