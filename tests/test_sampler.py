"""Sampling: greedy is argmax; seeded draws repeat; top-k and top-p restrict the support;
penalties and biases adjust the logits first; log-probabilities are the model's (before any
adjustment or sampling filter), k most likely first."""

import pytest
import torch

from shardline.interfaces.step import SamplingParams
from shardline.worker.sampler import adjust_logits, sample_rows, token_logprobs

LOGITS = torch.tensor([0.1, 2.0, 1.9, -1.0, 0.5, 1.0])


def sample(logits, params, generator, index=0):
    return sample_rows(logits[None], [params], [index], generator)[0]


def _draws(params, count=300):
    """What ``count`` output tokens of a request draw, one after the other."""
    generator = torch.Generator()
    return [sample(LOGITS, params, generator, index) for index in range(count)]


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams(), torch.Generator()) == 1


def test_a_batch_of_rows_draws_as_each_row_alone():
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 3])
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=5), SamplingParams()]
    batched = sample_rows(rows, params, [0, 0, 0], torch.Generator())
    alone = [sample(row, p, torch.Generator()) for row, p in zip(rows, params, strict=True)]
    assert batched == alone
    assert batched[0] == 1 and batched[2] == 1


def test_same_seed_same_draws_different_seed_different_draws():
    params = SamplingParams(temperature=1.0, seed=7)
    assert _draws(params) == _draws(params)
    assert _draws(params) != _draws(SamplingParams(temperature=1.0, seed=8))


def test_top_k_keeps_only_the_k_best():
    assert set(_draws(SamplingParams(temperature=1.0, top_k=2, seed=1))) == {1, 2}
    assert set(_draws(SamplingParams(temperature=5.0, top_k=1, seed=1))) == {1}


def test_top_p_keeps_the_smallest_set_reaching_p():
    probabilities = torch.softmax(LOGITS, -1)
    # Tokens 1 and 2 together hold less than 0.75, so token 5 (next best) joins them.
    assert (
        probabilities[1] + probabilities[2]
        < 0.75
        < probabilities[1] + probabilities[2] + probabilities[5]
    )
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.75, seed=3), 600)) == {1, 2, 5}
    assert set(_draws(SamplingParams(temperature=1.0, top_p=0.01, seed=3))) == {1}


def test_high_temperature_reaches_every_token():
    assert set(_draws(SamplingParams(temperature=50.0, seed=2), 600)) == set(range(len(LOGITS)))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": -1}, "logprobs = -1: must be from 0 to 20"),
        ({"logprobs": 21}, "logprobs = 21: must be from 0 to 20"),
        ({"repetition_penalty": 0}, "repetition_penalty = 0: must be in"),
        ({"frequency_penalty": 2.5}, "frequency_penalty = 2.5: must be from -2 to 2"),
        ({"presence_penalty": -3}, "presence_penalty = -3: must be from -2 to 2"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias: token 1 with bias 101.0"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias: token -1"),
        ({"logit_bias": tuple((t, 1.0) for t in range(1025))}, "1025 tokens; at most 1024"),
    ],
)
def test_bad_parameters_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logprobs_are_the_logits_log_softmax_most_likely_first():
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 3])
    expected = torch.log_softmax(rows, dim=-1)
    # Row 0 asks for 2 alternatives, row 1 for none, row 2 for the token's own only.
    found = token_logprobs(rows, [4, 0, 1], [2, None, 0])
    assert found[1] is None
    assert found[0].logprob == pytest.approx(expected[0, 4].item())
    assert [token for token, _ in found[0].top] == [1, 2]
    assert [value for _, value in found[0].top] == pytest.approx(expected[0, [1, 2]].tolist())
    assert found[2].logprob == pytest.approx(expected[2, 1].item())
    assert found[2].top == ()


def test_logprobs_ignore_temperature_and_filters():
    # A draw with a low temperature and top-k 1 still reports the unfiltered distribution.
    params = SamplingParams(temperature=0.1, top_k=1, seed=3, logprobs=1)
    (token,) = sample_rows(LOGITS[None], [params], [0], torch.Generator())
    (found,) = token_logprobs(LOGITS[None], [token], [params.logprobs])
    assert token == 1
    assert found.logprob == pytest.approx(torch.log_softmax(LOGITS, dim=0)[1].item())
    assert found.logprob < -0.5  # 2.0 against 1.9 and the rest: far from probability 1


def test_penalties_and_bias_adjust_each_row_as_documented():
    rows = torch.stack([LOGITS, LOGITS, LOGITS, LOGITS])
    # Token 0 and 3 in the prompt (2 tokens), 1 twice and 4 once in the output.
    history = [0, 3, 1, 4, 1]
    params = [
        SamplingParams(),  # untouched
        SamplingParams(repetition_penalty=2.0),
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(logit_bias=((1, -100.0), (5, 3.0))),
    ]
    adjusted = adjust_logits(rows, params, [history] * 4, [2] * 4)
    assert torch.equal(adjusted[0], LOGITS)
    # Seen anywhere (prompt or output): positive logits halved, negative doubled.
    assert adjusted[1].tolist() == pytest.approx([0.05, 1.0, 1.9, -2.0, 0.25, 1.0])
    # Output only: 1 seen twice (-2 * 0.5 - 0.25), 4 once (-0.5 - 0.25); prompt tokens not.
    assert adjusted[2].tolist() == pytest.approx([0.1, 0.75, 1.9, -1.0, -0.25, 1.0])
    assert adjusted[3].tolist() == pytest.approx([0.1, -98.0, 1.9, -1.0, 0.5, 4.0])
    greedy = sample_rows(adjusted, params, [0] * 4, torch.Generator())
    assert greedy == [1, 2, 2, 5]  # the bias bans 1 and lifts 5 over it


def test_a_draw_depends_on_the_seed_and_the_token_index_alone():
    params = SamplingParams(temperature=1.0, seed=11)
    sequence = _draws(params, 40)
    # Any generator, in any state, draws token i as the sequence did.
    worn = torch.Generator()
    for index in (0, 3, 3, 17):
        sample(LOGITS, params, worn, 39 - index)
    assert [sample(LOGITS, params, worn, i) for i in range(20, 40)] == sequence[20:]
    assert len(set(sequence)) > 2
