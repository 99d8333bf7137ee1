"""Sampling: greedy is argmax; seeded draws repeat; top-k and top-p restrict the support."""

import pytest
import torch

from shardline.interfaces.step import SamplingParams
from shardline.worker.sampler import make_generator, sample_rows

LOGITS = torch.tensor([0.1, 2.0, 1.9, -1.0, 0.5, 1.0])


def sample(logits, params, generator):
    return sample_rows(logits[None], [params], [generator])[0]


def _draws(params, count=300):
    generator = make_generator(params)
    return [sample(LOGITS, params, generator) for _ in range(count)]


def test_greedy_is_argmax():
    assert sample(LOGITS, SamplingParams(), make_generator(SamplingParams())) == 1


def test_a_batch_of_rows_draws_as_each_row_alone():
    rows = torch.stack([LOGITS, LOGITS.flip(0), LOGITS * 3])
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=5), SamplingParams()]
    batched = sample_rows(rows, params, [make_generator(p) for p in params])
    alone = [sample(row, p, make_generator(p)) for row, p in zip(rows, params, strict=True)]
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
    ],
)
def test_bad_parameters_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)
