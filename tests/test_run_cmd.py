"""``shardline run`` as a user types it: the built-in config (SmolLM2-135M-Instruct from the
model cache, TP=2 under mp, communicator auto) with and without a question, the chat loop,
and bad input that must end in one clear line (exit code 2), never a traceback."""

import os
import re
import signal
import subprocess

import pytest

from support.cli import SHARDLINE, shardline
from support.processes import descendant_commands
from support.smollm2 import smollm2_gguf

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def model_cache():
    """A model cache holding the catalog's SmolLM2 (the tests' copy), so nothing downloads."""
    return {"SHARDLINE_MODELS": str(smollm2_gguf().parent)}


def test_run_without_arguments_answers_the_sample_question(model_cache, own_shm):
    result = shardline("run", env=model_cache, timeout=240, wrap=own_shm.wrap)
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout
    figures = result.stderr.strip().splitlines()[-1]
    assert "tokens/s" in figures and "tp=2 pp=1, mp, custom_ar" in figures
    assert "draft" not in figures  # speculative decoding is off by default
    assert own_shm.entries() == []


def test_run_with_a_question_and_overrides(model_cache):
    result = shardline(
        "run",
        "Name three colors.",
        "--set",
        "sampling.max_tokens=5",
        "--set",
        "parallel.communicator=gloo",
        "--set",
        "speculative.method=ngram",
        env=model_cache,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "[5 tokens in" in result.stderr and "stopped: length" in result.stderr
    assert re.search(r"stopped: length; \d+ of \d+ draft tokens accepted\]", result.stderr)
    assert "gloo" in result.stderr


def test_interactive_chat_reads_until_end_of_input(model_cache):
    # A line that is not UTF-8 is refused with a message; the chat goes on.
    typed = b"\xff\xfe not text\nWhat is the capital of France?\nAnd of Italy?\n"
    result = subprocess.run(
        [SHARDLINE, "run", "--interactive", "--set", "parallel.tensor_parallel_size=1"],
        input=typed, capture_output=True, timeout=240, env={**os.environ, **model_cache},
    )  # fmt: skip
    stdout, stderr = result.stdout.decode(), result.stderr.decode()
    assert result.returncode == 0, stderr
    assert "Paris" in stdout and "Rome" in stdout
    assert stdout.count("you> ") == 4  # a refused line, two questions, then end of input
    assert "error: that line is not Unicode text (a lone surrogate at character 0)" in stderr


@pytest.mark.parametrize("question", ["", "  "])
def test_an_empty_question_is_refused_before_anything_starts(model_cache, question):
    result = shardline("run", question, env=model_cache, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr == "error: QUESTION is empty; allowed: some text (or leave it out)\n"


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--set", "model.path=no-such-model"], "nor a known model name (known: smollm2-135m)"),
        (["--set", "parallel.tensor_parallel_size=zero"], "parallel.tensor_parallel_size"),
        (["--set", "sampling.top_p=2"], "sampling.top_p = 2"),
        (["--set", "notakey"], "expected section.key=value"),
        (
            ["--set", "parallel.tensor_parallel_size=1", "--set", "scheduler.max_model_len=16"],
            "the prompt has",
        ),
        (["--set", "parallel.pipeline_parallel_size=100"], "the model has only 30 layers"),
        (["--set", "parallel.tensor_parallel_size=16"], "more than the model's 9 attention heads"),
        (["--set", "cache.num_blocks=16777216"], "the job does not fit this host"),
    ],
    ids=[
        "unknown-model",
        "bad-value",
        "out-of-range",
        "bad-set",
        "prompt-too-long",
        "stages-over-layers",
        "tp-over-heads",
        "cache-over-host",
    ],
)
def test_bad_input_gives_one_clear_line(model_cache, arguments, expected):
    result = shardline("run", *arguments, env=model_cache, timeout=240)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert expected in lines[0]


def test_a_corrupt_model_file_is_named(model_cache, tmp_path):
    corrupt = tmp_path / "broken.gguf"
    corrupt.write_bytes(b"GGUF" + os.urandom(256))
    result = shardline("run", "--set", f"model.path={corrupt}", env=model_cache)
    assert result.returncode == 2
    assert result.stderr.startswith(f"error: {corrupt}: not a readable GGUF file")
    assert len(result.stderr.strip().splitlines()) == 1


def test_an_answer_cut_short_ends_its_line_before_the_error(model_cache):
    """SIGTERM while the answer streams: the answer's line is ended, so the error line that
    follows on the terminal starts on a line of its own."""
    run = subprocess.Popen(
        [SHARDLINE, "run", "Write a very long story about a dragon.",
         "--set", "sampling.max_tokens=2000", "--set", "parallel.tensor_parallel_size=1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, **model_cache},
    )  # fmt: skip
    try:
        assert run.stdout.read(20), "no answer streamed"
        run.send_signal(signal.SIGTERM)
        rest, errors = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait(10)
    assert run.returncode == 143, errors
    assert rest.endswith(b"\n")
    assert errors.decode().strip().splitlines()[-1] == "error: terminated (SIGTERM)"


def test_a_worker_lost_while_the_chat_waits_ends_it_at_once(model_cache):
    chat = subprocess.Popen(
        [SHARDLINE, "run", "--interactive"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, env={**os.environ, **model_cache},
    )  # fmt: skip
    try:
        assert chat.stdout.read(5) == b"you> "  # the workers are up; nothing asked yet
        workers = [p for p, c in descendant_commands(chat.pid).items() if "shardline-worker" in c]
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        chat.wait(10)  # stdin stays open: no end of input
        errors = chat.stderr.read()
    finally:
        if chat.poll() is None:
            chat.kill()
            chat.wait(10)
        for pipe in (chat.stdin, chat.stdout, chat.stderr):
            pipe.close()
    assert chat.returncode == 2, errors
    last = errors.decode().strip().splitlines()[-1]
    assert re.fullmatch(r"error: worker rank \d \(pid \d+\) died with exit code -9", last), last
