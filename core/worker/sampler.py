"""Turning logits into tokens: penalties and biases (:func:`adjust_logits`), then greedy,
or temperature + top-k + top-p with a seeded draw; and the tokens' log-probabilities where a
request asks (:func:`token_logprobs`).

Sampling runs where the logits are (the rank's device); only the chosen token ids (and the
asked log-probabilities) come back to the host, once per step (:func:`sample_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from shardline.interfaces.step import SamplingParams, TokenLogprobs

_MASK_64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The seed of the draw of a request's output token ``index``: a mix (SplitMix64's) of
    the request's seed and the index, so that each token's draw depends on them alone: a
    request computed again after preemption draws what it would have drawn."""
    mixed = (seed + (index + 1) * 0x9E3779B97F4A7C15) & _MASK_64
    mixed = ((mixed ^ (mixed >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    mixed = ((mixed ^ (mixed >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return mixed ^ (mixed >> 31)


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
    prompt_lengths: Sequence[int],
) -> torch.Tensor:
    """``[rows, vocab]`` logits with each row's repetition, frequency and presence penalties
    and logit bias applied (see :class:`SamplingParams`), in float32; row ``i``'s tokens so
    far are ``histories[i]``, its prompt the first ``prompt_lengths[i]`` of them. A new
    tensor; rows without adjustments are copied as they are."""
    adjusted = logits.float().clone()
    vocab = adjusted.shape[-1]
    for i, p in enumerate(params):
        if not p.adjusts_logits:
            continue
        row = adjusted[i]
        if p.repetition_penalty != 1.0 and histories[i]:
            seen = torch.tensor(sorted(set(histories[i])), device=row.device)
            values = row[seen]
            row[seen] = torch.where(
                values > 0, values / p.repetition_penalty, values * p.repetition_penalty
            )
        output = histories[i][prompt_lengths[i] :]
        if (p.frequency_penalty or p.presence_penalty) and output:
            counts = torch.bincount(torch.tensor(output, device=row.device), minlength=vocab)
            counts = counts[:vocab].float()
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            tokens = torch.tensor([token for token, _ in p.logit_bias], device=row.device)
            bias = torch.tensor([value for _, value in p.logit_bias], device=row.device)
            row.index_add_(0, tokens, bias)
    return adjusted


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    indexes: Sequence[int],
    generator: torch.Generator,
) -> list[int]:
    """One token id per row of ``[rows, vocab]`` logits (row ``i`` with ``params[i]``, for
    its request's output token ``indexes[i]``), drawn on the logits' device with
    ``generator`` (on that device; seeded for each draw by :func:`draw_seed`, so any
    generator draws the same) and read back in one transfer."""
    if all(p.temperature == 0 for p in params):
        return torch.argmax(logits, dim=-1).tolist()
    drawn = [_draw(row, p, generator, i) for row, p, i in zip(logits, params, indexes, strict=True)]
    return torch.stack(drawn).tolist()


def _draw(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, index: int
) -> torch.Tensor:
    """The token id drawn from ``[vocab]`` logits for output token ``index``, as a 0-d
    tensor on their device; the same for the same seed and index."""
    if params.temperature == 0:
        return torch.argmax(logits)
    generator.manual_seed(draw_seed(params.seed, index))
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
    return torch.multinomial(probabilities, 1, generator=generator)[0]


def token_logprobs(
    logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int | None]
) -> list[TokenLogprobs | None]:
    """Per row of ``[rows, vocab]`` logits with ``ks[i]`` not None: the log-probability of
    ``token_ids[i]`` and the ``ks[i]`` most likely tokens', from ``log_softmax`` of the
    row in float32 (the model's distribution, before any sampling filter); None for the
    other rows. Read back once per step (three small tensors)."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    if not rows:
        return [None] * len(ks)
    index = torch.tensor(rows, device=logits.device)
    chosen = torch.tensor([token_ids[i] for i in rows], device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    picked = logprobs.gather(1, chosen[:, None])[:, 0]
    most = max(ks[i] for i in rows)
    top = torch.topk(logprobs, most, dim=-1) if most else None
    picked_list = picked.tolist()
    top_values = top.values.tolist() if top is not None else [[]] * len(rows)
    top_ids = top.indices.tolist() if top is not None else [[]] * len(rows)
    found: list[TokenLogprobs | None] = [None] * len(ks)
    for n, i in enumerate(rows):
        k = ks[i]
        found[i] = TokenLogprobs(
            picked_list[n], tuple(zip(top_ids[n][:k], top_values[n][:k], strict=True))
        )
    return found
