import sys
from pathlib import Path

# Test helpers live in tests/support and are imported as ``support.<module>``.
sys.path.insert(0, str(Path(__file__).parent))


import pytest

from support import alone
from support.greedy_driver import GREEDY_TOKENS, PROMPT_A, PROMPT_B
from support.tiny_llama import write_tiny_llama


def pytest_configure(config):
    config.addinivalue_line("markers", alone.MARKER)


def pytest_unconfigure(config):
    alone.remove_folder(config)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    alone.hand_to_worker(node)


def pytest_collection_modifyitems(items):
    alone.first(items)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    with alone.turn(item, nextitem):
        return (yield)


@pytest.fixture
def own_shm():
    """A private /dev/shm for the commands a test runs (``own_shm.wrap(command)``): what they
    leave there is theirs alone (``own_shm.entries()``), whatever else runs on the host."""
    from shardline.launch import private_shm

    reason = private_shm.unavailable_reason()
    if reason is not None:
        pytest.skip(f"judging leaks needs a private /dev/shm: {reason}")
    with private_shm.PrivateShm() as shm:
        yield shm


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A small random Llama written by transformers (real safetensors files)."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_llama_greedy(tiny_llama_dir):
    """transformers' greedy continuations of PROMPT_A ("A") and PROMPT_B ("B")."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    result = {}
    for req_id, prompt in (("A", PROMPT_A), ("B", PROMPT_B)):
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=GREEDY_TOKENS,
            min_new_tokens=GREEDY_TOKENS,
            do_sample=False,
        )
        result[req_id] = out[0, len(prompt) :].tolist()
    return result
