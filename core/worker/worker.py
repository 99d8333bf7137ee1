"""The Worker: one per rank. Owns the rank's ParallelState and handles the pipeline boundary
around the ModelRunner (reference: seed 000, ``GPUWorker.execute_model``)."""

from __future__ import annotations

from typing import Any

from shardline.distributed import ParallelState
from shardline.interfaces import IntermediateTensors, ModelRunner, Work


class AsyncIntermediateTensors(IntermediateTensors):
    """Intermediate tensors still arriving from the previous stage: the receive (and its TP
    all-gather) completes the first time the model touches them."""

    def __init__(self, receive: Work) -> None:
        self._receive = receive

    @property
    def tensors(self) -> dict:
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
        pp = self.state.pp
        if self._pp_send_work is not None:
            self._pp_send_work.wait()
        self._pp_send_work = None
        forward_pass = scheduler_output.total_num_scheduled_tokens > 0
        gather_group = self.state.tp if self.tp_assisted_transfer else None
        intermediate = None
        if forward_pass and not pp.is_first_rank:
            intermediate = AsyncIntermediateTensors(
                pp.irecv_tensor_dict(all_gather_group=gather_group)
            )
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

    def close(self) -> None:
        if self._pp_send_work is not None:
            self._pp_send_work.wait()
        self._pp_send_work = None
