"""A rank of a launched world (mpiexec / torchrun) running the engine: every process builds
its ``LLM`` (the executor ``auto`` picks: external_launcher), answers the questions given,
and the reporting process prints one JSON line with the executor and the tokens.

    python -m support.llm_driver MODEL MAX_TOKENS QUESTION... -- [KEY=VALUE ...]
"""

import json
import sys

from shardline.engine import LLM, SamplingParams


def main(model: str, max_tokens: int, questions: list[str], overrides: list[str]) -> None:
    with LLM(overrides=[f"model.path={model}", *overrides]) as llm:
        outputs = llm.chat(
            [[{"role": "user", "content": q}] for q in questions],
            SamplingParams(max_tokens=max_tokens),
        )
        if llm.reports_results:
            executor = llm.engine.config.parallel.distributed_executor_backend
            tokens = [o.token_ids for o in outputs]
            print(json.dumps({"executor": executor, "tokens": tokens}), flush=True)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    split = arguments.index("--") if "--" in arguments else len(arguments)
    main(arguments[0], int(arguments[1]), arguments[2:split], arguments[split + 1 :])
