"""The engine end to end on a small real Llama: ``LLM.generate`` gives transformers' greedy
tokens with chunked prefill, preemption and concurrent requests, under uni, TP=2 and PP=2
(two batches in flight); ``LLM.embed`` gives transformers' final hidden states pooled (last
token, mean) through the runner's pool step, under the same layouts."""

import os

import pytest
import torch

from shardline.comm.waiting import host_cores
from shardline.engine import LLM, SamplingParams
from shardline.errors import ConfigError, RequestError
from support.memory_probe import bytes_held
from support.tiny_llama import round_linear_weights, write_tiny_llama
from support.tiny_tokenizer import add_tiny_tokenizer

pytestmark = pytest.mark.timeout(300)

PROMPTS = [[1, 5, 9, 33, 2, 7, 7, 80], [3, 99, 4], [7] * 21, [2, 3], [11, 12, 13, 14, 15]]
NEW_TOKENS = 20


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    """transformers' greedy continuations, and its final hidden states per prompt."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    tokens, hidden = [], []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
            )
            tokens.append(out[0, len(prompt) :].tolist())
            hidden.append(model(ids, output_hidden_states=True).hidden_states[-1][0])
    return tokens, hidden


def _llm(tiny_llama_dir, tp=1, pp=1, *extra):
    overrides = [
        f"model.path={tiny_llama_dir}",
        "cache.block_size=4",
        "cache.num_blocks=24",  # 96 slots for 5 requests growing to 41 tokens: preemption
        "scheduler.max_num_batched_tokens=8",  # long prompts arrive in chunks
        f"parallel.tensor_parallel_size={tp}",
        f"parallel.pipeline_parallel_size={pp}",
        "parallel.communicator=gloo",
        "parallel.timeout_s=60",
        *extra,
    ]
    return LLM(overrides=overrides, environ={})


def _expected_embeddings(hidden, pooling):
    vectors = [h[-1] if pooling == "last" else h.mean(dim=0) for h in hidden]
    return [torch.nn.functional.normalize(v, dim=0) for v in vectors]


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["uni", "tp2", "pp2"])
def test_generate_and_embed_match_transformers(tiny_llama_dir, reference, tp, pp):
    tokens, hidden = reference
    with _llm(tiny_llama_dir, tp, pp) as llm:
        engine = llm.engine
        depth = []
        execute = engine.executor.execute_model

        def counting(step):
            depth.append(len(engine.replicas[0].in_flight) + 1)
            return execute(step)

        engine.executor.execute_model = counting
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outputs] == tokens
        assert all(o.finish_reason == "length" for o in outputs)
        assert engine.scheduler.num_preemptions > 0
        assert max(depth) == pp, "the engine keeps one batch in flight per pipeline stage"
        embeddings = llm.embed(PROMPTS)
        # The memory plan checked before the ranks started is what they hold.
        planned = {r: share for share in engine.capacity.shares for r in share.ranks}
        for rank, (parameters, cache) in enumerate(engine.executor.collective_rpc(bytes_held)):
            assert (parameters, cache) == (planned[rank].memory.weights, planned[rank].kv_cache)
    for got, want in zip(embeddings, _expected_embeddings(hidden, "last"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_sampled_answer_is_the_same_whether_or_not_it_was_preempted(tiny_llama_dir):
    sampling = [
        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0, seed=seed)
        for seed in range(len(PROMPTS))
    ]
    with _llm(tiny_llama_dir) as llm:  # 24 cache blocks: requests are preempted
        preempted = [o.token_ids for o in llm.generate(PROMPTS, sampling)]
        assert llm.engine.scheduler.num_preemptions > 0
    with _llm(tiny_llama_dir, 1, 1, "cache.num_blocks=256") as llm:
        alone = [o.token_ids for o in llm.generate(PROMPTS, sampling)]
        assert llm.engine.scheduler.num_preemptions == 0
    assert preempted == alone


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["uni", "tp2", "pp2"])
def test_speculative_drafts_keep_transformers_tokens(tiny_llama_dir, reference, tp, pp):
    """n-gram drafts checked in the decode step: some accepted, some rejected (their cache
    positions written and then overwritten), with chunked prompts, preemption and prefix
    caching; every token is transformers' greedy one."""
    tokens, _ = reference
    with _llm(
        tiny_llama_dir, tp, pp, "speculative.method=ngram", "speculative.prompt_lookup_min=1"
    ) as llm:
        scheduler = llm.engine.scheduler
        steps = []
        execute = llm.engine.executor.execute_model
        llm.engine.executor.execute_model = lambda step: steps.append(step) or execute(step)
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outputs] == tokens
        assert scheduler.num_preemptions > 0
    drafted = [c.spec_token_ids for step in steps for c in step.cached_requests]
    assert sum(map(len, drafted)) == scheduler.spec_draft_tokens
    assert 0 < scheduler.spec_accepted_tokens < scheduler.spec_draft_tokens


