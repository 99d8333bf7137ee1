"""The continuous-batching scheduler on its own: admission under the token budget, chunked
prefill mixed with decode, block accounting, preemption and resumption, stop conditions.
Steps are answered by a stand-in for the output rank that samples ``last token + 1`` (or
another rule of the tokens so far) and checks drafts as a model would; every scheduled token
count and block table is checked against what a runner could compute."""

import pytest

from shardline.config.schema import SchedulerConfig, SpeculativeConfig
from shardline.engine.scheduler import Request, Scheduler
from shardline.engine.speculative import NgramProposer
from shardline.errors import RequestError
from shardline.interfaces.step import ModelRunnerOutput, SamplingParams, SchedulerOutput

EOS = 99


class RunnerView:
    """What a model runner would know: each request's tokens, blocks and computed count, and
    which token each cache slot holds. Checks every step is computable and that each
    scheduled request would read its own tokens from its blocks (cached blocks it shares
    included), and samples ``model(tokens)`` (default ``last + 1``) when a prompt is
    complete; a request's drafts are accepted up to the first that differs from the model's
    choice at its place."""

    def __init__(self, block_size: int, model=lambda tokens: tokens[-1] + 1) -> None:
        self.block_size = block_size
        self.model = model
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}
        self.slots: dict[int, int] = {}

    def run(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        for req_id in step.finished_req_ids:
            for table in (self.tokens, self.blocks, self.computed):
                table.pop(req_id, None)
        for new in step.new_requests:
            assert new.req_id not in self.tokens, "a request was sent as new twice"
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.blocks[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = new.num_computed_tokens
        drafts = {}
        for cached in step.cached_requests:
            self.tokens[cached.req_id] += cached.new_token_ids
            self.blocks[cached.req_id] += cached.new_block_ids
            assert self.computed[cached.req_id] == cached.num_computed_tokens
            drafts[cached.req_id] = list(cached.spec_token_ids)
        for req_id, table in self.blocks.items():
            assert len(set(table)) == len(table), f"{req_id} holds a block twice: {table}"
        if not step.num_scheduled_tokens:
            return None
        # Like attention: the step writes every scheduled token's slot, then each request
        # reads all of its positions so far.
        for req_id, count in step.num_scheduled_tokens.items():
            done = self.computed[req_id] + count
            known = self.tokens[req_id] + drafts.get(req_id, [])
            assert done <= len(known)
            assert done == len(known) or not drafts.get(req_id), "drafts are computed whole"
            assert done <= len(self.blocks[req_id]) * self.block_size
            for position in range(self.computed[req_id], done):
                self.slots[self._slot(req_id, position)] = known[position]
            self.computed[req_id] = done
        sampled, accepted = [], []
        for req_id in step.num_scheduled_tokens:
            done, tokens = self.computed[req_id], self.tokens[req_id]
            guesses = drafts.get(req_id, [])
            known = tokens + guesses
            read = [self.slots.get(self._slot(req_id, p)) for p in range(done)]
            assert read == known[:done], f"{req_id} would read {read}, not {known[:done]}"
            kept = 0
            while kept < len(guesses) and guesses[kept] == self.model(tokens + guesses[:kept]):
                kept += 1
            self.computed[req_id] -= len(guesses) - kept
            accepted.append(kept)
            complete = done == len(known)
            sampled.append(self.model(tokens + guesses[:kept]) if complete else None)
        return ModelRunnerOutput(
            list(step.num_scheduled_tokens),
            sampled,
            num_accepted_drafts=accepted if any(drafts.values()) else None,
        )

    def _slot(self, req_id: str, position: int) -> int:
        block = self.blocks[req_id][position // self.block_size]
        return block * self.block_size + position % self.block_size


def _scheduler(
    budget=16, seqs=8, blocks=32, block_size=4, max_len=64, prefix_caching=True, drafts=None
):
    """``drafts``: a SpeculativeConfig for an n-gram proposer (None: no speculation)."""
    config = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget)
    return Scheduler(
        config,
        block_size=block_size,
        num_blocks=blocks,
        max_model_len=max_len,
        eos_token_ids={EOS},
        prefix_caching=prefix_caching,
        proposer=None if drafts is None else NgramProposer(drafts),
    )


def _drive(scheduler, view, steps_log=None, limit=500):
    for _ in range(limit):
        if not scheduler.has_unfinished():
            return
        step = scheduler.schedule()
        if steps_log is not None:
            steps_log.append(step)
        scheduler.update(step, view.run(step))
    raise AssertionError("requests did not finish")


def _run_all(scheduler, view, requests):
    """Add ``requests`` and drive them to the end; the steps taken."""
    for request in requests:
        scheduler.add_request(request)
    steps = []
    _drive(scheduler, view, steps)
    return steps


def test_prefill_is_chunked_under_the_budget_and_shares_steps_with_decode():
    scheduler, view = _scheduler(budget=8), RunnerView(4)
    short = Request("short", [1, 2, 3], SamplingParams(max_tokens=6))
    long = Request("long", list(range(10, 30)), SamplingParams(max_tokens=3))
    scheduler.add_request(short)
    scheduler.add_request(long)
    steps = []
    _drive(scheduler, view, steps)
    assert steps[0].num_scheduled_tokens == {"short": 3, "long": 5}
    # Then short decodes one token per step while long's prompt arrives in chunks.
    assert steps[1].num_scheduled_tokens == {"short": 1, "long": 7}
    assert steps[2].num_scheduled_tokens == {"short": 1, "long": 7}
    assert steps[3].num_scheduled_tokens == {"short": 1, "long": 1}
    assert all(step.total_num_scheduled_tokens <= 8 for step in steps)
    assert short.output_token_ids == [4, 5, 6, 7, 8, 9]
    assert long.output_token_ids == [30, 31, 32]
    assert (short.finish_reason, long.finish_reason) == ("length", "length")
    assert scheduler.blocks.num_free == 32


def test_requests_join_and_leave_at_every_step():
    scheduler, view = _scheduler(seqs=2), RunnerView(4)
    requests = [Request(f"r{i}", [i * 10 + 1], SamplingParams(max_tokens=2 + i)) for i in range(4)]
    for request in requests:
        scheduler.add_request(request)
    steps = []
    _drive(scheduler, view, steps)
    assert [sorted(s.num_scheduled_tokens) for s in steps[:4]] == [
        ["r0", "r1"],
        ["r0", "r1"],
        ["r1", "r2"],  # r0 finished after 2 tokens; r2 took its place at once
        ["r2", "r3"],
    ]
    assert "r0" in steps[2].finished_req_ids
    assert all(len(r.output_token_ids) == r.sampling.max_tokens for r in requests)


def test_preemption_frees_blocks_and_resumes_from_the_tokens_so_far():
    # 6 blocks of 4 tokens: three requests growing to 12 tokens each cannot all fit.
    scheduler, view = _scheduler(blocks=6, max_len=24), RunnerView(4)
    requests = [
        Request(f"r{i}", [i * 100 + 1, i * 100 + 2], SamplingParams(max_tokens=10))
        for i in range(3)
    ]
    steps = _run_all(scheduler, view, requests)
    assert scheduler.num_preemptions > 0
    for i, request in enumerate(requests):
        assert request.output_token_ids == list(range(i * 100 + 3, i * 100 + 13))
    resumed = [n for s in steps for n in s.new_requests if len(n.prompt_token_ids) > 2]
    assert resumed, "a preempted request was not resumed with its generated tokens"
    # Its generated tokens are marked as output (penalties count them), the prompt's are not.
    assert all(new.num_output_tokens == len(new.prompt_token_ids) - 2 for new in resumed)
    first_sent = [n for s in steps for n in s.new_requests if len(n.prompt_token_ids) == 2]
    assert all(new.num_output_tokens == 0 for new in first_sent)
    # The runner was told to drop the preempted state before the request came back.
    for new in resumed:
        dropped = [i for i, s in enumerate(steps) if new.req_id in s.finished_req_ids]
        back = next(i for i, s in enumerate(steps) if new in s.new_requests)
        assert any(i <= back for i in dropped)
    assert scheduler.blocks.num_free == 6


@pytest.mark.parametrize(
    ("sampling", "reason", "expected"),
    [
        (SamplingParams(max_tokens=50), "stop", [96, 97, 98, 99]),  # EOS 99 kept, then stop
        (SamplingParams(max_tokens=50, ignore_eos=True), "length", list(range(96, 111))),
        (SamplingParams(max_tokens=50, stop_token_ids=(97,)), "stop", [96, 97]),
        (SamplingParams(max_tokens=2), "length", [96, 97]),
    ],
    ids=["eos", "ignore-eos-until-max-model-len", "stop-token", "max-tokens"],
)
def test_stop_conditions(sampling, reason, expected):
    scheduler, view = _scheduler(max_len=20), RunnerView(4)
    request = Request("r", [91, 92, 93, 94, 95], sampling)
    scheduler.add_request(request)
    _drive(scheduler, view)
    assert (request.finish_reason, request.output_token_ids) == (reason, expected)


def test_pooling_and_generating_requests_never_share_a_step():
    scheduler, view = _scheduler(), RunnerView(4)
    scheduler.add_request(Request("gen", [1, 2], SamplingParams(max_tokens=3)))
    scheduler.add_request(Request("emb", [5, 6, 7], SamplingParams(), pooling="last"))
    first = scheduler.schedule()
    assert list(first.num_scheduled_tokens) == ["gen"]
    scheduler.update(first, view.run(first))
    second = scheduler.schedule()
    assert list(second.num_scheduled_tokens) == ["gen"]


def test_a_request_in_flight_is_not_scheduled_again():
    scheduler = _scheduler()
    scheduler.add_request(Request("a", [1, 2], SamplingParams(max_tokens=3)))
    scheduler.add_request(Request("b", [3, 4], SamplingParams(max_tokens=3)))
    first = scheduler.schedule(max_num_seqs=1)
    second = scheduler.schedule(max_num_seqs=1)
    assert list(first.num_scheduled_tokens) == ["a"]
    assert list(second.num_scheduled_tokens) == ["b"]
    assert not scheduler.has_schedulable()
    assert scheduler.schedule().num_scheduled_tokens == {}


def test_bad_requests_are_refused_with_the_reason():
    scheduler = _scheduler(max_len=8)
    with pytest.raises(RequestError, match="the prompt has 8 tokens; at most 7 fit"):
        scheduler.add_request(Request("long", list(range(8)), SamplingParams()))
    with pytest.raises(RequestError, match="empty"):
        scheduler.add_request(Request("empty", [], SamplingParams()))
    scheduler.add_request(Request("x", [1], SamplingParams()))
    with pytest.raises(RequestError, match="already in use"):
        scheduler.add_request(Request("x", [1], SamplingParams()))


# ---- prefix caching -------------------------------------------------------------------------


def _first_sent(steps, req_id):
    return next(new for step in steps for new in step.new_requests if new.req_id == req_id)


def test_a_prompt_starts_after_the_whole_blocks_an_earlier_one_cached():
    scheduler, view = _scheduler(), RunnerView(4)
    steps = []
    first = Request("first", list(range(1, 11)), SamplingParams(max_tokens=2))
    scheduler.add_request(first)
    _drive(scheduler, view, steps)
    # The same 9 tokens, then others: two whole blocks (8 tokens) are found.
    second = Request("second", [*range(1, 10), 50, 51], SamplingParams(max_tokens=2))
    scheduler.add_request(second)
    _drive(scheduler, view, steps)
    sent = _first_sent(steps, "second")
    assert sent.num_computed_tokens == 8
    assert sent.block_ids[:2] == _first_sent(steps, "first").block_ids[:2]
    assert next(s for s in steps if "second" in s.num_scheduled_tokens).num_scheduled_tokens == {
        "second": 3
    }
    assert second.output_token_ids == [52, 53]
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (10 + 11, 8)
    assert scheduler.blocks.num_used == 0


def test_requests_admitted_in_one_step_share_what_the_first_computes():
    scheduler, view = _scheduler(budget=32), RunnerView(4)
    for name in ("a", "b"):
        scheduler.add_request(Request(name, list(range(1, 10)), SamplingParams(max_tokens=3)))
    steps = []
    _drive(scheduler, view, steps)
    assert steps[0].num_scheduled_tokens == {"a": 9, "b": 1}
    assert _first_sent(steps, "b").num_computed_tokens == 8


def test_the_last_token_is_always_computed():
    scheduler, view = _scheduler(), RunnerView(4)
    steps = []
    for name in ("a", "b"):  # exactly two blocks: the second must be computed again
        scheduler.add_request(Request(name, list(range(1, 9)), SamplingParams(max_tokens=1)))
        _drive(scheduler, view, steps)
    assert _first_sent(steps, "b").num_computed_tokens == 4
    assert [s.num_scheduled_tokens for s in steps] == [{"a": 8}, {"b": 4}]


def test_free_cached_blocks_are_taken_last_and_forgotten_when_taken():
    scheduler, view = _scheduler(blocks=4, max_len=16), RunnerView(4)
    steps = []
    cached = list(range(1, 10))
    scheduler.add_request(Request("a", cached, SamplingParams(max_tokens=1)))
    _drive(scheduler, view, steps)
    a_blocks = _first_sent(steps, "a").block_ids
    # One block for a new prompt: a block that never held anything is taken first.
    scheduler.add_request(Request("b", [70, 71], SamplingParams(max_tokens=1)))
    _drive(scheduler, view, steps)
    assert not set(_first_sent(steps, "b").block_ids) & set(a_blocks)
    scheduler.add_request(Request("c", [*cached, 80], SamplingParams(max_tokens=1)))
    _drive(scheduler, view, steps)
    assert _first_sent(steps, "c").num_computed_tokens == 8
    # Four blocks of other tokens take every block: what "a" cached is gone.
    scheduler.add_request(Request("d", list(range(200, 215)), SamplingParams(max_tokens=1)))
    scheduler.add_request(Request("e", cached, SamplingParams(max_tokens=1)))
    _drive(scheduler, view, steps)
    assert _first_sent(steps, "e").num_computed_tokens == 0
    assert scheduler.blocks.num_free == 4


def test_a_preempted_request_comes_back_from_its_blocks_still_cached():
    scheduler, view = _scheduler(blocks=6, max_len=24), RunnerView(4)
    requests = [
        Request(f"r{i}", [i * 100 + t for t in range(1, 9)], SamplingParams(max_tokens=12))
        for i in range(2)
    ]
    steps = _run_all(scheduler, view, requests)
    assert scheduler.num_preemptions > 0
    resumed = [n for s in steps for n in s.new_requests if len(n.prompt_token_ids) > 8]
    # Its first block is still cached (a freed request's last blocks are taken first).
    assert resumed and all(new.num_computed_tokens >= 4 for new in resumed)
    for i, request in enumerate(requests):
        assert request.output_token_ids == list(range(i * 100 + 9, i * 100 + 21))


def test_requests_that_need_every_position_computed_do_not_start_from_the_cache():
    scheduler, view = _scheduler(), RunnerView(4)
    steps = []
    prompt = list(range(1, 10))
    for name, kind in (("gen", {}), ("scored", {"prompt_logprobs": 0}), ("embed", None)):
        if kind is None:
            request = Request(name, prompt, SamplingParams(), pooling="mean")
        else:
            request = Request(name, prompt, SamplingParams(max_tokens=1, **kind))
        scheduler.add_request(request)
        _drive(scheduler, view, steps)
    assert _first_sent(steps, "scored").num_computed_tokens == 0
    assert _first_sent(steps, "embed").num_computed_tokens == 0
    # What they computed is still offered to the others.
    scheduler.add_request(Request("after", prompt, SamplingParams(max_tokens=1)))
    _drive(scheduler, view, steps)
    assert _first_sent(steps, "after").num_computed_tokens == 8


@pytest.mark.parametrize("how", ["disabled", "reset"])
def test_nothing_is_shared_when_disabled_or_after_a_reset(how):
    scheduler, view = _scheduler(prefix_caching=how != "disabled"), RunnerView(4)
    steps = []
    for name in ("a", "b"):
        scheduler.add_request(Request(name, list(range(1, 10)), SamplingParams(max_tokens=1)))
        _drive(scheduler, view, steps)
        if how == "reset":
            scheduler.reset_prefix_cache()
    assert _first_sent(steps, "b").num_computed_tokens == 0
    assert scheduler.prefix_cache_hits == 0


def _cycle(tokens):
    """A stand-in model whose text repeats (10, 11, 12, 13, 14, 10, ...) and breaks the
    cycle at every position that is a multiple of 9 (the next token is then 30 to 33)."""
    if len(tokens) % 9 == 0:
        return 30 + len(tokens) % 4
    last = tokens[-1]
    return last + 1 if 10 <= last < 14 else 10


DRAFTS = SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)


def _generate(scheduler, prompts, sampling, model=_cycle, block_size=4):
    requests = [Request(f"r{i}", list(p), sampling) for i, p in enumerate(prompts)]
    steps = _run_all(scheduler, RunnerView(block_size, model), requests)
    return [r.output_token_ids for r in requests], steps


def test_drafts_are_kept_up_to_the_first_the_model_would_not_choose():
    """Greedy requests with n-gram drafts produce the tokens they produce without, in fewer
    steps; rejected drafts' cache positions stop counting as computed (the stand-in runner
    checks each later step starts where the scheduler says and reads its own tokens)."""
    prompts = [[10, 11, 12, 13, 14, 10, 11], [12, 13, 14, 10], [5, 6, 7]]
    sampling = SamplingParams(max_tokens=30, ignore_eos=True)
    plain, plain_steps = _generate(_scheduler(), prompts, sampling)
    scheduler = _scheduler(drafts=DRAFTS)
    drafted, steps = _generate(scheduler, prompts, sampling)
    assert drafted == plain
    assert all(len(tokens) == 30 for tokens in drafted)
    assert len(steps) < len(plain_steps)
    proposed = [len(c.spec_token_ids) for step in steps for c in step.cached_requests]
    assert max(proposed) == 3 and sum(proposed) == scheduler.spec_draft_tokens
    assert 0 < scheduler.spec_accepted_tokens < scheduler.spec_draft_tokens
    for step in steps:  # a request's step holds its last token and its drafts
        for cached in step.cached_requests:
            assert step.num_scheduled_tokens[cached.req_id] >= 1 + len(cached.spec_token_ids)
    assert scheduler.blocks.num_used == 0


def test_heuristic_draft_lengths_grow_while_drafts_are_right_and_shrink_when_not():
    """With the heuristic schedule a request whose drafts keep being accepted proposes more
    each step (3, 5, 7, ... 15), one whose drafts miss fewer (down to 1); the tokens are the
    same and, where the drafts are right, the steps fewer than with a constant 3."""
    sampling = SamplingParams(max_tokens=90, ignore_eos=True)
    heuristic = SpeculativeConfig(
        method="ngram", num_speculative_tokens=3, prompt_lookup_min=1, draft_schedule="heuristic"
    )

    def proposed(steps):
        return [len(c.spec_token_ids) for s in steps for c in s.cached_requests if c.spec_token_ids]

    def cycle(tokens):  # 10, 11, ..., 39, 10, ...: every draft found is right
        return tokens[-1] + 1 if 10 <= tokens[-1] < 39 else 10

    prompt = [[*range(10, 40), 10, 11]]
    roomy = {"budget": 32, "blocks": 64, "max_len": 128}
    constant = _generate(_scheduler(drafts=DRAFTS, **roomy), prompt, sampling, model=cycle)
    scheduler = _scheduler(drafts=heuristic, **roomy)
    tokens, steps = _generate(scheduler, prompt, sampling, model=cycle)
    assert tokens == constant[0]
    assert proposed(steps)[:4] == [3, 5, 7, 9] and max(proposed(steps)) == 15
    assert scheduler.spec_accepted_tokens == scheduler.spec_draft_tokens
    assert len(steps) < len(constant[1])

    def fresh(tokens):  # 0, 101, 0, 103, 0, ...: what follows a 0 is new each time
        return 100 + len(tokens) if tokens[-1] == 0 else 0

    start = [[5, 0, 6, 0, 7]]
    _, steps = _generate(_scheduler(drafts=DRAFTS, **roomy), start, sampling, model=fresh)
    assert proposed(steps)[-5:] == [2] * 5  # the lookups find 2 (the last 0's), both wrong
    scheduler = _scheduler(drafts=heuristic, **roomy)
    _, steps = _generate(scheduler, start, sampling, model=fresh)
    assert proposed(steps)[:3] == [2, 2, 1] and set(proposed(steps)[3:]) == {1}
    assert scheduler.spec_accepted_tokens == 0


def test_drafts_stay_within_max_tokens_the_model_length_and_the_budget():
    sampling = SamplingParams(max_tokens=11, ignore_eos=True)
    scheduler = _scheduler(budget=3, max_len=24, drafts=DRAFTS)
    outputs, steps = _generate(scheduler, [[10, 11, 12, 13, 14, 10], [12] * 8], sampling)
    assert [len(tokens) for tokens in outputs] == [11, 11]
    assert all(step.total_num_scheduled_tokens <= 3 for step in steps)
    assert scheduler.spec_accepted_tokens > 0
    # At the model's length: a 20-token prompt may reach 24 tokens, so at most 3 drafts
    # before its first token and none once one token is left.
    scheduler = _scheduler(max_len=24, drafts=DRAFTS)
    (tokens,), steps = _generate(scheduler, [[10, 11, 12, 13, 14] * 4], sampling)
    assert len(tokens) == 4 and scheduler.spec_accepted_tokens > 0
    assert all(
        len(c.spec_token_ids) <= 24 - 20 - len(tokens[: c.num_computed_tokens - 19]) - 1
        for step in steps
        for c in step.cached_requests
    )


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(max_tokens=12, temperature=0.7),
        SamplingParams(max_tokens=12, frequency_penalty=0.5),
        SamplingParams(max_tokens=12, logprobs=2),
    ],
    ids=["sampled", "penalty", "logprobs"],
)
def test_every_generating_request_gets_drafts(sampling):
    """A draft row is chosen as its token would be without drafts (its draw's seed, its
    penalties) and scored alike: no kind of generating request is left out."""
    scheduler = _scheduler(drafts=DRAFTS)
    _generate(scheduler, [[10, 11, 12, 13, 14, 10, 11]], sampling)
    assert scheduler.spec_draft_tokens > 0


