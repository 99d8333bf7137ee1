"""``shardline bench serve`` as a user runs it, against a real ``shardline serve`` (the tiny
Llama with a character tokenizer and a chat template, one rank in-process): every request
succeeds with the tokens asked for, latencies are consistent (TTFT <= E2E, p50 <= p90 <= p99),
failed requests end the command with 1 after the table, and bad options or a server that is
not there end it with 2 in one line."""

from __future__ import annotations

import json
import math
import re
import socket

import pytest

from shardline.cli.bench_serve import chat_prompts, percentile
from support.cli import shardline
from support.server import Server
from support.tiny_llama import write_tiny_llama
from support.tiny_tokenizer import add_tiny_tokenizer

pytestmark = pytest.mark.timeout(120)

REQUESTS = 6
TOKENS = 8
VOCAB = 100  # the tiny Llama's


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One ``shardline serve`` shared by the tests: TP=1 under uni, context 1024."""
    model = write_tiny_llama(tmp_path_factory.mktemp("model"), max_position_embeddings=1024)
    add_tiny_tokenizer(model)
    overrides = [
        f"model.path={model}",
        "parallel.tensor_parallel_size=1",
        "parallel.distributed_executor_backend=uni",
        "cache.block_size=16",
        "cache.num_blocks=128",
    ]
    running = Server(tmp_path_factory.mktemp("server") / "serve.log", overrides)
    yield running
    running.stop()


def _bench(server: Server, tmp_path, *flags: str):
    """Run the benchmark against ``server``; its exit code, output and JSON report."""
    report = tmp_path / "report.json"
    done = shardline(
        "bench", "serve", "--url", server.url, "-n", str(REQUESTS),
        "--output-len", str(TOKENS), "--max-concurrency", "3", "--json", str(report), *flags,
    )  # fmt: skip
    return done, json.loads(report.read_text()) if report.exists() else None


@pytest.mark.parametrize(
    "flags",
    [
        ("--input-len", "16", "--vocab-size", str(VOCAB), "--request-rate", "inf"),
        ("--dataset", "chat", "--request-rate", "20", "--seed", "3"),
    ],
    ids=["random-all-at-once", "chat-poisson"],
)
def test_every_request_streams_the_tokens_asked_for(server, tmp_path, flags):
    done, report = _bench(server, tmp_path, *flags)
    assert done.returncode == 0, done.stdout + done.stderr
    for line in ("requests ok              6", "output token throughput", "TTFT", "ITL"):
        assert line in done.stdout
    records = report["requests"]
    assert len(records) == REQUESTS and all(r["ok"] for r in records)
    for record in records:
        # The tiny tokenizer declares no end of sequence, so every request runs to max_tokens.
        assert record["output_tokens"] == TOKENS
        assert 0 < record["ttft_ms"] <= record["e2e_ms"]
        # One gap between chunks with text; a token without text (<s>, say) adds none.
        assert 1 <= len(record["itl_ms"]) <= TOKENS - 1
        assert record["tpot_ms"] == pytest.approx(
            (record["e2e_ms"] - record["ttft_ms"]) / (TOKENS - 1)
        )
    summary = report["summary"]
    assert (summary["requests_ok"], summary["requests_failed"]) == (REQUESTS, 0)
    assert summary["output_tokens"] == REQUESTS * TOKENS
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[name]
        assert stats["p50"] <= stats["p90"] <= stats["p99"], (name, stats)
    starts = sorted(r["start_ms"] for r in records)
    if "chat" in flags:
        assert summary["input_tokens"] > REQUESTS  # the chat template's text, one per char
        assert starts[-1] > 0  # Poisson arrivals: not all at once
    else:
        assert summary["input_tokens"] == REQUESTS * 16


def test_failed_requests_print_the_table_and_exit_1(server, tmp_path):
    # Token ids up to 999 are outside the tiny vocabulary: the server answers 400.
    done, report = _bench(server, tmp_path, "--input-len", "16", "--vocab-size", "1000")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "requests failed          6" in done.stdout
    listed = done.stdout.split("failed requests:\n")[1].splitlines()
    assert len(listed) == 6  # five distinct errors, then the rest in one line
    assert re.fullmatch(
        r"  1 x HTTP 400: prompt: token id \d+ is outside the vocabulary \(0\.\.99\)", listed[0]
    )
    assert listed[-1] == "  1 x other errors (--json has every request's)"
    assert not any(r["ok"] for r in report["requests"])
    assert report["summary"]["ttft_ms"]["p50"] is None


def test_a_model_the_server_does_not_serve_is_refused(server):
    done = shardline("bench", "serve", "--url", f"{server.url}/v1", "--model", "nope")
    assert done.returncode == 2
    assert done.stderr.startswith("error: --model = 'nope': the server serves")


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (("--request-rate", "-1"), "--request-rate = '-1'"),
        (("--num-requests", "0"), "--num-requests = 0"),
        (("--dataset", "sharegpt"), "--dataset = 'sharegpt'"),
    ],
)
def test_a_bad_option_is_one_line_naming_it(flags, named):
    done = shardline("bench", "serve", "--url", "http://127.0.0.1:9", *flags)
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: {named}: allowed:")
    assert done.stderr.count("\n") == 1 and done.stdout == ""


def test_no_server_is_one_line_and_exit_2():
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = shardline("bench", "serve", "--url", f"http://127.0.0.1:{port}")
    assert done.returncode == 2
    assert done.stderr.startswith(f"error: --url = 'http://127.0.0.1:{port}': no server answers")
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_percentiles_interpolate_between_ranks():
    values = [1.0, 2.0, 3.0, 4.0]
    assert [percentile(values, q) for q in (0, 50, 90, 100)] == pytest.approx([1, 2.5, 3.7, 4])
    assert percentile([5.0], 99) == 5.0
    assert math.isclose(percentile([0.0, 10.0], 99), 9.9)


def test_the_chat_dataset_has_twenty_questions():
    questions = chat_prompts()
    assert len(questions) == 20 and len(set(questions)) == 20