def test_sampled_and_penalized_answers_are_the_same_with_drafts(tiny_llama_dir):
    """A draft's row is sampled with the seed of its output token's index and the penalties
    of the tokens before it, drafts included: the answer is what it is without drafts, and
    so are its log-probabilities where asked (a kept draft's from its own row)."""
    sampling = [
        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.5, seed=3),
        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=1.0, top_k=5),
        # Two tokens lifted above the rest alternate as each one's count penalizes it: a
        # draft row must count the drafts before it (the answer changes if it does not).
        SamplingParams(
            max_tokens=NEW_TOKENS,
            ignore_eos=True,
            frequency_penalty=2.0,
            logit_bias=((40, 100.0), (41, 100.0)),
            logprobs=3,
        ),
        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.3, top_p=0.9),
    ]
    drafts = ["speculative.method=ngram", "speculative.prompt_lookup_min=1"]
    with _llm(tiny_llama_dir, 1, 1, "cache.num_blocks=256") as llm:
        plain_outputs = llm.generate(PROMPTS, sampling)
        plain = [o.token_ids for o in plain_outputs]
    accepted = {}
    with _llm(tiny_llama_dir, 1, 1, "cache.num_blocks=256", *drafts) as llm:
        scheduler = llm.engine.scheduler
        update = scheduler.update

        def counting(step, output):
            for req_id, count in zip(
                output.req_ids, output.num_accepted_drafts or (), strict=False
            ):
                accepted[req_id] = accepted.get(req_id, 0) + count
            return update(step, output)

        scheduler.update = counting
        outputs = llm.generate(PROMPTS, sampling)
    assert [o.token_ids for o in outputs] == plain
    scored, plain_scored = outputs[2].logprobs, plain_outputs[2].logprobs
    assert len(scored) == len(plain_scored) == NEW_TOKENS
    for found, expected in zip(scored, plain_scored, strict=True):
        assert found.logprob == pytest.approx(expected.logprob, abs=1e-5)
        assert [i for i, _ in found.top] == [i for i, _ in expected.top]
    kept = [accepted.get(o.req_id, 0) for o in outputs]
    assert kept[0] + kept[1] + kept[4] > 0, kept  # sampled
    assert kept[2] > 0, kept  # penalized and scored


def test_a_stop_string_inside_a_step_of_accepted_drafts_ends_the_answer_there(tmp_path):
    """A step may add several tokens (a runner that recites its prompt, whose drafts are all
    accepted); the answer still ends at the token that completes a stop string, with the
    text, token ids and finish reason of one token a step, also where max_tokens is reached
    later in the same step."""
    model = add_tiny_tokenizer(write_tiny_llama(tmp_path))
    overrides = [
        f"model.path={model}",
        "parallel.communicator=gloo",
        "model.runner=support.reciting_runner:RecitingRunner",
    ]
    drafts = ["speculative.method=ngram", "speculative.prompt_lookup_min=1"]
    prompt = "The quick brown fox"
    cases = [(prompt[i : i + 2], limit) for i in range(1, 17) for limit in (8, 10, 40)]

    def answers(llm):
        found = []
        for stop, limit in cases:
            sampling = SamplingParams(max_tokens=limit, ignore_eos=True, stop=(stop,))
            (output,) = llm.generate([prompt], sampling)
            found.append((output.token_ids, output.text, output.finish_reason))
        return found

    with LLM(overrides=overrides, environ={}) as llm:
        plain = answers(llm)
    with LLM(overrides=[*overrides, *drafts], environ={}) as llm:
        drafted = answers(llm)
        assert llm.engine.scheduler.spec_accepted_tokens > len(cases)
    assert drafted == plain
    assert {reason for _, _, reason in plain} == {"stop", "length"}


