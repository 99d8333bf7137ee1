"""A model runner whose step computes for a second and then all-reduces over its tensor-parallel
group: a rank stopped during the step leaves the others waiting in that collective, having
entered it well after the call began."""

import time

import torch

from shardline.conformance.executors.probe import ProbeModelRunner

COMPUTE_S = 1.0


class SlowCollectiveRunner(ProbeModelRunner):
    def execute_model(self, scheduler_output, intermediate_tensors):
        time.sleep(COMPUTE_S)
        self.state.tp.all_reduce(torch.ones(4))
        return {"rank": self.state.rank}
