"""A rank of a launched world (mpiexec / torchrun) running the engine: every process builds
its ``LLM`` (the executor ``auto`` picks: external_launcher), answers the questions given,
embeds one text, and the reporting process prints one JSON line with the executor, the
tokens, the embedding and the speculative drafts accepted.

    python -m support.llm_driver MODEL MAX_TOKENS QUESTION... --embed TEXT -- [KEY=VALUE ...]
"""

import json
import sys

from shardline.engine import LLM, SamplingParams


def main(
    model: str, max_tokens: int, questions: list[str], text: str, overrides: list[str]
) -> None:
    with LLM(overrides=[f"model.path={model}", *overrides]) as llm:
        outputs = llm.chat(
            [[{"role": "user", "content": q}] for q in questions],
            SamplingParams(max_tokens=max_tokens),
        )
        (embedding,) = llm.embed(text)
        if llm.reports_results:
            report = {
                "executor": llm.engine.config.parallel.distributed_executor_backend,
                "tokens": [o.token_ids for o in outputs],
                "embedding": embedding.tolist(),
                "drafts_accepted": llm.engine.scheduler.spec_accepted_tokens,
            }
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    arguments = sys.argv[1:]
    embed_at, split = arguments.index("--embed"), arguments.index("--")
    main(
        arguments[0],
        int(arguments[1]),
        arguments[2:embed_at],
        arguments[embed_at + 1],
        arguments[split + 1 :],
    )