SHARED = PROMPTS[0] + PROMPTS[1]  # 11 tokens: two whole blocks of 4, then 3
PREFIXED = [[*SHARED, 2, 3], [*SHARED, 11, 12, 13], SHARED + [7] * 5, SHARED]


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 1), (1, 2)], ids=["uni", "tp2", "pp2"])
def test_prompts_that_begin_alike_share_cached_blocks_and_keep_transformers_tokens(
    tiny_llama_dir, tp, pp
):
    """Requests admitted in one step, in steps in flight behind it (pp2) and in a later
    call start after the blocks cached before them; prompts in chunks, and preemption."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    expected = [
        model.generate(
            torch.tensor([prompt]), max_new_tokens=12, min_new_tokens=12, do_sample=False
        )[0, len(prompt) :].tolist()
        for prompt in PREFIXED
    ]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True)
    with _llm(tiny_llama_dir, tp, pp, "cache.num_blocks=16") as llm:  # preemption
        scheduler = llm.engine.scheduler
        first = [o.token_ids for o in llm.generate(PREFIXED, sampling)]
        hits_first = scheduler.prefix_cache_hits
        again = [o.token_ids for o in llm.generate(PREFIXED, sampling)]
        hits_again = scheduler.prefix_cache_hits - hits_first
        assert scheduler.num_preemptions > 0
    assert first == expected
    assert again == expected
    assert hits_first > 0
    # Every prompt again: at least the two shared blocks each (freed blocks still cached).
    assert hits_again >= 8 * len(PREFIXED)


def test_a_call_that_fails_leaves_nothing_cached_and_the_next_answers_alike(
    tiny_llama_dir, reference
):
    tokens, _ = reference

    def interrupt(output, delta):
        raise KeyboardInterrupt

    sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    with _llm(tiny_llama_dir, 1, 2, "cache.num_blocks=64") as llm:  # pp2: a step left in flight
        with pytest.raises(KeyboardInterrupt):
            llm.generate(PROMPTS[:1], sampling, stream=interrupt)
        (output,) = llm.generate(PROMPTS[:1], sampling)
        assert llm.engine.scheduler.prefix_cache_hits == 0
    assert output.token_ids == tokens[0]


def test_requests_that_no_step_can_advance_are_an_error_not_a_busy_wait(tiny_llama_dir):
    with _llm(tiny_llama_dir, 1, 1, "model.runner=support.tokenless_runner:TokenlessRunner") as llm:
        with pytest.raises(RuntimeError, match="no step can be scheduled"):
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=2))
        assert not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize("pp", [1, 2], ids=["one-stage", "pp2"])
def test_a_tied_lm_head_is_planned_as_held_and_gives_transformers_tokens(tmp_path, pp):
    """The packed head of a tied model holds its own copy of the table (the embedding keeps
    the plain one for lookups): the memory plan counts it, and greedy tokens stay
    transformers'."""
    from transformers import LlamaForCausalLM

    model = write_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    reference = LlamaForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    prompt = PROMPTS[0]
    expected = reference.generate(
        torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
    )[0, len(prompt) :].tolist()
    with _llm(model, 1, pp) as llm:
        (output,) = llm.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
        assert output.token_ids == expected
        planned = {r: share for share in llm.engine.capacity.shares for r in share.ranks}
        for rank, (parameters, _) in enumerate(llm.engine.executor.collective_rpc(bytes_held)):
            assert parameters == planned[rank].memory.weights


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_bfloat16_weights_are_planned_as_held_and_give_rounded_transformers_tokens(
    tiny_llama_dir, tp, pp
):
    """model.weight_dtype bfloat16 with float32: greedy tokens are transformers' with every
    linear weight rounded to bfloat16, and the memory plan is what the ranks hold (linear
    weights in bfloat16 where the C kernel holds them)."""
    from transformers import LlamaForCausalLM

    reference = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    round_linear_weights(reference, torch.bfloat16)
    expected = [
        reference.generate(
            torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False
        )[0, len(prompt) :].tolist()
        for prompt in PROMPTS[:2]
    ]
    with _llm(tiny_llama_dir, tp, pp, "model.weight_dtype=bfloat16") as llm:
        outputs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=8, ignore_eos=True))
        assert [out.token_ids for out in outputs] == expected
        planned = {r: share for share in llm.engine.capacity.shares for r in share.ranks}
        for rank, (parameters, _) in enumerate(llm.engine.executor.collective_rpc(bytes_held)):
            assert parameters == planned[rank].memory.weights


