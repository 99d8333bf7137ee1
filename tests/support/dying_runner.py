"""A model runner whose rank 1 dies (SIGKILL to itself) while it loads the model: a death in
start-up phase 'model load'."""

import os
import signal

from shardline.conformance.executors.probe import ProbeModelRunner


class DyingRunner(ProbeModelRunner):
    def load_model(self) -> None:
        if self.state.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