def test_drafts_never_preempt_and_blocks_they_fill_are_not_cached():
    """With the cache nearly full, drafts are cut to the blocks at hand rather than preempting
    a request; only blocks of a request's own tokens are offered to the prefix cache, so a
    later request that begins with a whole answer (rejected drafts were written in its
    blocks) reads what it should (the stand-in runner checks every read)."""
    prompts = [[10, 11, 12, 13, 14, 10, 11], [12, 13, 14, 10, 11, 12]]
    sampling = SamplingParams(max_tokens=14, ignore_eos=True)
    plain_scheduler = _scheduler(blocks=8)
    plain, _ = _generate(plain_scheduler, prompts, sampling)
    assert plain_scheduler.num_preemptions == 1
    scheduler, view = _scheduler(blocks=8, drafts=DRAFTS), RunnerView(4, _cycle)
    requests = [Request(f"r{i}", list(p), sampling) for i, p in enumerate(prompts)]
    _run_all(scheduler, view, requests)
    drafted = [r.output_token_ids for r in requests]
    assert drafted == plain
    # Fewer steps may even spare a preemption; drafts taking blocks would add one here.
    assert scheduler.num_preemptions <= plain_scheduler.num_preemptions
    assert scheduler.spec_accepted_tokens < scheduler.spec_draft_tokens
    again = Request("again", prompts[0] + drafted[0], SamplingParams(max_tokens=4))
    _run_all(scheduler, view, [again])
    assert scheduler.prefix_cache_hits >= 16


def test_requests_finished_before_an_empty_step_reach_the_runners_with_a_later_one():
    """A step with no tokens is not sent (the engine drops it), so the requests that finished
    before it are named in the next step that has tokens, for the runners to drop."""
    scheduler, view = _scheduler(blocks=3), RunnerView(4)
    scheduler.add_request(Request("long", list(range(10, 18)), SamplingParams(max_tokens=3)))
    scheduler.add_request(Request("short", [1, 2, 3], SamplingParams(max_tokens=3)))
    first = scheduler.schedule()  # both in flight, every block held
    scheduler.add_request(Request("waits", list(range(30, 38)), SamplingParams(max_tokens=3)))
    scheduler.abort("short")  # its block is free, too few for the waiting request
    assert scheduler.has_schedulable()
    empty = scheduler.schedule()
    assert empty.num_scheduled_tokens == {} and empty.finished_req_ids == set()
    scheduler.update(first, view.run(first))
    second = scheduler.schedule()
    assert second.finished_req_ids == {"short"}
    assert list(second.num_scheduled_tokens) == ["long"]
