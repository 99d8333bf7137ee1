"""A driver process for the mp executor tests: starts an executor on the model given, prints
its workers' pids as one JSON line, then waits to be killed or interrupted."""

import faulthandler
import json
import signal
import sys
import time

from shardline.config import load_config
from shardline.conformance.executors.probe import rank_and_pid
from shardline.registry import Registry


def main(model_path: str) -> None:
    # A shell starts background jobs with Ctrl-C ignored; a user's terminal does not.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    config = load_config(
        overrides=[
            f"model.path={model_path}",
            "parallel.tensor_parallel_size=2",
            "parallel.distributed_executor_backend=mp",
        ],
        environ={},
    ).config
    executor = Registry.load().get("executor", "mp").load_available()(config)
    pids = [pid for _, pid in executor.collective_rpc(rank_and_pid)]
    try:
        host, port = executor.rendezvous_address
        info = {"workers": pids, "job": executor.job, "store": [host, port]}
        print(json.dumps(info), flush=True)
        while True:
            time.sleep(0.1)
    except KeyboardInterrupt:
        # Should shutting down hang, every thread's stack goes to stderr for the test to show.
        faulthandler.dump_traceback_later(15, exit=True)
        executor.shutdown()
        print("shut down", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
