"""Scripted scheduler steps for the worker tests: two requests, a prompt split over two steps
(mixed prefill + decode), growing block tables, then a step with no tokens."""

from __future__ import annotations

from collections.abc import Callable

from shardline.interfaces.step import CachedRequest, NewRequest, SamplingParams, SchedulerOutput

PROMPT_A = [1, 5, 9, 33, 2, 7, 7, 80]
PROMPT_B = [3, 99, 4]
GREEDY = SamplingParams(temperature=0.0)
#: How many greedy tokens the model tests compare with transformers.
GREEDY_TOKENS = 32


def run_script(
    execute: Callable[[SchedulerOutput], object], new_tokens: int
) -> dict[str, list[int]]:
    """Drive ``execute`` (one step -> the output rank's ModelRunnerOutput) until each request
    has ``new_tokens`` generated tokens; block size 4. Returns the generated tokens."""
    generated: dict[str, list[int]] = {"A": [], "B": []}
    blocks = {"A": [3, 0, 7], "B": [5]}
    spare = [9, 2, *range(11, 40)]
    computed = {"A": 0, "B": 0}
    length = {"A": len(PROMPT_A), "B": len(PROMPT_B)}

    def record(output, scheduled):
        assert output is not None, "the output rank returned nothing"
        assert output.req_ids == list(scheduled)
        for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
            if token is not None:
                generated[req_id].append(token)

    # Step 1: all of A's prompt, the first two tokens of B's.
    first = SchedulerOutput(
        new_requests=[
            NewRequest("A", PROMPT_A, GREEDY, blocks["A"]),
            NewRequest("B", PROMPT_B, GREEDY, blocks["B"]),
        ],
        num_scheduled_tokens={"A": len(PROMPT_A), "B": 2},
    )
    output = execute(first)
    record(output, first.num_scheduled_tokens)
    assert output.sampled_token_ids[1] is None  # B's prompt is not finished yet
    computed = {"A": len(PROMPT_A), "B": 2}
    pending = {"A": [generated["A"][-1]], "B": []}
    while min(len(generated["A"]), len(generated["B"])) < new_tokens:
        cached, scheduled = [], {}
        for req_id in ("A", "B"):
            if len(generated[req_id]) >= new_tokens:
                continue
            length[req_id] += len(pending[req_id])
            new_blocks = []
            while len(blocks[req_id]) * 4 < length[req_id]:
                new_blocks.append(spare.pop(0))
                blocks[req_id].append(new_blocks[-1])
            cached.append(CachedRequest(req_id, pending[req_id], new_blocks, computed[req_id]))
            scheduled[req_id] = length[req_id] - computed[req_id]
        step = SchedulerOutput(cached_requests=cached, num_scheduled_tokens=scheduled)
        output = execute(step)
        record(output, scheduled)
        for req_id in scheduled:
            computed[req_id] = length[req_id]
            pending[req_id] = [generated[req_id][-1]]
    idle = execute(SchedulerOutput(finished_req_ids={"A", "B"}))
    assert idle is None, "a step without tokens returned output"
    return {req_id: tokens[:new_tokens] for req_id, tokens in generated.items()}


def generate(
    execute: Callable[[SchedulerOutput], object],
    prompts: list[list[int]],
    new_tokens: int,
    block_size: int,
) -> list[list[int]]:
    """Greedy generation of ``new_tokens`` for every prompt, batched: one prefill step for
    all prompts, then one decode step per token. Blocks are handed out in order."""
    next_block = 0

    def allocate(count: int) -> list[int]:
        nonlocal next_block
        blocks = list(range(next_block, next_block + count))
        next_block += count
        return blocks

    req_ids = [f"r{i}" for i in range(len(prompts))]
    blocks = {r: allocate(-(-len(p) // block_size)) for r, p in zip(req_ids, prompts, strict=True)}
    lengths = {r: len(p) for r, p in zip(req_ids, prompts, strict=True)}
    step = SchedulerOutput(
        new_requests=[
            NewRequest(r, p, GREEDY, blocks[r]) for r, p in zip(req_ids, prompts, strict=True)
        ],
        num_scheduled_tokens=dict(lengths),
    )
    generated: dict[str, list[int]] = {r: [] for r in req_ids}
    for _ in range(new_tokens):
        output = execute(step)
        for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
            generated[req_id].append(token)
        cached = []
        for req_id in req_ids:
            computed = lengths[req_id]
            lengths[req_id] += 1
            grow = allocate(1) if len(blocks[req_id]) * block_size < lengths[req_id] else []
            blocks[req_id] += grow
            cached.append(CachedRequest(req_id, [generated[req_id][-1]], grow, computed))
        step = SchedulerOutput(
            cached_requests=cached, num_scheduled_tokens=dict.fromkeys(req_ids, 1)
        )
    return [generated[r] for r in req_ids]
