"""Where a step's time goes: exclusive wall time per named part, gathered while profiling and
free otherwise.

Code marks its parts with ``with timer("part"):``; the default timer (:data:`NO_TIMER`) does
nothing. A :class:`SpanTimer` keeps, for each part, the time spent inside it minus the time
spent in parts nested in it, so the parts of one step add up to the step. Inside a torch
model, :func:`time_modules` makes every module a part (named by its class's
``profile_part``, else "other per-layer ops"), and :class:`TimedCommunicator` makes each
communication operation one ("comm all_reduce", ...).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from shardline.comm.delegating import DelegatingCommunicator
from shardline.interfaces import Communicator, ReduceOp, Work

if TYPE_CHECKING:  # annotations only: the part names and timers import no torch
    import torch
    from torch import nn

#: The parts layers name (their class's ``profile_part``): multiplying by weights,
#: attention over the cache, looking up embeddings; and the part of a module naming none.
MATMUL = "matmul (weights)"
ATTENTION = "attention"
EMBEDDING_LOOKUP = "embedding lookup"
OTHER_LAYER_OPS = "other per-layer ops"
#: The part of all-reduces (:class:`TimedCommunicator`'s, and those made inside C calls).
COMM_ALL_REDUCE = "comm all_reduce"


class StepTimer:
    """Marks parts of a step; this base does nothing (``timer(part)`` is an empty context)."""

    def __call__(self, part: str) -> contextlib.AbstractContextManager:
        return _NOTHING

    @property
    def active(self) -> bool:
        return False

    def record(self, part: str, seconds: float) -> None:
        """Count ``seconds`` spent in ``part``, timed elsewhere (inside a C call), as a part
        nested in the innermost open one."""


_NOTHING = contextlib.nullcontext()
#: The timer of code that is not being profiled.
NO_TIMER = StepTimer()


class SpanTimer(StepTimer):
    """Exclusive seconds and entries per part. Single-threaded: parts nest as calls do."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.entries: dict[str, int] = {}
        self._open: list[list[Any]] = []  # [part, start, seconds in nested parts]

    @property
    def active(self) -> bool:
        return True

    def __call__(self, part: str) -> contextlib.AbstractContextManager:
        return self._span(part)

    @contextlib.contextmanager
    def _span(self, part: str) -> Iterator[None]:
        self.enter(part)
        try:
            yield
        finally:
            self.exit()

    def enter(self, part: str) -> None:
        self._open.append([part, time.perf_counter(), 0.0])

    def exit(self) -> None:
        part, start, nested = self._open.pop()
        spent = time.perf_counter() - start
        self.seconds[part] = self.seconds.get(part, 0.0) + spent - nested
        self.entries[part] = self.entries.get(part, 0) + 1
        if self._open:
            self._open[-1][2] += spent

    def record(self, part: str, seconds: float) -> None:
        self.seconds[part] = self.seconds.get(part, 0.0) + seconds
        self.entries[part] = self.entries.get(part, 0) + 1
        if self._open:
            self._open[-1][2] += seconds

    def report(self) -> dict[str, dict[str, float]]:
        """Part -> {"seconds": exclusive total, "entries": how often it was entered}."""
        return {
            part: {"seconds": seconds, "entries": self.entries[part]}
            for part, seconds in self.seconds.items()
        }


def time_modules(model: nn.Module, timer: SpanTimer) -> Callable[[], None]:
    """Make each module of ``model`` (itself included) a part of ``timer``, named by its
    class's ``profile_part`` attribute or :data:`OTHER_LAYER_OPS`; returns the function that
    removes the hooks again."""
    handles = []
    for module in model.modules():
        part = getattr(type(module), "profile_part", OTHER_LAYER_OPS)
        handles.append(module.register_forward_pre_hook(_enter_hook(timer, part)))
        handles.append(module.register_forward_hook(_exit_hook(timer)))

    def remove() -> None:
        for handle in handles:
            handle.remove()

    return remove


def _enter_hook(timer: SpanTimer, part: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        timer.enter(part)

    return hook


def _exit_hook(timer: SpanTimer) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any, output: Any) -> None:
        timer.exit()

    return hook


class TimedCommunicator(DelegatingCommunicator):
    """``inner`` with every data operation a part of ``timer`` ("comm <operation>")."""

    def __init__(self, inner: Communicator, timer: SpanTimer) -> None:
        super().__init__(inner)
        self.timer = timer

    def wrap_group(self, group: Communicator, ranks: list[int]) -> Communicator:
        return TimedCommunicator(group, self.timer)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        with self.timer(COMM_ALL_REDUCE):
            return self.inner.all_reduce(tensor, op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        with self.timer("comm all_gather"):
            return self.inner.all_gather(tensor, dim)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        with self.timer("comm reduce_scatter"):
            return self.inner.reduce_scatter(tensor, dim, op)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = 0) -> torch.Tensor | None:
        with self.timer("comm gather"):
            return self.inner.gather(tensor, dst, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        with self.timer("comm broadcast"):
            return self.inner.broadcast(tensor, src)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        with self.timer("comm send"):
            self.inner.send(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        with self.timer("comm recv"):
            return self.inner.recv(tensor, src)

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        with self.timer("comm isend"):
            return self.inner.isend(tensor, dst)

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        with self.timer("comm irecv"):
            return self.inner.irecv(tensor, src)
