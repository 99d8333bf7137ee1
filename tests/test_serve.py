"""``shardline serve`` as clients meet it: a real server process (the tiny Llama with a
character tokenizer and a chat template, TP=2 under mp), real HTTP, the official ``openai``
client (sync, async, streaming) and raw server-sent events through httpx. Greedy text through
the server equals ``LLM.generate`` offline; bad requests get OpenAI's error shape naming the
field; the API key guards every endpoint but /health; a full queue answers 503 with
Retry-After; a client that goes away frees its KV blocks at once; a worker killed with SIGKILL
ends the open stream with an error event, /health says 503, and the server restarts its ranks
and serves again. Every server is stopped, and its workers are gone, when its tests end."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from shardline.conformance.executors.checks import wait_gone
from support.cli import shardline
from support.server import Server
from support.tiny_llama import write_tiny_llama
from support.tiny_tokenizer import CHARACTERS, SPECIAL, add_tiny_tokenizer

pytestmark = pytest.mark.timeout(120)

API_KEY = "test-key"
PROMPTS = ["Hello", "The cat", "x", "Once upon a time"]
TOKENS = 12
PENALTIES = {"frequency_penalty": 1.0, "presence_penalty": 0.5, "repetition_penalty": 1.3}
#: Long enough to still be running when a test acts on it (~20 ms per step on 2 cores).
LONG = 900


def _overrides(model_dir: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model_dir}",
        "parallel.tensor_parallel_size=2",
        "parallel.distributed_executor_backend=mp",
        "parallel.communicator=gloo",
        "cache.block_size=16",
        "cache.num_blocks=128",
        "sampling.max_tokens=16",
        *extra,
    ]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny Llama (context 1024) with tokenizer files: text, chat and long streams."""
    directory = write_tiny_llama(tmp_path_factory.mktemp("served"), max_position_embeddings=1024)
    return add_tiny_tokenizer(directory)


@pytest.fixture(scope="module")
def offline(model_dir):
    """``LLM.generate``, ``LLM.chat`` and ``LLM.embed`` on the server's config, greedy."""
    from shardline.engine import LLM, SamplingParams

    greedy = SamplingParams(max_tokens=TOKENS)
    with LLM(overrides=_overrides(model_dir), environ={}) as llm:
        chat = llm.chat([{"role": "user", "content": "hi"}], greedy)[0]
        return {
            "texts": [out.text for out in llm.generate(PROMPTS, greedy)],
            "ids": llm.generate([[5, 6, 7]], greedy)[0].text,
            "long": llm.generate("Hello", SamplingParams(max_tokens=40))[0].text,
            "chat": chat.text,
            "embeddings": [v.tolist() for v in llm.embed(["Hello", "abc"])],
            "scored": llm.generate(
                "Hello", SamplingParams(max_tokens=TOKENS, logprobs=2, prompt_logprobs=2)
            )[0],
            "penalized": llm.generate("Hello", SamplingParams(max_tokens=TOKENS, **PENALTIES))[
                0
            ].text,
            # What n = 3 choices with seed 7 draw: seeds 7, 8 and 9, in one batch.
            "choices": [
                out.text
                for out in llm.generate(
                    ["Hello"] * 3,
                    [
                        SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=7 + i)
                        for i in range(3)
                    ],
                )
            ],
        }


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    """A server with an API key (from the environment) and speculative decoding, shared by
    the tests that leave it as they found it."""
    log = tmp_path_factory.mktemp("server") / "serve.log"
    # With n-gram drafts: its greedy answers must still be the offline engine's (without).
    overrides = _overrides(model_dir, "speculative.method=ngram", "speculative.prompt_lookup_min=1")
    running = Server(log, overrides, env={"SHARDLINE_API_KEY": API_KEY})
    yield running
    running.stop()


@pytest.fixture(scope="module")
def narrow_server(model_dir, tmp_path_factory):
    """One request in the batch and one waiting at most: queue limits and worker deaths."""
    log = tmp_path_factory.mktemp("narrow") / "serve.log"
    overrides = _overrides(model_dir, "scheduler.max_num_seqs=1", "serve.max_waiting_requests=1")
    running = Server(log, overrides, background=True)
    yield running
    running.stop(signal.SIGINT)  # stops it, and exits with 130, though started SIGINT-ignored


