"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF). Its tokenizer and chat template (read
from GGUF metadata) match transformers'; ``LLM.chat`` gives transformers' greedy answers for
three questions under TP=1, TP=2 (gloo, custom all-reduce, MPI under mpiexec) and PP=2, and
its log-probabilities of them; streamed text adds up to the answer; a stop string cuts it."""

import json

import numpy as np
import pytest
import torch

from shardline.engine import LLM, SamplingParams
from shardline.errors import ConfigError, RequestError
from shardline.launch.launchers import run_launched
from shardline.native import native_extension
from shardline.tokenizer import Tokenizer
from shardline.weights.gguf_checkpoint import GGUFCheckpoint
from shardline.weights.gguf_layout import GGUFLayout
from support.memory_probe import bytes_held
from support.quick_gguf import quick_gguf_reading
from support.run_once import computed_once
from support.smollm2 import smollm2_gguf

pytestmark = pytest.mark.timeout(600)

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]
NEW_TOKENS = 32
EMBED_TEXT = "The lighthouse keeper watched the storm roll in."
TOP_LOGPROBS = 3


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf()


def test_the_gguf_layout_reads_what_the_gguf_package_reads(gguf_path):
    """Shardline's one-pass GGUF header reader (GGUFLayout) against the gguf package's reader
    on the real file: every metadata value, and every tensor's type, dimensions, shape and
    bytes; a file cut short is a clear error."""
    import gguf

    layout, reader = GGUFLayout.read(gguf_path), gguf.GGUFReader(gguf_path)
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert layout.metadata == fields and len(fields["tokenizer.ggml.tokens"]) == 49152
    native = native_extension("shardline.weights._dequantize", {})
    if native is not None:  # its string arrays decoded in C: the same metadata
        assert GGUFLayout.read(gguf_path, native).metadata == fields
    assert sorted(layout.tensors) == sorted(t.name for t in reader.tensors)
    for expected in reader.tensors:
        got = layout.tensors[expected.name]
        assert got.tensor_type == expected.tensor_type
        assert got.shape == tuple(int(n) for n in expected.shape)
        assert got.data.shape == expected.data.shape and got.data.dtype == expected.data.dtype
        assert np.array_equal(np.asarray(got.data), np.asarray(expected.data))


def test_a_gguf_file_cut_short_is_a_clear_error(gguf_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(gguf_path.read_bytes()[:1_000_000])  # inside the tokenizer's strings
    with pytest.raises(ConfigError, match="not a readable GGUF file"):
        GGUFCheckpoint(cut)


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path):
    from transformers import AutoTokenizer

    with quick_gguf_reading():
        return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def tokenizer(gguf_path):
    return Tokenizer.from_gguf(GGUFCheckpoint(gguf_path))


def test_tokenizer_and_chat_template_match_transformers(tokenizer, reference_tokenizer):
    texts = [
        "Hello world! 12345  spaces\n\ttabs",
        "<|im_start|>user\nHi<|im_end|>\n",
        "Ünïcödé ß 日本語 🙂",
        "  x  ",
    ]
    for text in texts:
        ids = tokenizer.encode(text)
        assert ids == reference_tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    assert tokenizer.apply_chat_template(messages) == reference_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert tokenizer.eos_token_ids == {reference_tokenizer.eos_token_id}


def test_token_bytes_spell_the_text_a_character_split_over_tokens_included(tokenizer):
    text = "Paris, café 🙂 naïve 鑫"
    ids = tokenizer.encode(text)
    spelled = [tokenizer.token_bytes(token) for token in ids]
    assert b"".join(spelled) == text.encode()
    # Some token holds only part of a character: its bytes are not UTF-8 on their own.
    assert any(not _is_utf8(part) for part in spelled), spelled
    (end,) = tokenizer.encode("<|im_end|>")
    assert tokenizer.token_bytes(end) == b"<|im_end|>"


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_text_that_is_not_unicode_is_a_request_error_not_the_backends_type_error(tokenizer):
    # Bytes that are not UTF-8 reach Python as lone surrogates (arguments, input, JSON).
    with pytest.raises(RequestError, match=r"not Unicode text \(a lone surrogate at character 5\)"):
        tokenizer.encode("hello\udcff")


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def reference(gguf_path, prompts, tokenizer, tmp_path_factory):
    """What transformers makes of the real model, computed once per run (both pytest workers
    use it): ``tokens``, the greedy continuation of each prompt (shorter if it stops at EOS),
    ``prompt_logprobs``, per prompt token after the first its log-probability;
    ``logprobs``, per answer token its log-probability and the TOP_LOGPROBS most likely
    ``[id, log-probability]`` pairs (log_softmax of the logits of a forward pass over prompt
    and answer), and ``embedding``, the final hidden state of EMBED_TEXT's last token,
    L2-normalized."""

    def compute():
        from transformers import AutoModelForCausalLM

        with quick_gguf_reading():
            model = AutoModelForCausalLM.from_pretrained(
                gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
            )
        tokens, logprobs, prompt_logprobs = [], [], []
        for prompt in prompts:
            out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
            answer = out[0, len(prompt) :].tolist()
            tokens.append(answer)
            with torch.no_grad():
                every = torch.log_softmax(model(out).logits[0].float(), dim=-1)
            # Position q's distribution scores token q + 1.
            prompt_logprobs.append([every[q, prompt[q + 1]].item() for q in range(len(prompt) - 1)])
            scores = every[len(prompt) - 1 : -1]
            top = torch.topk(scores, TOP_LOGPROBS, dim=-1)
            logprobs.append(
                [
                    [scores[i, token].item(), list(zip(ids, values, strict=True))]
                    for i, (token, ids, values) in enumerate(
                        zip(answer, top.indices.tolist(), top.values.tolist(), strict=True)
                    )
                ]
            )
        ids = torch.tensor([tokenizer.encode(EMBED_TEXT)])
        with torch.no_grad():
            hidden = model(ids, output_hidden_states=True).hidden_states[-1][0, -1]
        embedding = torch.nn.functional.normalize(hidden, dim=0)
        return {
            "tokens": tokens,
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "embedding": embedding.tolist(),
        }

    return computed_once(tmp_path_factory, "smollm2-reference", compute)


@pytest.fixture(scope="module")
def reference_tokens(reference):
    return reference["tokens"]


@pytest.fixture(scope="module")
def reference_embedding(reference):
    return torch.tensor(reference["embedding"])


def test_chat_prompts_tokenize_like_transformers(prompts, reference_tokenizer):
    for question, ids in zip(QUESTIONS, prompts, strict=True):
        reference = reference_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True
        )
        if not isinstance(reference, list):  # transformers 5 returns an encoding
            reference = reference["input_ids"]
        assert ids == list(reference)


LAYOUTS = [
    ("tp1", []),
    ("tp2-gloo", ["parallel.tensor_parallel_size=2", "parallel.communicator=gloo"]),
    ("tp2-custom_ar", ["parallel.tensor_parallel_size=2", "parallel.communicator=custom_ar"]),
    ("pp2-custom_ar", ["parallel.pipeline_parallel_size=2", "parallel.communicator=custom_ar"]),
]


@pytest.mark.parametrize("overrides", [o for _, o in LAYOUTS], ids=[n for n, _ in LAYOUTS])
def test_llm_chat_gives_transformers_greedy_answers_and_logprobs(
    gguf_path, tokenizer, prompts, reference, overrides
):
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    # Every call runs with n-gram drafts: the tokens and log-probabilities are transformers'.
    drafts = ["speculative.method=ngram", "speculative.prompt_lookup_min=1"]
    with LLM(overrides=[f"model.path={gguf_path}", *overrides, *drafts], environ={}) as llm:
        scheduler = llm.engine.scheduler
        outputs = llm.chat(conversations, SamplingParams(max_tokens=NEW_TOKENS))
        assert 0 < scheduler.spec_accepted_tokens < scheduler.spec_draft_tokens
        # The prompts share the chat template's system prompt: the later ones start from the
        # blocks the first fills in the same step.
        assert scheduler.prefix_cache_hits > 0
        # Asking for log-probabilities takes the gathered logits' path, not the greedy one;
        # prompt log-probabilities compute every prompt position (no cached blocks).
        hits = scheduler.prefix_cache_hits
        accepted = scheduler.spec_accepted_tokens
        scored = llm.chat(
            conversations,
            SamplingParams(max_tokens=NEW_TOKENS, logprobs=TOP_LOGPROBS, prompt_logprobs=1),
        )
        assert scheduler.prefix_cache_hits == hits
        assert scheduler.spec_accepted_tokens > accepted  # scored drafts among them
        # Again without: each prompt starts from its blocks cached by the first call.
        cached = llm.chat(conversations, SamplingParams(max_tokens=NEW_TOKENS, logprobs=0))
        size = scheduler.block_size
        whole_blocks = sum((len(p) - 1) // size * size for p in prompts)
        assert scheduler.prefix_cache_hits >= hits + whole_blocks
    for output, scored_output in zip(cached, scored, strict=True):
        assert output.token_ids == scored_output.token_ids
        found = [token.logprob for token in output.logprobs]
        assert found == pytest.approx([token.logprob for token in scored_output.logprobs], abs=1e-4)
    for output, reference_answer in zip(outputs, reference["tokens"], strict=True):
        assert len(reference_answer) >= 8
        assert output.token_ids == reference_answer, tokenizer.decode(output.token_ids)
        assert output.text == tokenizer.decode(reference_answer)
        stopped_at_eos = reference_answer[-1] in tokenizer.eos_token_ids
        assert output.finish_reason == ("stop" if stopped_at_eos else "length")
        assert output.logprobs is None
    for output, reference_answer, reference_logprobs, reference_prompt in zip(
        scored,
        reference["tokens"],
        reference["logprobs"],
        reference["prompt_logprobs"],
        strict=True,
    ):
        assert output.prompt_logprobs[0] is None  # nothing predicts the first token
        found_prompt = [found.logprob for found in output.prompt_logprobs[1:]]
        assert found_prompt == pytest.approx(reference_prompt, abs=2e-3)
        assert all(len(found.top) == 1 for found in output.prompt_logprobs[1:])
        assert output.token_ids == reference_answer
        assert len(output.logprobs) == len(reference_answer)
        for token, found, (logprob, top) in zip(
            reference_answer, output.logprobs, reference_logprobs, strict=True
        ):
            assert found.logprob == pytest.approx(logprob, abs=2e-3)
            assert found.top[0][0] == token  # greedy: the most likely
            assert len(found.top) == TOP_LOGPROBS
            # Ids may swap only where transformers' own log-probabilities (nearly) tie.
            for (found_id, found_value), (ref_id, ref_value) in zip(found.top, top, strict=True):
                assert found_value == pytest.approx(ref_value, abs=2e-3)
                if found_id != ref_id:
                    assert any(
                        other_id == found_id and abs(other_value - ref_value) < 4e-3
                        for other_id, other_value in top
                    ), (found.top, top)


@pytest.mark.parametrize(
    "layout",
    [
        [],
        ["parallel.tensor_parallel_size=2", "parallel.communicator=custom_ar"],
        ["parallel.pipeline_parallel_size=2", "parallel.communicator=custom_ar"],
    ],
    ids=["tp1", "tp2-custom_ar", "pp2-custom_ar"],
)
def test_weights_held_in_the_files_blocks_give_the_float32_models_bits(
    gguf_path, reference, layout
):
    """``model.weight_dtype: gguf``: every linear weight and the LM head held in the file's
    own blocks (Q4_1 linears, 0.16 of float32's bytes, and a Q8_0 head, as many bytes as the
    float32 head's greedy screen), under 0.27 of the bytes float32's greedy step reads on
    every rank (0.16 on a stage without the head, 0.21 at TP=1 and 2, 0.26 on PP=2's last;
    the memory plan counted them so), and the answers and log-probabilities the float32
    model's, bit for bit (transformers' tokens)."""
    kernels = pytest.importorskip("shardline.layers._kernels", reason="C extension not built")
    if not kernels.quantized_linear_available():
        pytest.skip("weights held in quantization blocks need AVX-512 or AVX2 with F16C")
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    params = SamplingParams(max_tokens=NEW_TOKENS, logprobs=TOP_LOGPROBS)
    found = {}
    for weight_dtype in ("float32", "gguf"):
        overrides = [f"model.path={gguf_path}", f"model.weight_dtype={weight_dtype}", *layout]
        with LLM(overrides=overrides, environ={}) as llm:
            held = llm.engine.executor.collective_rpc("weight_bytes_per_step")
            planned = {r: share for share in llm.engine.capacity.shares for r in share.ranks}
            for rank, (parameters, _) in enumerate(llm.engine.executor.collective_rpc(bytes_held)):
                assert parameters == planned[rank].memory.weights  # the plan counts the blocks
            greedy = llm.chat(conversations, SamplingParams(max_tokens=NEW_TOKENS))
            scored = llm.chat(conversations, params)
        answers = [
            (o.token_ids, [(t.logprob, t.top) for t in s.logprobs], s.token_ids)
            for o, s in zip(greedy, scored, strict=True)
        ]
        found[weight_dtype] = held, answers
    (blocks_held, blocks_answers), (float32_held, float32_answers) = found["gguf"], found["float32"]
    assert blocks_answers == float32_answers
    assert [answer[0] for answer in blocks_answers] == reference["tokens"]
    assert len(blocks_held) == len(float32_held) == (2 if layout else 1)
    assert all(b < 0.27 * f for b, f in zip(blocks_held, float32_held, strict=True))


def test_another_quantizers_blocks_are_held_and_a_rank_holding_float32_is_refused(
    gguf_path, tmp_path, monkeypatch
):
    """One block of one tensor whose 4-bit values never reach 0 (its minimum then is no
    value: not what GGML's reference quantizer writes, as an importance-matrix one may) is
    held as the file has it, as planned. A rank that holds weights in float32 where the plan
    (made on the driver's host) counted blocks, as one whose CPU lacks the block kernels
    would, refuses the load naming the rank, both sizes and what to set instead."""
    kernels = pytest.importorskip("shardline.layers._kernels", reason="C extension not built")
    if not kernels.quantized_linear_available():
        pytest.skip("weights held in quantization blocks need AVX-512 or AVX2 with F16C")
    copy = tmp_path / "other-quantizer.gguf"
    copy.write_bytes(gguf_path.read_bytes())
    data = GGUFLayout.read(copy).tensors["blk.2.ffn_down.weight"].data
    root = data
    while isinstance(root.base, np.ndarray):
        root = root.base
    offset = data.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    del data, root
    with copy.open("r+b") as handle:
        handle.seek(offset + 4)  # the first Q4_1 block's values, after its scale and minimum
        handle.write(bytes([0x11] * 16))
    overrides = [f"model.path={copy}", "model.weight_dtype=gguf"]
    with LLM(overrides=overrides, environ={}) as llm:
        planned = {r: share for share in llm.engine.capacity.shares for r in share.ranks}
        ((parameters, _),) = llm.engine.executor.collective_rpc(bytes_held)
        assert parameters == planned[0].memory.weights
    from shardline.models import llama_runner

    def without_blocks(*args, quantized=False, codes=False, **rest):
        return layer_kernels(*args, quantized=False, codes=False, **rest)

    layer_kernels = llama_runner.layer_kernels
    monkeypatch.setattr(llama_runner, "layer_kernels", without_blocks)
    with pytest.raises(ConfigError, match=r"model.weight_dtype = 'gguf': rank 0 holds [\d.]+ MiB"):
        LLM(overrides=overrides, environ={})


def test_prompt_logprobs_of_a_prompt_run_in_chunks(gguf_path, prompts, reference):
    # 16 tokens a step: each ~40-token prompt is run in 3 chunks, scored a chunk at a time.
    overrides = [f"model.path={gguf_path}", "scheduler.max_num_batched_tokens=16"]
    with LLM(overrides=overrides, environ={}) as llm:
        outputs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=0))
    for output, prompt, expected in zip(
        outputs, prompts, reference["prompt_logprobs"], strict=True
    ):
        assert len(prompt) > 32
        assert len(output.prompt_logprobs) == len(prompt)
        found = [scored.logprob for scored in output.prompt_logprobs[1:]]
        assert found == pytest.approx(expected, abs=2e-3)
        assert all(scored.top == () for scored in output.prompt_logprobs[1:])


def test_penalties_and_bias_steer_greedy_answers_as_their_formulas_say(
    gguf_path, tokenizer, reference
):
    conversation = [{"role": "user", "content": QUESTIONS[2]}]
    first, top = reference["tokens"][2][0], reference["logprobs"][2][0][1]
    overrides = [f"model.path={gguf_path}", *LAYOUTS[2][1]]  # tp2 custom_ar
    with LLM(overrides=overrides, environ={}) as llm:
        (banned,) = llm.chat(
            [conversation], SamplingParams(max_tokens=2, logit_bias=((first, -100.0),))
        )
        (penalized,) = llm.chat(
            [conversation],
            SamplingParams(
                max_tokens=NEW_TOKENS, frequency_penalty=1.5, presence_penalty=0.5, logprobs=20
            ),
        )
    # Without its first token, greedy takes transformers' second most likely.
    assert top[0][0] == first and banned.token_ids[0] == top[1][0]
    assert penalized.token_ids != reference["tokens"][2]
    for step, (token, found) in enumerate(
        zip(penalized.token_ids, penalized.logprobs, strict=True)
    ):
        counts = {t: penalized.token_ids[:step].count(t) for t, _ in found.top}
        # Log-probabilities differ from logits by one constant per step: the chosen token is
        # the best of the 20 most likely once penalized (and it is one of them).
        best = max(
            found.top,
            key=lambda pair: pair[1] - 1.5 * counts[pair[0]] - 0.5 * (counts[pair[0]] > 0),
        )
        assert best[0] == token, (step, tokenizer.decode(penalized.token_ids[:step]))


def test_llm_under_mpiexec_with_mpi_gives_transformers_answers_and_embeddings(
    gguf_path, reference_tokens, reference_embedding
):
    run = run_launched(
        "mpiexec",
        2,
        [
            "-m",
            "support.llm_driver",
            str(gguf_path),
            str(NEW_TOKENS),
            *QUESTIONS,
            "--embed",
            EMBED_TEXT,
            "--",
            "parallel.tensor_parallel_size=2",
            "parallel.communicator=mpi",
            # Every process schedules the drafts itself and must agree with the others.
            "speculative.method=ngram",
            "speculative.prompt_lookup_min=1",
        ],
        timeout_s=300,
    )
    assert run.returncode == 0, run.stderr
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("{")]
    report = json.loads(line)
    assert report["executor"] == "external_launcher"
    assert report["tokens"] == reference_tokens
    assert report["drafts_accepted"] > 0
    torch.testing.assert_close(
        torch.tensor(report["embedding"]), reference_embedding, rtol=1e-4, atol=1e-4
    )
    assert run.leftovers == []


def test_streamed_text_and_stop_strings(gguf_path, tokenizer, reference_tokens):
    reference_text = tokenizer.decode(reference_tokens[1])
    stop = reference_text.split()[3]  # a word in the middle of the greedy answer
    deltas: list[str] = []
    with LLM(overrides=[f"model.path={gguf_path}"], environ={}) as llm:
        (streamed,) = llm.chat(
            [{"role": "user", "content": QUESTIONS[1]}],
            SamplingParams(max_tokens=NEW_TOKENS),
            stream=lambda output, delta: deltas.append(delta),
        )
        (stopped,) = llm.chat(
            [{"role": "user", "content": QUESTIONS[1]}],
            SamplingParams(max_tokens=NEW_TOKENS, stop=(stop,)),
        )
    assert "".join(deltas) == streamed.text == reference_text
    assert stopped.text == reference_text[: reference_text.index(stop)]
    assert stopped.finish_reason == "stop"
    assert len(stopped.token_ids) < len(reference_tokens[1])