def test_weights_in_gguf_blocks_need_a_gguf_file(tiny_llama_dir):
    """model.weight_dtype gguf with an HF directory is refused before any rank starts, naming
    the field, the value and what the file allows."""
    with pytest.raises(ConfigError) as error:
        _llm(tiny_llama_dir, 1, 1, "model.weight_dtype=gguf")
    message = str(error.value)
    assert "model.weight_dtype = 'gguf'" in message and "is not a GGUF file" in message
    assert str(tiny_llama_dir) in message and "allowed with it: null" in message


def _rank(worker):
    return worker.rank


def _threads(worker):
    return torch.get_num_threads()


@pytest.mark.parametrize(
    ("tp", "extra"),
    [(1, []), (2, ["speculative.method=ngram", "speculative.prompt_lookup_min=1"])],
    ids=["dp2", "dp2xtp2-drafts"],
)
def test_data_parallel_replicas_share_the_requests_and_give_the_same_tokens(
    tiny_llama_dir, reference, tp, extra
):
    """Each replica schedules its own requests (with their drafts, where configured)."""
    tokens, hidden = reference
    with _llm(tiny_llama_dir, tp, 1, "parallel.data_parallel_size=2", *extra) as llm:
        engine = llm.engine
        steps = [0, 0]
        for replica in engine.replicas:
            execute = replica.executor.execute_model

            def counting(step, execute=execute, index=replica.index):
                steps[index] += 1
                return execute(step)

            replica.executor.execute_model = counting
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        assert [o.token_ids for o in outputs] == tokens
        assert all(count > 0 for count in steps), f"steps per replica: {steps}"
        if extra:
            assert all(r.scheduler.spec_accepted_tokens > 0 for r in engine.replicas)
        # Each replica is a world of its own: tp ranks, each with its own KV cache.
        assert [sorted(r.executor.collective_rpc(_rank)) for r in engine.replicas] == [
            list(range(tp))
        ] * 2
        if "OMP_NUM_THREADS" not in os.environ:
            # Every rank of both replicas shares the host's cores: 2 x tp ranks here.
            share = max(1, host_cores() // (2 * tp))
            assert {t for r in engine.replicas for t in r.executor.collective_rpc(_threads)} == {
                share
            }
        embeddings = llm.embed(PROMPTS)
    for got, want in zip(embeddings, _expected_embeddings(hidden, "last"), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_data_parallel_replicas_of_mp_start_at_once(tiny_llama_dir, monkeypatch):
    """mp declares ``starts_concurrently``: the engine builds its replicas' executors at the
    same time. Each constructor here first waits for the other to begin: started one after
    another, the first would wait alone until the barrier breaks."""
    import threading

    from shardline_executors.mp import MultiprocExecutor

    meeting = threading.Barrier(2, timeout=30)
    build = MultiprocExecutor.__init__

    def build_after_meeting(self, config):
        meeting.wait()
        build(self, config)

    monkeypatch.setattr(MultiprocExecutor, "__init__", build_after_meeting)
    with _llm(tiny_llama_dir, 1, 1, "parallel.data_parallel_size=2") as llm:
        assert [type(r.executor) for r in llm.engine.replicas] == [MultiprocExecutor] * 2
        outputs = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=2, ignore_eos=True))
        assert [len(o.token_ids) for o in outputs] == [2, 2]