def _client(server: Server, key: str = API_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0, timeout=30)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


async def _streaming(stream: httpx.Response):
    """The lines of an event stream, once its first ``data:`` line has come (the request is
    in the running batch)."""
    events = stream.aiter_lines()
    while not (await anext(events)).startswith("data: "):
        pass
    return events


async def _error_event(events, since: float) -> tuple[dict | None, float | None]:
    """The next error event of a stream's lines and the seconds from ``since`` until it came;
    (None, None) when the stream ends without one."""
    async for line in events:
        if line.startswith('data: {"error"'):
            return json.loads(line[6:])["error"], time.monotonic() - since
    return None, None


def _sse(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of an event stream, as they arrive."""
    return [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


# ---- the OpenAI client ---------------------------------------------------------------------


def test_models_names_the_served_model(server, model_dir):
    (card,) = _client(server).models.list().data
    assert card.id == str(model_dir) and card.owned_by == "shardline"


def test_completions_equal_offline_generate(server, model_dir, offline):
    client = _client(server)
    for prompt, expected in zip(PROMPTS, offline["texts"], strict=True):
        result = client.completions.create(
            model=str(model_dir), prompt=prompt, max_tokens=TOKENS, temperature=0
        )
        assert result.choices[0].text == expected
        assert result.choices[0].finish_reason == "length"
        assert result.usage.completion_tokens == TOKENS
        assert result.usage.prompt_tokens == len(prompt)  # one token per character
    by_ids = client.completions.create(
        model=str(model_dir), prompt=[5, 6, 7], max_tokens=TOKENS, temperature=0
    )
    assert by_ids.choices[0].text == offline["ids"]


def test_an_answer_is_stamped_with_the_time_its_request_came(server, model_dir):
    time.sleep(1.1)  # past the second the server started in
    before = int(time.time())
    result = _client(server).completions.create(model=str(model_dir), prompt="a", max_tokens=1)
    assert before <= result.created <= time.time()


def test_chat_completion_through_the_template_and_a_stop_string(server, model_dir, offline):
    client = _client(server)
    messages = [{"role": "user", "content": "hi"}]
    answer = client.chat.completions.create(
        model=str(model_dir), messages=messages, max_tokens=TOKENS, temperature=0
    )
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == offline["chat"]
    assert answer.usage.prompt_tokens == len("user: hi\nassistant:")
    stop = offline["long"][20:22]
    stopped = client.completions.create(
        model=str(model_dir), prompt="Hello", max_tokens=40, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == offline["long"][: offline["long"].index(stop)]


def test_streaming_gives_each_steps_tokens_as_made_and_usage_last(server, model_dir, offline):
    client = _client(server)
    chunks = list(
        client.completions.create(
            model=str(model_dir),
            prompt=PROMPTS[0],
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == offline["texts"][0]
    # One chunk per step: a token (a character) each, or more where drafts were accepted.
    assert all(texts) and TOKENS / 4 <= len(texts) < TOKENS
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == TOKENS
    chat = list(
        client.chat.completions.create(
            model=str(model_dir),
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=TOKENS,
            temperature=0,
            stream=True,
        )
    )
    assert chat[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chat) == offline["chat"]
    assert chat[-1].choices[0].finish_reason == "length"


def test_logprobs_equal_offline_in_both_shapes_whole_and_streamed(server, model_dir, offline):
    scored = offline["scored"]  # greedy "Hello", 2 alternatives per token
    spelled = [[*SPECIAL, *CHARACTERS][token] for token in scored.token_ids]
    values = [found.logprob for found in scored.logprobs]
    client = _client(server)
    asked = {"model": str(model_dir), "max_tokens": TOKENS, "temperature": 0}
    whole = client.completions.create(prompt="Hello", logprobs=2, **asked).choices[0]
    assert whole.text == offline["texts"][0]
    assert whole.logprobs.tokens == spelled
    assert whole.logprobs.token_logprobs == pytest.approx(values, abs=1e-6)
    assert whole.logprobs.text_offset == [sum(map(len, spelled[:i])) for i in range(TOKENS)]
    for top, found, token in zip(
        whole.logprobs.top_logprobs, scored.logprobs, spelled, strict=True
    ):
        # The 2 most likely, the chosen (greedy: the first) among them.
        assert list(top) == [[*SPECIAL, *CHARACTERS][i] for i, _ in found.top]
        assert list(top.values()) == pytest.approx([v for _, v in found.top], abs=1e-6)
        assert top[token] == pytest.approx(found.logprob, abs=1e-6)
    streamed = [
        chunk.choices[0].logprobs
        for chunk in client.completions.create(prompt="Hello", logprobs=2, stream=True, **asked)
        if chunk.choices and chunk.choices[0].logprobs is not None
    ]
    for field in ("tokens", "text_offset", "token_logprobs"):
        joined = [value for part in streamed for value in getattr(part, field)]
        assert joined == getattr(whole.logprobs, field), field
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(
        messages=messages, logprobs=True, top_logprobs=2, **asked
    ).choices[0]
    assert chat.message.content == offline["chat"]
    assert len(chat.logprobs.content) == TOKENS
    for entry in chat.logprobs.content:
        assert bytes(entry.bytes).decode() == entry.token and entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token  # greedy
    chunks = client.chat.completions.create(messages=messages, logprobs=True, stream=True, **asked)
    content = [
        e
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert [e.token for e in content] == [e.token for e in chat.logprobs.content]
    assert all(e.top_logprobs == [] for e in content)  # top_logprobs left out: none
    plain = client.chat.completions.create(messages=messages, **asked).choices[0]
    assert plain.logprobs is None


def test_echo_begins_the_answer_with_the_prompt_and_its_logprobs(server, model_dir, offline):
    scored = offline["scored"]  # "Hello" with its prompt's scores
    client = _client(server)
    asked = {"model": str(model_dir), "prompt": "Hello", "max_tokens": TOKENS, "temperature": 0}
    plain = client.completions.create(echo=True, **asked).choices[0]
    assert plain.text == "Hello" + offline["texts"][0] and plain.logprobs is None
    whole = client.completions.create(echo=True, logprobs=2, **asked).choices[0]
    assert whole.text == plain.text
    assert whole.logprobs.tokens[:5] == list("Hello")
    assert whole.logprobs.token_logprobs[0] is None and whole.logprobs.top_logprobs[0] is None
    expected = [found.logprob for found in scored.prompt_logprobs[1:]]
    assert whole.logprobs.token_logprobs[1:5] == pytest.approx(expected, abs=1e-6)
    assert [len(top) for top in whole.logprobs.top_logprobs[1:5]] == [
        len({i for i, _ in found.top} | {token})
        for found, token in zip(
            scored.prompt_logprobs[1:], scored.prompt_token_ids[1:], strict=True
        )
    ]
    assert len(whole.logprobs.tokens) == 5 + TOKENS
    assert whole.logprobs.text_offset == list(range(5 + TOKENS))  # a character a token
    streamed = list(client.completions.create(echo=True, logprobs=2, stream=True, **asked))
    assert "".join(c.choices[0].text for c in streamed) == whole.text
    assert [
        value
        for c in streamed
        if c.choices[0].logprobs
        for value in c.choices[0].logprobs.token_logprobs
    ] == whole.logprobs.token_logprobs


def test_penalties_and_logit_bias_equal_offline(server, model_dir, offline):
    client = _client(server)
    asked = {"model": str(model_dir), "prompt": "Hello", "max_tokens": TOKENS, "temperature": 0}
    penalized = client.completions.create(
        **asked,
        frequency_penalty=PENALTIES["frequency_penalty"],
        presence_penalty=PENALTIES["presence_penalty"],
        extra_body={"repetition_penalty": PENALTIES["repetition_penalty"]},  # vLLM's
    )
    assert penalized.choices[0].text == offline["penalized"] != offline["texts"][0]
    first = CHARACTERS.index(offline["texts"][0][0]) + len(SPECIAL)
    banned = client.completions.create(**asked, logit_bias={str(first): -100})
    assert banned.choices[0].text[0] != offline["texts"][0][0]


def test_n_choices_draw_apart_repeat_with_a_seed_and_stream_by_index(server, model_dir, offline):
    client = _client(server)
    asked = {"model": str(model_dir), "max_tokens": TOKENS, "temperature": 1.0, "seed": 7}
    whole = client.completions.create(prompt="Hello", n=3, **asked)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    assert [c.text for c in whole.choices] == offline["choices"]
    assert len(set(offline["choices"])) > 1  # the choices drew apart
    assert whole.usage.completion_tokens == 3 * TOKENS
    streamed = {0: "", 1: "", 2: ""}
    finished = set()
    for chunk in client.completions.create(prompt="Hello", n=3, stream=True, **asked):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
    assert list(streamed.values()) == offline["choices"] and finished == {0, 1, 2}
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(messages=messages, n=2, **asked)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content != chat.choices[1].message.content
    opened = [
        choice.index
        for chunk in client.chat.completions.create(messages=messages, n=2, stream=True, **asked)
        for choice in chunk.choices
        if choice.delta.role == "assistant"
    ]
    assert opened == [0, 1]


def test_async_clients_share_the_running_batch(server, model_dir, offline):
    async def ask_all():
        client = openai.AsyncOpenAI(
            base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=30
        )
        async with client:
            results = await asyncio.gather(
                *(
                    client.completions.create(
                        model=str(model_dir), prompt=p, max_tokens=TOKENS, temperature=0
                    )
                    for p in PROMPTS
                )
            )
        return [r.choices[0].text for r in results]

    assert asyncio.run(ask_all()) == offline["texts"]


def test_a_request_joins_a_running_stream(server, model_dir, offline):
    """Continuous batching: a short request arriving while a long stream runs is answered
    while that stream goes on, not after it."""
    long = {"model": str(model_dir), "prompt": "Hello", "max_tokens": LONG, "stream": True}
    url = f"{server.url}/v1/completions"
    with (
        httpx.Client(timeout=30, headers=_auth()) as client,
        client.stream("POST", url, json=long) as stream,
    ):
        events = stream.iter_lines()
        while not next(events).startswith("data: "):
            pass
        short = _client(server).completions.create(
            model=str(model_dir), prompt=PROMPTS[1], max_tokens=TOKENS, temperature=0
        )
        assert short.choices[0].text == offline["texts"][1]
        chunk = json.loads(next(e for e in events if e.startswith("data: "))[6:])
        assert chunk["choices"][0]["finish_reason"] is None  # the long one still runs


def test_embeddings_equal_offline_embed(server, model_dir, offline):
    result = _client(server).embeddings.create(model=str(model_dir), input=["Hello", "abc"])
    assert [d.index for d in result.data] == [0, 1]
    assert result.usage.prompt_tokens == 8
    for got, expected in zip(result.data, offline["embeddings"], strict=True):
        assert got.embedding == pytest.approx(expected, abs=1e-6)
    as_floats = httpx.post(
        f"{server.url}/v1/embeddings",
        json={"model": str(model_dir), "input": "Hello", "encoding_format": "float"},
        headers=_auth(),
        timeout=30,
    ).json()
    assert as_floats["data"][0]["embedding"] == pytest.approx(offline["embeddings"][0], abs=1e-6)


# ---- raw HTTP --------------------------------------------------------------------------------


def test_raw_event_stream(server, model_dir, offline):
    body = {"model": str(model_dir), "prompt": "Hello", "max_tokens": TOKENS, "stream": True}
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=_auth(), timeout=30
    ) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = _sse(response)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == offline["texts"][0]


@pytest.mark.parametrize(
    ("path", "change", "param", "fragment"),
    [
        ("completions", {"model": "gpt-4"}, "model", "serves"),
        ("completions", {"prompt": "a" * 1024}, "prompt", "at most 1023 fit"),
        ("completions", {"max_tokens": 0}, "max_tokens", "must be at least 1"),
        ("completions", {"max_tokens": 1020}, "max_tokens", "at most 1019 can be generated"),
        ("completions", {"max_tokens": "5"}, "max_tokens", "valid integer"),
        ("completions", {"temperature": "hot"}, "temperature", "valid number"),
        ("completions", {"prompt": 5}, "prompt", "allowed: str, list[int]"),
        ("completions", {"prompt": [7, 100]}, "prompt", "outside the vocabulary"),
        ("completions", {"n": 0}, "n", "greater than or equal to 1"),
        ("completions", {"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
        ("completions", {"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
        ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", "key 'abc' is not a token id"),
        ("completions", {"logit_bias": {"100": 1}}, "logit_bias", "allowed: 0 to 99"),
        ("completions", {"logit_bias": {"5": 101}}, "logit_bias.5", "less than or equal to 100"),
        ("completions", {"n": 129}, "n", "less than or equal to 128"),
        ("embeddings", {"input": ["a"] * 2049}, "input", "2049 inputs: allowed: at most 2048"),
        ("completions", {"logprobs": 21}, "logprobs", "less than or equal to 20"),
        ("completions", {"logprobs": -1}, "logprobs", "greater than or equal to 0"),
        ("chat/completions", {"top_logprobs": 2}, "top_logprobs", "needs logprobs = true"),
        (
            "chat/completions",
            {"logprobs": True, "top_logprobs": 21},
            "top_logprobs",
            "less than or equal to 20",
        ),
        ("completions", {"stop": [""]}, "stop", "empty stop string"),
        ("completions", {"stop": ["a"] * 17}, "stop", "17 strings; allowed: at most 16"),
        ("completions", {"prompt": None}, "prompt", "allowed"),
        ("chat/completions", {"messages": []}, "messages", "at least 1 item"),
        ("chat/completions", {"messages": [{"content": "hi"}]}, "messages.0.role", "required"),
        (
            "chat/completions",
            {"messages": [{"role": "bogus", "content": "hi"}]},
            "messages.0.role",
            "'system', 'developer', 'user', 'assistant', 'tool' or 'function'",
        ),
        ("embeddings", {"input": ["a", ""]}, "input.1", "empty"),
        # JSON's \ud800 escape makes text no tokenizer takes.
        ("completions", {"prompt": "a\ud800"}, "prompt", "not Unicode text (a lone surrogate"),
        (
            "chat/completions",
            {"messages": [{"role": "user", "content": "\udcff"}]},
            "messages.0.content",
            "not Unicode text",
        ),
        ("embeddings", {"input": ["a", "\ud800"]}, "input.1", "not Unicode text"),
    ],
)
def test_bad_requests_get_openais_error_shape(server, model_dir, path, change, param, fragment):
    body = {"model": str(model_dir), "prompt": "Hello", "max_tokens": 4}
    if path == "chat/completions":
        body = {"model": str(model_dir), "messages": [{"role": "user", "content": "hi"}]}
    elif path == "embeddings":
        body = {"model": str(model_dir), "input": "Hello"}
    response = httpx.post(
        f"{server.url}/v1/{path}",
        content=json.dumps(body | change),  # ASCII: \ud800 travels as JSON writes it
        headers=_auth() | {"content-type": "application/json"},
        timeout=30,
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert fragment in error["message"]


def test_malformed_json_and_unknown_paths(server):
    bad = httpx.post(
        f"{server.url}/v1/completions",
        content=b"{not json",
        headers=_auth() | {"content-type": "application/json"},
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    not_text = httpx.post(
        f"{server.url}/v1/completions",
        content=b'{"model": "m", "prompt": "\xff\xfe"}',
        headers=_auth() | {"content-type": "application/json"},
        timeout=30,
    )
    assert not_text.status_code == 400, not_text.text
    assert not_text.json()["error"]["code"] == "invalid_json"
    assert "not valid JSON (UTF-8 text)" in not_text.json()["error"]["message"]
    as_form = httpx.post(  # curl -d's default content type
        f"{server.url}/v1/completions",
        content=b'{"model": "m", "prompt": "a"}',
        headers=_auth() | {"content-type": "application/x-www-form-urlencoded"},
        timeout=30,
    )
    assert as_form.status_code == 400 and as_form.json()["error"]["code"] == "invalid_json"
    assert "Content-Type: application/json" in as_form.json()["error"]["message"]
    wrong_method = httpx.get(f"{server.url}/v1/completions", headers=_auth(), timeout=30)
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"
    missing = httpx.get(f"{server.url}/v1/nothing", headers=_auth(), timeout=30)
    assert missing.status_code == 404 and "/v1/nothing" in missing.json()["error"]["message"]


def test_a_body_over_the_limit_is_refused_before_it_is_held(server, model_dir):
    from shardline.serve.app import MAX_BODY_BYTES

    headers = _auth() | {"content-type": "application/json"}
    url = f"{server.url}/v1/completions"
    body = json.dumps({"model": str(model_dir), "prompt": "x" * MAX_BODY_BYTES}).encode()
    declared = httpx.post(url, content=body, headers=headers, timeout=60)
    assert declared.status_code == 413, declared.text
    error = declared.json()["error"]
    assert error["code"] == "body_too_large"
    assert error["message"] == (
        f"the request body has {len(body)} bytes; allowed: at most {MAX_BODY_BYTES} bytes"
    )

    def chunks():  # no Content-Length: counted as it arrives
        for start in range(0, len(body), 1 << 20):
            yield body[start : start + (1 << 20)]

    streamed = httpx.post(url, content=chunks(), headers=headers, timeout=60)
    assert streamed.status_code == 413, streamed.text
    assert streamed.json()["error"]["message"].startswith(
        f"the request body has more than {MAX_BODY_BYTES} bytes"
    )
    # The server still answers.
    fine = {"model": str(model_dir), "prompt": "Hello", "max_tokens": 2}
    assert httpx.post(url, json=fine, headers=_auth(), timeout=60).status_code == 200


def test_api_key_guards_everything_but_health(server, model_dir):
    for key in (None, "wrong"):
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        for method, path in (
            ("GET", "/v1/models"),
            ("GET", "/metrics"),
            ("POST", "/v1/completions"),
        ):
            response = httpx.request(method, f"{server.url}{path}", headers=headers, timeout=30)
            assert response.status_code == 401, (key, path)
            assert response.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        _client(server, key="wrong").models.list()
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200


def test_disconnected_clients_free_their_kv_blocks_at_once(server, model_dir):
    blocks = "shardline_kv_cache_blocks_used"
    aborted = ("shardline_requests_finished_total", '{reason="abort"}')
    assert server.metric(blocks, key=API_KEY) == 0  # idle
    before = server.metric(*aborted, key=API_KEY)
    body = {"model": str(model_dir), "prompt": "Hello", "max_tokens": LONG, "stream": True}
    with httpx.Client(timeout=30, headers=_auth()) as client, contextlib.ExitStack() as open_:
        readers = []  # kept: a reader collected early would close its stream
        for _ in range(2):
            response = open_.enter_context(
                client.stream("POST", f"{server.url}/v1/completions", json=body)
            )
            readers.append(response.iter_lines())
            while not next(readers[-1]).startswith("data: "):
                pass
        assert server.metric(blocks, key=API_KEY) >= 2  # a block each at least
    with pytest.raises(httpx.ReadTimeout):  # a client that stops waiting for a whole answer
        httpx.post(
            f"{server.url}/v1/completions",
            json=body | {"stream": False},
            headers=_auth(),
            timeout=httpx.Timeout(30, read=0.5),
        )
    deadline = time.monotonic() + 3.0
    while server.metric(blocks, key=API_KEY) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metric(blocks, key=API_KEY) == 0
    assert server.metric(*aborted, key=API_KEY) == before + 3
    assert server.metric("shardline_requests_running", key=API_KEY) == 0


def test_metrics_report_tokens_and_latencies(server):
    for name in (
        "shardline_prompt_tokens_total",
        "shardline_generation_tokens_total",
        "shardline_time_to_first_token_seconds_count",
        "shardline_inter_token_latency_seconds_count",
        "shardline_kv_cache_blocks_total",
    ):
        assert server.metric(name, key=API_KEY) > 0, name
    assert server.metric("shardline_engine_restarts_total", key=API_KEY) == 0
    drafted = server.metric("shardline_spec_decode_draft_tokens_total", key=API_KEY)
    accepted = server.metric("shardline_spec_decode_accepted_tokens_total", key=API_KEY)
    assert 0 < accepted < drafted


def test_a_repeated_prompt_is_counted_in_the_prefix_cache_metrics(server, model_dir):
    queries, hits = "shardline_prefix_cache_queries_total", "shardline_prefix_cache_hits_total"
    before = (server.metric(queries, key=API_KEY), server.metric(hits, key=API_KEY))
    body = {"model": str(model_dir), "prompt": "the same long beginning " * 8, "max_tokens": 2}
    answers = [
        httpx.post(f"{server.url}/v1/completions", json=body, headers=_auth(), timeout=60).json()
        for _ in range(2)
    ]
    assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]
    prompt_tokens = answers[0]["usage"]["prompt_tokens"]
    assert prompt_tokens > 16  # one whole block of 16 at least
    assert server.metric(queries, key=API_KEY) - before[0] == 2 * prompt_tokens
    # The second found every whole block short of its last token.
    assert server.metric(hits, key=API_KEY) - before[1] >= (prompt_tokens - 1) // 16 * 16


# ---- limits and failures ---------------------------------------------------------------------


def test_a_full_queue_answers_503_with_retry_after(narrow_server, model_dir):
    long = {"model": str(model_dir), "prompt": "Hello", "max_tokens": LONG, "stream": True}
    url = f"{narrow_server.url}/v1/completions"
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url, json=long) as running:
            lines = running.iter_lines()
            while not next(lines).startswith("data: "):
                pass  # in the batch, which holds one
            with client.stream("POST", url, json=long) as waiting:
                assert waiting.status_code == 200  # queued: the one place in the queue
                refused = client.post(url, json=long | {"stream": False})
                # More prompts than the queue holds wait only alone.
                embeddings = {"model": str(model_dir), "input": ["a", "b", "c"]}
                refused_too = client.post(f"{narrow_server.url}/v1/embeddings", json=embeddings)
        for answer in (refused, refused_too):
            assert answer.status_code == 503
            assert answer.headers["retry-after"] == "1"
            assert answer.json()["error"]["code"] == "queue_full"
    deadline = time.monotonic() + 3.0
    while narrow_server.metric("shardline_kv_cache_blocks_used") and time.monotonic() < deadline:
        time.sleep(0.05)
    assert narrow_server.metric("shardline_kv_cache_blocks_used") == 0
    # Nothing waits now: they are queued, and served.
    vectors = httpx.post(f"{narrow_server.url}/v1/embeddings", json=embeddings, timeout=60)
    assert vectors.status_code == 200 and len(vectors.json()["data"]) == 3
    choices = httpx.post(url, json=long | {"stream": False, "n": 3, "max_tokens": 2}, timeout=60)
    assert choices.status_code == 200 and len(choices.json()["choices"]) == 3


def test_a_killed_worker_fails_open_requests_then_the_server_recovers(
    narrow_server, model_dir, offline
):
    url = narrow_server.url
    long = {"model": str(model_dir), "prompt": "Hello", "max_tokens": LONG, "stream": True}
    metrics = f"{url}/metrics"
    old_workers = narrow_server.workers()
    assert len(old_workers) == 2

    async def scenario():
        async with httpx.AsyncClient(timeout=30) as client:
            async with client.stream("POST", f"{url}/v1/completions", json=long) as stream:
                events = await _streaming(stream)
                queued = asyncio.ensure_future(
                    client.post(f"{url}/v1/completions", json=long | {"stream": False})
                )
                while "shardline_requests_waiting 1.0" not in (await client.get(metrics)).text:
                    await asyncio.sleep(0.02)  # the queued request waits in the engine
                os.kill(old_workers[1], signal.SIGKILL)
                error, error_at = await _error_event(events, since=time.monotonic())
                health = await client.get(f"{url}/health")
                refused = await client.post(f"{url}/v1/completions", json=long)
                rest = [line async for line in events if line.startswith("data: ")]
            return error, error_at, await queued, health, refused, rest

    error, error_at, queued, health, refused, rest = asyncio.run(scenario())
    assert error["code"] == "engine_failed" and "rank 1" in error["message"]
    assert error_at < 2.0
    assert rest == ["data: [DONE]"]
    assert queued.status_code == 503 and queued.json()["error"]["code"] == "engine_failed"
    assert health.status_code == 503
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert wait_gone(old_workers, 5.0) == []
    deadline = time.monotonic() + 60
    while httpx.get(f"{url}/health", timeout=10).status_code != 200:
        assert time.monotonic() < deadline, narrow_server.log.read_text()
        time.sleep(0.2)
    assert narrow_server.metric("shardline_engine_restarts_total") == 1
    assert narrow_server.metric("shardline_requests_finished_total", '{reason="error"}') == 2
    again = _client(narrow_server).completions.create(
        model=str(model_dir), prompt=PROMPTS[0], max_tokens=TOKENS, temperature=0
    )
    assert again.choices[0].text == offline["texts"][0]
    assert len(narrow_server.workers()) == 2


def test_stopping_lets_open_requests_finish_then_ends_the_rest_with_an_error(
    model_dir, offline, tmp_path
):
    running = Server(tmp_path / "serve.log", _overrides(model_dir), "--api-key", API_KEY)
    url = f"{running.url}/v1/completions"
    long = {"model": str(model_dir), "prompt": "Hello", "max_tokens": LONG, "stream": True}
    short = long | {"max_tokens": 40, "stream": False, "temperature": 0}

    async def scenario():
        async with httpx.AsyncClient(timeout=30, headers=_auth()) as client:
            async with client.stream("POST", url, json=long) as stream:
                events = await _streaming(stream)
                finishing = asyncio.ensure_future(client.post(url, json=short))
                while running.metric("shardline_requests_running", key=API_KEY) < 2:
                    await asyncio.sleep(0.02)
                running.process.send_signal(signal.SIGTERM)
                error, error_at = await _error_event(events, since=time.monotonic())
                rest = [line async for line in events if line.startswith("data: ")]
            return error, error_at, rest, await finishing

    try:
        error, error_at, rest, finished = asyncio.run(scenario())
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{running.url}/health", timeout=5)  # no new connection once told
        assert running.process.wait(15) == 128 + signal.SIGTERM
    finally:
        running.stop()
    assert finished.status_code == 200, finished.text  # done within the grace: answered whole
    assert finished.json()["choices"][0]["text"] == offline["long"]
    assert error is not None and error["code"] == "shutting_down", running.log.read_text()
    assert error["message"] == "the server is shutting down; the request was not completed"
    assert 4.0 < error_at < 8.0  # the grace (5 s), then at once
    assert rest == ["data: [DONE]"]
    log = running.log.read_text()
    assert "Traceback" not in log and "Cancel" not in log, log


def test_an_engine_that_fails_while_the_server_drains_is_not_restarted(model_dir, tmp_path):
    running = Server(tmp_path / "serve.log", _overrides(model_dir), "--api-key", API_KEY)
    url = f"{running.url}/v1/completions"
    long = {"model": str(model_dir), "prompt": "Hello", "max_tokens": LONG, "stream": True}

    async def scenario():
        async with httpx.AsyncClient(timeout=30, headers=_auth()) as client:
            async with client.stream("POST", url, json=long) as stream:
                events = await _streaming(stream)
                running.process.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.5)  # draining: the stream goes on for its grace
                killed_at = time.monotonic()
                os.kill(running.workers()[1], signal.SIGKILL)
                error, error_after = await _error_event(events, since=killed_at)
                rest = [line async for line in events if line.startswith("data: ")]
            return error, error_after, rest, killed_at

    try:
        error, error_after, rest, killed_at = asyncio.run(scenario())
        assert running.process.wait(15) == 128 + signal.SIGTERM
        exited_after = time.monotonic() - killed_at
    finally:
        running.stop()
    log = running.log.read_text()
    assert error is not None and error["code"] == "engine_failed", log
    assert error_after < 3.0 and rest == ["data: [DONE]"]
    assert exited_after < 4.0  # before the 5 s grace ran out: nothing left to wait for
    assert "the server is stopping: no restart" in log and "restarted" not in log, log


# ---- the command line ------------------------------------------------------------------------


def test_a_port_in_use_is_one_clear_line(model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = shardline("serve", "--port", str(port), "--set", f"model.path={model_dir}")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"error: --port = {port}: 127.0.0.1:{port} is already in use; stop what listens there "
        "or give another --port"
    )
    empty_key = shardline("serve", "--api-key", " ", "--set", f"model.path={model_dir}")
    assert empty_key.returncode == 2 and empty_key.stderr.startswith("error: --api-key is empty")
    empty_variable = shardline(
        "serve", "--set", f"model.path={model_dir}", env={"SHARDLINE_API_KEY": ""}
    )
    assert empty_variable.returncode == 2
    assert empty_variable.stderr.startswith("error: SHARDLINE_API_KEY is empty")


def test_the_api_key_flag_wins_over_the_environment():
    from shardline.cli.serve_cmd import api_key_of

    assert api_key_of("from-flag", {"SHARDLINE_API_KEY": "from-env"}) == "from-flag"
    assert api_key_of(None, {"SHARDLINE_API_KEY": "from-env"}) == "from-env"
    assert api_key_of(None, {}) is None
