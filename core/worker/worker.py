"""The Worker: one per rank. Owns the rank's ParallelState and handles the pipeline boundary
around the ModelRunner (reference: seed 000, ``GPUWorker.execute_model``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardline.distributed import ParallelState
from shardline.interfaces import IntermediateTensors, ModelRunner, Work
from shardline.profiling import (
    EMBEDDING_LOOKUP,
    MATMUL,
    NO_TIMER,
    SpanTimer,
    StepTimer,
    TimedCommunicator,
    time_modules,
)

#: What a rank reads to measure its memory bandwidth (far past any cache).
BANDWIDTH_PROBE_BYTES = 256 << 20


class AsyncIntermediateTensors(IntermediateTensors):
    """Intermediate tensors still arriving from the previous stage: the receive (and its TP
    all-gather) completes the first time the model touches them."""

    def __init__(self, receive: Work, timer: StepTimer) -> None:
        self._receive = receive
        self._timer = timer

    @property
    def tensors(self) -> dict:
        with self._timer("comm wait for the previous stage"):
            return self._receive.wait()


class Worker:
    """Runs ``execute_model`` steps for one rank; only the output rank returns results."""

    def __init__(
        self, state: ParallelState, model_runner: ModelRunner, tp_assisted_transfer: bool = True
    ) -> None:
        self.state = state
        self.model_runner = model_runner
        self.tp_assisted_transfer = tp_assisted_transfer
        self._pp_send_work: Work | None = None
        #: Marks the parts of a step while profiling (:meth:`start_profile`).
        self.timer: StepTimer = NO_TIMER
        self._stop_profiling: list[Callable[[], None]] = []

    @property
    def rank(self) -> int:
        return self.state.rank

    def load_model(self) -> None:
        self.model_runner.load_model()

    def execute_model(self, scheduler_output: Any) -> Any:
        """One step, as the reference design orders it:

        1. wait for last step's pipeline sends, then forget them;
        2. a step with no tokens does no forward pass and no pipeline traffic;
        3. a rank that is not in the first stage starts receiving the previous stage's
           intermediate tensors; the wait happens when the model first touches them;
        4. run the ModelRunner;
        5. intermediate tensors are sent on asynchronously (handles kept for step 1; sent
           before returning where the communicator does not progress alone) and None is
           returned; otherwise only the output rank returns the output.
        """
        with self.timer("rank step, rest"):
            return self._execute_model(scheduler_output)

    def _execute_model(self, scheduler_output: Any) -> Any:
        pp = self.state.pp
        if self._pp_send_work is not None:
            self._pp_send_work.wait()
        self._pp_send_work = None
        forward_pass = scheduler_output.total_num_scheduled_tokens > 0
        gather_group = self.state.tp if self.tp_assisted_transfer else None
        intermediate = None
        if forward_pass and not pp.is_first_rank:
            # The tensors' metadata comes now: it leaves with the previous stage's send.
            with self.timer("comm wait for the previous stage"):
                receive = pp.irecv_tensor_dict(all_gather_group=gather_group)
            intermediate = AsyncIntermediateTensors(receive, self.timer)
        output = self.model_runner.execute_model(scheduler_output, intermediate)
        if isinstance(output, IntermediateTensors):
            if pp.is_last_rank:
                raise RuntimeError("the last pipeline stage returned intermediate tensors")
            self._pp_send_work = pp.isend_tensor_dict(output.tensors, all_gather_group=gather_group)
            if not pp.data.capabilities.progresses_alone:
                # Nobody would move the send on while this rank waits for its next step,
                # and the next stage would wait for it forever.
                self._pp_send_work.wait()
                self._pp_send_work = None
            return None
        return output if self.state.is_output_rank else None

    # ---- profiling (bench decode --profile) -------------------------------------------------

    def start_profile(self) -> None:
        """Time this rank's steps part by part until :meth:`stop_profile`: the runner's own
        parts (its ``timer``), every module of its torch ``model`` (by ``profile_part``) and
        each operation of the TP and PP groups' data communicators."""
        if self.timer.active:
            raise RuntimeError("start_profile: this rank is already being profiled")
        timer = SpanTimer()
        runner = self.model_runner
        if hasattr(runner, "timer"):
            runner.timer = timer
            self._stop_profiling.append(lambda: setattr(runner, "timer", NO_TIMER))
        model = getattr(runner, "model", None)
        if isinstance(model, nn.Module):
            self._stop_profiling.append(time_modules(model, timer))
            if hasattr(model, "timer"):  # parts timed inside its fused kernel calls
                model.timer = timer
                self._stop_profiling.append(lambda: setattr(model, "timer", NO_TIMER))
        for group in {id(g): g for g in (self.state.tp, self.state.pp)}.values():
            untimed = group.data
            group.data = TimedCommunicator(untimed, timer)
            self._stop_profiling.append(
                lambda group=group, untimed=untimed: setattr(group, "data", untimed)
            )
        self.timer = timer

    def stop_profile(self) -> dict[str, dict[str, float]]:
        """End profiling; the parts' exclusive seconds and entries since :meth:`start_profile`
        (``SpanTimer.report``)."""
        timer, self.timer = self.timer, NO_TIMER
        while self._stop_profiling:
            self._stop_profiling.pop()()
        return timer.report() if isinstance(timer, SpanTimer) else {}

    def weight_bytes_per_step(self) -> int:
        """Bytes of weights a greedy decode step reads on this rank: every parameter of the
        runner's model once (a shared tensor once), but an embedding table that is not also
        the LM head (a lookup reads a few rows of it) and an LM head that has a screen (its
        screen's parameters are read instead, and a few of its rows:
        :class:`~shardline.layers.kernels.GreedyScreen`)."""
        model = getattr(self.model_runner, "model", None)
        if not isinstance(model, nn.Module):
            return 0
        modules = list(model.modules())

        def weights_of(modules: list[nn.Module]) -> set[int]:
            return {id(module.weight) for module in modules}

        def part(module: nn.Module) -> str:
            return getattr(type(module), "profile_part", "")

        screened = weights_of([m for m in modules if getattr(m, "screen", None) is not None])
        looked_up = weights_of([m for m in modules if part(m) == EMBEDDING_LOOKUP])
        read = weights_of([m for m in modules if part(m) == MATMUL]) - screened
        parameters = {id(p): p for p in model.parameters()}
        return sum(
            p.numel() * p.element_size()
            for key, p in parameters.items()
            if key not in screened and (key not in looked_up or key in read)
        )

    def read_bandwidth(self, repeats: int = 5) -> float:
        """Bytes per second this rank reads from memory with its torch threads while every rank
        of the world reads too (as in a decode step, where they share the memory bus): the
        fastest of ``repeats`` sums over :data:`BANDWIDTH_PROBE_BYTES` (made and freed here),
        each started after a world barrier. Collective: every rank of the world calls it."""
        probe = torch.ones(BANDWIDTH_PROBE_BYTES // 4, dtype=torch.float32)
        probe.sum()
        times = []
        for _ in range(repeats):
            self.state.world.barrier()
            start = time.perf_counter()
            probe.sum()
            times.append(time.perf_counter() - start)
        del probe
        return BANDWIDTH_PROBE_BYTES / min(times)

    def close(self, finish_sends: bool = True) -> None:
        """Wait for the last pipeline send to go out; with ``finish_sends`` False (after the
        world failed: its receiver may never take it) drop it instead."""
        work, self._pp_send_work = self._pp_send_work, None
        if work is not None and finish_sends:
            work.wait()
