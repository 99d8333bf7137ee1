"""What the executor suite runs on the ranks: a model runner without a model, and callables
sent through ``collective_rpc`` (module level, so they pickle by name as well as by value)."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import torch

from shardline.interfaces import IntermediateTensors, ModelRunner

#: ``model.runner`` value that selects :class:`ProbeModelRunner`.
PROBE_RUNNER = "shardline.conformance.executors.probe:ProbeModelRunner"


class ProbeModelRunner(ModelRunner):
    """Loads nothing; a step makes each pipeline stage append its rank to the tensor it hands
    on, so the output rank returns the ranks the step went through, in order."""

    def __init__(self, config: Any, state: Any) -> None:
        self.state = state
        self.journal: list[Any] = []

    def load_model(self) -> None:
        """Nothing to load."""

    def execute_model(
        self, scheduler_output: Any, intermediate_tensors: IntermediateTensors | None
    ) -> Any:
        if scheduler_output.total_num_scheduled_tokens == 0:
            return None
        visited = [] if intermediate_tensors is None else intermediate_tensors["ranks"].tolist()
        visited.append(self.state.rank)
        if not self.state.pp.is_last_rank:
            return IntermediateTensors({"ranks": torch.tensor(visited)})
        return {"visited": visited, "rank": self.state.rank}


def rank_and_pid(worker) -> tuple[int, int]:
    return worker.rank, os.getpid()


def echo(worker, value: Any) -> Any:
    return value


def record(worker, value: Any) -> Any:
    """Append ``value`` to the rank's journal and return it."""
    worker.model_runner.journal.append(value)
    return value


def take_journal(worker) -> list[Any]:
    """The rank's journal, emptied."""
    journal, worker.model_runner.journal = worker.model_runner.journal, []
    return journal


def raise_on_rank(worker, rank: int) -> int:
    if worker.rank == rank:
        raise KeyError(f"planted failure on rank {rank}")
    return worker.rank


def raise_everywhere(worker) -> None:
    raise RuntimeError(f"planted failure on every rank ({worker.rank})")


def sleep_on_rank(worker, rank: int, seconds: float) -> int:
    if worker.rank == rank:
        time.sleep(seconds)
    return worker.rank


def unpicklable_result(worker) -> threading.Lock:
    """A result pickle refuses."""
    return threading.Lock()


def result_only_the_rank_loads(worker) -> LoadsOnlyWhereMade:
    """A result that unpickles only in the rank's process."""
    return LoadsOnlyWhereMade()


class LoadsOnlyWhereMade:
    """An object that unpickles only in the process that made it (as, elsewhere, an object
    of a class defined in the driver's own script, or one only a rank's host has)."""

    def __init__(self) -> None:
        self.pid = os.getpid()

    def __reduce__(self) -> tuple:
        return (_made_in, (self.pid,))


def _made_in(pid: int) -> LoadsOnlyWhereMade:
    if os.getpid() != pid:
        raise LookupError(f"this argument loads only in the process that made it ({pid})")
    return LoadsOnlyWhereMade()
