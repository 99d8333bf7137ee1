"""Prompt-lookup drafts on their own: which earlier occurrence is used, the longest run of
last tokens first, no match with itself, the limit, and an index kept up to date as tokens
are added; and a step's drafts through the mp executor's step encoding."""

from shardline.config.schema import SpeculativeConfig
from shardline.engine.speculative import MAX_CANDIDATES, NgramIndex, NgramProposer
from shardline.interfaces.step import CachedRequest, SchedulerOutput
from shardline_executors.mp_protocol import decode_step, encode_step


def test_the_latest_occurrence_of_the_longest_run_gives_the_drafts():
    index = NgramIndex(min_n=1, max_n=3)
    # "7 8" occurs twice before the end; "6 7 8" once, followed by 1 2: the longest run wins.
    tokens = [6, 7, 8, 1, 2, 9, 7, 8, 3, 4, 6, 7, 8]
    assert index.lookup(tokens, 2) == [1, 2]
    index = NgramIndex(min_n=1, max_n=2)
    assert index.lookup(tokens, 2) == [3, 4]  # "7 8" last seen before 3 4
    assert index.lookup(tokens, 9) == [3, 4, 6, 7, 8]  # as many as there are


def test_nothing_is_proposed_without_an_earlier_occurrence():
    assert NgramIndex(min_n=2, max_n=4).lookup([1, 2, 3, 4, 5], 4) == []
    assert NgramIndex(min_n=2, max_n=4).lookup([1], 4) == []
    assert NgramIndex(min_n=2, max_n=4).lookup([5, 5], 4) == []  # no match with itself
    assert NgramIndex(min_n=2, max_n=4).lookup([5, 5, 5], 4) == [5]


def test_an_index_follows_the_tokens_as_they_grow():
    """Given after every step the tokens added since, the index gives what a new index gives
    for all the tokens."""
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8, 3]
    growing = NgramIndex(min_n=1, max_n=3)
    for end in range(1, len(tokens) + 1):
        added = tokens[growing.num_tokens : end]
        assert growing.lookup(added, 3) == NgramIndex(1, 3).lookup(tokens[:end], 3), end


def test_the_proposer_keeps_to_the_limit_it_is_given():
    proposer = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=2))
    tokens = [1, 2, 3, 4, 5, 6, 1, 2]
    assert proposer.propose(proposer.new_index(), tokens, 2) == [3, 4]
    assert proposer.propose(proposer.new_index(), tokens, 1) == [3]


def test_draft_lengths_follow_the_schedule():
    """constant: num_speculative_tokens, whatever was accepted; heuristic: from there, 2 more
    after a step whose drafts were all accepted, 1 fewer after one whose were not, within 1
    and 15; a step without drafts says nothing."""
    constant = NgramProposer(SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    assert constant.first_length() == 3
    assert constant.next_length(3, 3, 3) == constant.next_length(3, 3, 0) == 3
    heuristic = NgramProposer(
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, draft_schedule="heuristic")
    )
    assert heuristic.first_length() == 3
    assert heuristic.next_length(3, 3, 3) == 5
    assert heuristic.next_length(5, 2, 2) == 7  # the lookup found fewer: all of them right
    assert heuristic.next_length(5, 5, 4) == 4
    assert heuristic.next_length(1, 1, 0) == 1
    assert heuristic.next_length(14, 14, 14) == heuristic.next_length(15, 15, 15) == 15
    assert heuristic.next_length(6, 0, 0) == 6


def test_a_steps_drafts_travel_through_the_mp_step_encoding():
    step = SchedulerOutput(
        cached_requests=[CachedRequest("a", [5], [], 9, (6, 7)), CachedRequest("b", [], [], 3)],
        num_scheduled_tokens={"a": 3, "b": 1},
    )
    decoded = decode_step(encode_step(step))
    assert decoded == step
    assert [c.spec_token_ids for c in decoded.cached_requests] == [(6, 7), ()]


def test_a_lookup_compares_the_latest_occurrences_only():
    """The shortest run's latest MAX_CANDIDATES occurrences are compared: a longer match
    further back is not looked for (a lookup's time is bounded however common the run)."""
    head = [1, 2, 3, 50]  # "1 2 3" then 50: the longest match of the tail "1 2 3"
    noise = [[9, 3, 60 + i] for i in range(MAX_CANDIDATES)]  # "3" then 60, 61, ...
    tokens = head + [t for triple in noise for t in triple] + [1, 2, 3]
    assert NgramIndex(min_n=1, max_n=3).lookup(tokens, 1) == [60 + MAX_CANDIDATES - 1]
    fewer = head + [t for triple in noise[1:] for t in triple] + [1, 2, 3]
    assert NgramIndex(min_n=1, max_n=3).lookup(fewer, 1) == [50]
