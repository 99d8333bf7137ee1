"""A driver for the driver-death tests: starts a 2-rank world (an mp executor, or a
LocalWorld) that stops in the phase named on the command line, says so on stdout, then waits
to be killed. Phases: spawn (ranks still importing), join (rank 1 stalls before joining:
the ``stall`` test plugin), load (the model runner stalls in load_model), idle, step (a call
in flight on every rank: each leaves ``stepping-RANK`` in $STALL_MARKERS)."""

import json
import os
import sys
import threading
import time
from pathlib import Path

from shardline.config import load_config
from shardline.conformance.executors import probe
from shardline.registry import Registry

STALL_S = 120.0


class StallingRunner(probe.ProbeModelRunner):
    """The probe runner, stalling in load_model (leaves ``loading-RANK`` in $STALL_MARKERS)."""

    def load_model(self) -> None:
        Path(os.environ["STALL_MARKERS"], f"loading-{self.state.rank}").touch()
        time.sleep(STALL_S)


def step(worker, seconds: float) -> None:
    """A call in flight on ``worker``'s rank."""
    Path(os.environ["STALL_MARKERS"], f"stepping-{worker.rank}").touch()
    time.sleep(seconds)


def step_in_context(context, seconds: float) -> None:
    """:func:`step` as a LocalWorld call (given the rank's WorkerContext)."""
    step(context.worker, seconds)


def say(**fields) -> None:
    print(json.dumps({"driver": os.getpid(), **fields}), flush=True)


def main(kind: str, phase: str) -> None:
    # The calls the ranks run, from this module under the name they import it by (a
    # LocalWorld call is pickled by reference; this script's own functions are __main__'s).
    from support import orphan_driver as calls

    say(phase="starting")
    runner = "support.orphan_driver:StallingRunner" if phase == "load" else probe.PROBE_RUNNER
    config = load_config(
        overrides=[
            "parallel.tensor_parallel_size=2",
            "parallel.distributed_executor_backend=mp",
            f"parallel.startup_timeout_s={STALL_S}",
            f"model.runner={runner}",
        ],
        environ={},
    ).config
    if kind == "local_world":
        from shardline.launch.local_world import LocalWorld
        from shardline.worker.setup import WorkerSetup

        setup = WorkerSetup(config, load_model=phase == "load")
        world = LocalWorld(2, setup, start_timeout_s=STALL_S, call_timeout_s=STALL_S)
        if phase == "step":
            threading.Thread(
                target=world.run, args=(calls.step_in_context, STALL_S), daemon=True
            ).start()
        say(phase=phase, job=world.rendezvous.job)
    else:
        executor = Registry.load().get("executor", "mp").load_available()(config)
        if phase == "step":
            executor.collective_rpc(calls.step, (STALL_S,), non_block=True)
        say(phase=phase, job=executor.job)
    while True:
        time.sleep(0.1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