def test_a_replica_that_fails_to_start_fails_the_engine_while_another_still_starts(
    tiny_llama_dir, monkeypatch
):
    """Replica 1's executor fails at once while replica 0's still starts (here it waits to
    be released, as one whose ranks are slow would): the engine raises the failure without
    waiting, and replica 0's executor, once built, is shut down by its own start: no rank
    process is left."""
    import threading
    import time

    from shardline.conformance.executors.checks import wait_gone
    from shardline_executors.mp import MultiprocExecutor

    release, shut_down = threading.Event(), threading.Event()
    built: list[MultiprocExecutor] = []
    rank_pids: list[int] = []
    build, shutdown = MultiprocExecutor.__init__, MultiprocExecutor.shutdown

    def build_or_fail(self, config):
        if config.parallel.data_parallel_rank == 1:
            raise RuntimeError("replica 1 cannot start")
        release.wait(30)
        build(self, config)
        built.append(self)

    def shutdown_and_tell(self):
        rank_pids.extend(process.pid for process in self._ranks.processes)
        shutdown(self)
        shut_down.set()

    monkeypatch.setattr(MultiprocExecutor, "__init__", build_or_fail)
    monkeypatch.setattr(MultiprocExecutor, "shutdown", shutdown_and_tell)
    begun = time.monotonic()
    with pytest.raises(RuntimeError, match="replica 1 cannot start"):
        _llm(tiny_llama_dir, 1, 1, "parallel.data_parallel_size=2")
    assert time.monotonic() - begun < 20, "the failure waited for replica 0's start"
    assert not built
    release.set()
    assert shut_down.wait(60), "replica 0's executor was not shut down once built"
    assert len(built) == 1 and len(rank_pids) == 1
    assert wait_gone(rank_pids, 5.0) == []


def test_a_new_request_goes_to_the_replica_with_the_least_outstanding_work(tiny_llama_dir):
    with _llm(tiny_llama_dir, 1, 1, "parallel.data_parallel_size=2") as llm:
        engine = llm.engine
        long = engine.add_request([1, 2, 3], SamplingParams(max_tokens=30))
        short = [engine.add_request([4, 5], SamplingParams(max_tokens=3)) for _ in range(3)]
        where = {r.req_id: engine._replica_of[r.req_id].index for r in [long, *short]}
        # 33 tokens of work on replica 0; the short ones (5 each) fill replica 1 first.
        assert where == {long.req_id: 0, short[0].req_id: 1, short[1].req_id: 1, short[2].req_id: 1}
        while engine.has_unfinished_requests():
            engine.step()
        assert engine.load().blocks_used == 0
        # Both idle: a prompt that begins as one answered on replica 1 goes where it is cached.
        llm.generate([[9] * 9, [*PROMPTS[0], 3]], SamplingParams(max_tokens=2))
        llm.generate([[*PROMPTS[0], 4]], SamplingParams(max_tokens=2))
        assert [r.scheduler.prefix_cache_hits for r in engine.replicas] == [0, 8]


def test_mean_pooling_and_unnormalized_embeddings(tiny_llama_dir, reference):
    _, hidden = reference
    with _llm(tiny_llama_dir, 1, 1, "model.pooling=mean") as llm:
        for got, want in zip(llm.embed(PROMPTS), _expected_embeddings(hidden, "mean"), strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with _llm(tiny_llama_dir, 1, 1, "model.normalize_embeddings=false") as llm:
        (got,) = llm.embed(PROMPTS[0])
    torch.testing.assert_close(got, hidden[0][-1], rtol=1e-5, atol=1e-5)


def test_streaming_sees_every_token_in_order(tiny_llama_dir, reference):
    tokens, _ = reference
    seen: dict[str, list[int]] = {}
    with _llm(tiny_llama_dir) as llm:
        outputs = llm.generate(
            PROMPTS[:2],
            SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
            stream=lambda output, delta: seen.setdefault(output.req_id, []).append(
                len(output.token_ids)
            ),
        )
    for output in outputs:
        assert seen[output.req_id] == list(range(1, NEW_TOKENS + 1))
    assert [o.token_ids for o in outputs] == tokens[:2]


def test_requests_the_engine_cannot_serve_are_refused(tiny_llama_dir):
    with _llm(tiny_llama_dir, 1, 1, "scheduler.max_model_len=16") as llm:
        with pytest.raises(RequestError, match="the prompt has 16 tokens; at most 15 fit"):
            llm.generate([list(range(1, 17))])
        with pytest.raises(RequestError, match="no tokenizer"):
            llm.generate("text needs a tokenizer")
        with pytest.raises(RequestError, match="2 sampling params for 1 prompts"):
            llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])
        # The engine is still usable after refusals.
        assert len(llm.generate([[1, 2]], SamplingParams(max_tokens=3))[0].token_ids) == 3


