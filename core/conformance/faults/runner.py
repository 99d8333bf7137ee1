"""What the fault suite runs on the ranks: a model runner whose step is one tensor-parallel
all-reduce in each pipeline stage, its result passed on to the next, with a fault armed
through ``collective_rpc`` (:func:`.plan.arm`) planted on the victim rank."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import torch

from shardline.comm.tensor_dict import TensorMeta
from shardline.conformance.faults.plan import HANG_S, Plan
from shardline.conformance.faults.scenarios import HOST_SCENARIOS
from shardline.interfaces import IntermediateTensors, ModelRunner

PROBE_SHAPE = (8, 16)


#: How long the victim of a host scenario pauses in the step, before its all-reduce, for the
#: suite to act on its host (it starts when the marker ``in-step`` appears).
HOLD_S = 1.0


class FaultModelRunner(ModelRunner):
    """Loads nothing. A step all-reduces a ``PROBE_SHAPE`` tensor over the TP group (ones in
    the first pipeline stage, what the previous stage sent in a later one) and sends the sum
    to the next stage; the output rank returns it. An armed plan replaces that on the victim
    (and, for control-plane faults, the receiving side on the others)."""

    def __init__(self, config: Any, state: Any) -> None:
        self.state = state
        self.plan = Plan(None, -1)

    def load_model(self) -> None:
        """Nothing to load."""

    def execute_model(
        self, scheduler_output: Any, intermediate_tensors: IntermediateTensors | None
    ) -> Any:
        if scheduler_output.total_num_scheduled_tokens == 0:
            return None
        tp, pp = self.state.tp, self.state.pp
        victim, fault = self.plan.victim, self.plan.fault
        on_victim = self.state.rank == victim
        if fault == "killed mid-step" and on_victim:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hangs in a collective" and on_victim:
            time.sleep(HANG_S)
        if fault in HOST_SCENARIOS and on_victim:
            Path(self.plan.markers, "in-step").touch()
            time.sleep(HOLD_S)
        if fault == "different collectives" and on_victim:
            tp.recv(torch.empty(PROBE_SHAPE), src=(victim + 1) % tp.world_size)
        elif fault == "different shapes" and on_victim:
            tp.all_reduce(torch.ones(PROBE_SHAPE[0], 2 * PROBE_SHAPE[1]))
        elif fault == "ill-formed object":
            if on_victim:
                _send_unsigned_object(tp, victim)
            else:
                tp.broadcast_object(None, src=victim)
        elif fault == "ill-formed tensor dict":
            if on_victim:
                for rank in range(tp.world_size):
                    if rank != victim:
                        tp.send_object([("x", TensorMeta("float99", (-1,), "cpu"))], rank)
            else:
                tp.recv_tensor_dict(src=victim)
        else:
            probe = torch.ones(PROBE_SHAPE) if pp.is_first_rank else intermediate_tensors["probe"]
            total = tp.all_reduce(probe)
            if not pp.is_last_rank:
                return IntermediateTensors({"probe": total})
            if self.state.is_output_rank:
                return {"sum": float(total[0, 0]), "ranks": tp.world_size}
        return None


def _send_unsigned_object(tp: Any, src: int) -> None:
    """What a process without the job's secret would send: a pickle with no valid tag."""
    payload = torch.frombuffer(bytearray(b"\x80\x05N." + bytes(64)), dtype=torch.uint8)
    tp.control.broadcast(torch.tensor([payload.numel()], dtype=torch.int64), src)
    tp.control.broadcast(payload, src)
