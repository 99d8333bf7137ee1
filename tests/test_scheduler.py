"""The continuous-batching scheduler on its own: admission under the token budget, chunked
prefill mixed with decode, block accounting, preemption and resumption, stop conditions.
Steps are answered by a stand-in for the output rank that samples ``last token + 1``; every
scheduled token count and block table is checked against what a runner could compute."""

import pytest

from shardline.config.schema import SchedulerConfig
from shardline.engine.scheduler import Request, Scheduler
from shardline.errors import RequestError
from shardline.interfaces.step import ModelRunnerOutput, SamplingParams, SchedulerOutput

EOS = 99


class RunnerView:
    """What a model runner would know: each request's tokens, blocks and computed count;
    checks every step is computable, and samples ``last + 1`` when a prompt is complete."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.tokens: dict[str, list[int]] = {}
        self.blocks: dict[str, list[int]] = {}
        self.computed: dict[str, int] = {}

    def run(self, step: SchedulerOutput) -> ModelRunnerOutput | None:
        for req_id in step.finished_req_ids:
            for table in (self.tokens, self.blocks, self.computed):
                table.pop(req_id, None)
        for new in step.new_requests:
            assert new.req_id not in self.tokens, "a request was sent as new twice"
            self.tokens[new.req_id] = list(new.prompt_token_ids)
            self.blocks[new.req_id] = list(new.block_ids)
            self.computed[new.req_id] = 0
        for cached in step.cached_requests:
            self.tokens[cached.req_id] += cached.new_token_ids
            self.blocks[cached.req_id] += cached.new_block_ids
            assert self.computed[cached.req_id] == cached.num_computed_tokens
        owners: dict[int, str] = {}
        for req_id, table in self.blocks.items():
            for block in table:
                assert block not in owners, (
                    f"block {block} owned by {owners.get(block)} and {req_id}"
                )
                owners[block] = req_id
        if not step.num_scheduled_tokens:
            return None
        sampled = []
        for req_id, count in step.num_scheduled_tokens.items():
            done = self.computed[req_id] + count
            assert done <= len(self.tokens[req_id])
            assert done <= len(self.blocks[req_id]) * self.block_size
            self.computed[req_id] = done
            complete = done == len(self.tokens[req_id])
            sampled.append(self.tokens[req_id][-1] + 1 if complete else None)
        return ModelRunnerOutput(list(step.num_scheduled_tokens), sampled)


def _scheduler(budget=16, seqs=8, blocks=32, block_size=4, max_len=64):
    config = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=budget)
    return Scheduler(
        config, block_size=block_size, num_blocks=blocks, max_model_len=max_len, eos_token_ids={EOS}
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
    for request in requests:
        scheduler.add_request(request)
    steps = []
    _drive(scheduler, view, steps)
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
