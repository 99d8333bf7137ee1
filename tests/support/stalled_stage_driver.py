"""A rank of a launched pipeline-parallel world whose last stage hangs inside its third step.

Every rank builds its ``LLM`` and starts generating; on the last rank (the last stage, the
output rank) the runner's third step prints ``{"hung_at": wall-clock time}`` and sleeps far
past any deadline. Every other rank prints ``{"rank", "error", "message", "raised_at",
"shutdown", "shutdown_s"}``: the error its generation ends with (``"error": null`` if none),
then how its engine's shutdown went ("clean" or the error) and how long it took, and returns
0 as a script that catches the error would: the executor's failure alone must make its exit
end the launched world (:func:`shardline.launch.job_end.abort_job_at_exit`).

    python -m support.stalled_stage_driver MODEL -- [KEY=VALUE ...]
"""

import json
import os
import sys
import time

from shardline.engine import LLM, SamplingParams
from shardline.errors import ShardlineError
from shardline.launch.launcher_env import LaunchedRank
from shardline.worker.model_runner import CausalLMRunner

HANG_AT_STEP = 3
HANG_S = 3600.0


def _hang_at_step(step: int) -> None:
    """Make this process's model runner hang in its ``step``-th step."""
    execute_model = CausalLMRunner.execute_model
    steps = 0

    def hanging(self, *args, **kwargs):
        nonlocal steps
        steps += 1
        if steps == step:
            print(json.dumps({"hung_at": time.time()}), flush=True)
            time.sleep(HANG_S)
        return execute_model(self, *args, **kwargs)

    CausalLMRunner.execute_model = hanging


def main(model: str, overrides: list[str]) -> int:
    launched = LaunchedRank.from_environ(os.environ)
    if launched.rank == launched.world_size - 1:
        _hang_at_step(HANG_AT_STEP)
    report: dict = {"rank": launched.rank, "error": None}
    llm = LLM(overrides=[f"model.path={model}", *overrides])
    try:
        llm.generate(["a question", "another question"], SamplingParams(max_tokens=64))
    except ShardlineError as error:
        report |= {"error": type(error).__name__, "message": str(error)}
        report["raised_at"] = time.time()
    began = time.monotonic()
    try:
        llm.shutdown()
        report["shutdown"] = "clean"
    except ShardlineError as error:
        report["shutdown"] = f"{type(error).__name__}: {error}"
    report["shutdown_s"] = round(time.monotonic() - began, 3)
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    arguments = sys.argv[1:]
    raise SystemExit(main(arguments[0], arguments[arguments.index("--") + 1 :]))
