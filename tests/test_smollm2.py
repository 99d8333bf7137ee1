"""The real model: SmolLM2-135M-Instruct (Q4_1 GGUF) under TP=2 gives transformers' greedy
tokens, and its tokenizer and chat template (read from GGUF metadata) match transformers'."""

import pytest
import torch

from shardline.config import load_config
from shardline.launch.local_world import LocalWorld
from shardline.registry import Registry
from shardline.tokenizer import Tokenizer
from shardline.weights.gguf_checkpoint import GGUFCheckpoint
from shardline.worker.setup import WorkerSetup, call_worker
from support.greedy_driver import generate
from support.smollm2 import smollm2_gguf

pytestmark = pytest.mark.timeout(600)

QUESTIONS = ["What is the capital of France?", "Name three colors.", "Write a haiku about the sea."]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def gguf_path():
    return smollm2_gguf()


@pytest.fixture(scope="module")
def reference_tokenizer(gguf_path):
    from transformers import AutoTokenizer

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


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
        for q in QUESTIONS
    ]


@pytest.fixture(scope="module")
def reference_tokens(gguf_path, prompts):
    """transformers' greedy continuation of each prompt (shorter if it stops at EOS)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    result = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        result.append(out[0, len(prompt) :].tolist())
    return result


def test_chat_prompts_tokenize_like_transformers(prompts, reference_tokenizer):
    for question, ids in zip(QUESTIONS, prompts, strict=True):
        reference = reference_tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True
        )
        if not isinstance(reference, list):  # transformers 5 returns an encoding
            reference = reference["input_ids"]
        assert ids == list(reference)


@pytest.mark.parametrize("tp", [1, 2])
def test_greedy_tokens_match_transformers(gguf_path, tokenizer, prompts, reference_tokens, tp):
    config = load_config(
        overrides=[
            f"model.path={gguf_path}",
            f"parallel.tensor_parallel_size={tp}",
            "cache.num_blocks=64",
        ],
        environ={},
    ).config
    if tp == 1:
        executor = Registry.load().get("executor", "uni").load_available()(config)
        try:
            ours = generate(executor.execute_model, prompts, NEW_TOKENS, 16)
        finally:
            executor.shutdown()
    else:
        with LocalWorld(tp, WorkerSetup(config), start_timeout_s=300, call_timeout_s=300) as world:
            ours = generate(
                lambda step: world.run(call_worker, "execute_model", step)[0],
                prompts,
                NEW_TOKENS,
                16,
            )
    for tokens, reference in zip(ours, reference_tokens, strict=True):
        assert len(reference) >= 8
        assert tokens[: len(reference)] == reference, tokenizer.decode(tokens)