def test_a_steps_own_timeout_reaches_the_caller_with_its_diagnosis():
    """CommTimeoutError is a TimeoutError, as is a Future's: the engine must not mistake a
    step that failed by timing out (naming the silent rank and host) for a step that never
    answered."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    from shardline.engine.engine import LLMEngine
    from shardline.errors import CommTimeoutError

    engine = LLMEngine.__new__(LLMEngine)
    engine.config = SimpleNamespace(parallel=SimpleNamespace(timeout_s=0.1))
    failed: Future = Future()
    failed.set_exception(CommTimeoutError("all_reduce: rank 1 on host h2 did not report"))
    with pytest.raises(CommTimeoutError, match="rank 1 on host h2 did not report"):
        LLMEngine._wait(engine, failed)
    silent: Future = Future()
    with pytest.raises(CommTimeoutError, match=r"no result from the output rank within 5\.1 s"):
        LLMEngine._wait(engine, silent)


def test_a_refused_mp_config_leaves_no_fork_server_behind(tiny_llama_dir, monkeypatch):
    """mp's head start starts a fork server before the check (an environment of its own
    here, so that no earlier test's server is reused); the check refuses the config, and
    that server ends at once instead of lingering, torch imported, for a world that will not
    come."""
    from shardline.config import load_config
    from shardline.conformance.executors.checks import wait_gone
    from shardline.engine.engine import LLMEngine
    from support.processes import descendant_commands

    def fork_servers() -> set[int]:
        """This process's fork servers (and any it has forked, none here)."""
        return {
            pid
            for pid, command in descendant_commands(os.getpid()).items()
            if "shardline.launch.fork_server" in command
        }

    before = fork_servers()
    monkeypatch.setenv("SHARDLINE_TEST_OWN_FORK_SERVER", "refused-config")
    refused = load_config(
        overrides=[
            f"model.path={tiny_llama_dir}",
            "parallel.tensor_parallel_size=64",
            "parallel.distributed_executor_backend=mp",
        ],
        environ={},
    )
    with pytest.raises(ConfigError, match="tensor_parallel_size = 64"):
        LLMEngine(refused, environ={})
    started = fork_servers() - before
    assert wait_gone(sorted(started), 5.0) == []


def test_the_configured_executor_gets_its_head_start_before_the_config_is_checked(
    tiny_llama_dir,
):
    """An executor's ``prestart`` hook is called with the config before the engine checks
    it (here the check then refuses the executor, whose class does not exist); an executor
    ``auto`` does not pick gets no call."""
    from shardline.config import load_config
    from shardline.engine.engine import LLMEngine
    from shardline.registry import Component, Registry
    from support import prestart_calls

    registry = Registry(
        [
            Component(
                name="early",
                target="support.prestart_calls:NoSuchExecutor",
                prestart="support.prestart_calls:record",
                kind="executor",
                plugin="test",
            )
        ]
    )
    model = f"model.path={tiny_llama_dir}"
    prestart_calls.CALLS.clear()
    prestart_calls.UNDONE.clear()
    early = load_config(overrides=[model, "parallel.distributed_executor_backend=early"])
    with pytest.raises(ConfigError, match=r"parallel\.distributed_executor_backend"):
        LLMEngine(early, registry, environ={})
    assert [config.parallel.distributed_executor_backend for config in prestart_calls.CALLS] == [
        "early"
    ]
    assert prestart_calls.UNDONE == prestart_calls.CALLS  # refused: the head start undone
    with pytest.raises(ConfigError):  # auto picks uni for one rank: not "early"
        LLMEngine(load_config(overrides=[model]), registry, environ={})
    assert len(prestart_calls.CALLS) == 1
