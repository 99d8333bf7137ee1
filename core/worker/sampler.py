"""Turning logits into tokens: greedy, or temperature + top-k + top-p with a seeded draw."""

from __future__ import annotations

import torch

from shardline.interfaces.step import SamplingParams


def make_generator(params: SamplingParams) -> torch.Generator:
    """The request's own random stream; every rank that samples creates it identically."""
    return torch.Generator().manual_seed(params.seed)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from ``[vocab]`` logits. Deterministic given the generator's state."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k:
        kth = torch.topk(scores, min(params.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(ordered, dim=-1).cumsum(-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop = (cumulative - torch.softmax(ordered, dim=-1)) >= params.top_p
        scores = scores.scatter(0, order, ordered.masked_fill(drop, float("-inf")))
    probabilities = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probabilities, 1, generator=generator))
