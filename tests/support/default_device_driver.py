"""Runs the small Llama in this process (uni executor) and prints what it produced as JSON:
greedy and seeded tokens, and a pooled embedding. ``--default-device D`` first makes ``D``
torch's default device for the whole process, so that any tensor the rank makes without
naming its device lands on ``D`` and mixing it with the rank's own tensors fails."""

from __future__ import annotations

import argparse
import json

import torch

from shardline.engine import LLM, SamplingParams

PROMPTS = [[1, 5, 9, 33, 2, 7, 7, 80], [3, 99, 4], [7] * 21]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("--default-device")
    args = parser.parse_args()
    if args.default_device:
        torch.set_default_device(args.default_device)
    overrides = [
        f"model.path={args.model}",
        "cache.block_size=4",
        "cache.num_blocks=24",
        "scheduler.max_num_batched_tokens=8",  # prompts arrive in chunks
    ]
    with LLM(overrides=overrides, environ={}) as llm:
        greedy = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
        seeded = llm.generate(
            PROMPTS[:2], SamplingParams(max_tokens=8, temperature=1.0, top_p=0.9, seed=3)
        )
    with LLM(overrides=[*overrides, "model.pooling=mean"], environ={}) as llm:
        embedding = llm.embed(PROMPTS[0])
    print(
        json.dumps(
            {
                "greedy": [o.token_ids for o in greedy],
                "seeded": [o.token_ids for o in seeded],
                "embedding": [round(x, 5) for x in embedding[0].tolist()],
                "embedding_device": str(embedding[0].device),
            }
        )
    )


if __name__ == "__main__":
    main()
