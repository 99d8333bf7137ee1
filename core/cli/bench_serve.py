"""``shardline bench serve``: load on a running OpenAI-compatible server over HTTP, measured as
serving benchmarks (vLLM's benchmark_serving, for one) measure it, so any such server can be
measured.

``--num-requests`` requests arrive as a Poisson process at ``--request-rate`` per second (inf:
all at once), at most ``--max-concurrency`` of them open at a time. Every request streams
(``stream_options.include_usage``) ``max_tokens = --output-len`` greedy tokens with
``ignore_eos`` (vLLM's extension, which Shardline's server honours too: exactly that many
tokens; a server without it may end a request early at end-of-sequence). Per request: TTFT
(sent to the first chunk with text), ITL (the gaps between successive chunks with text), E2E
(sent to the end of the stream), TPOT ((E2E - TTFT) / (output tokens - 1)) and the tokens its
``usage`` reports.
Throughputs count the successful requests over the run's duration (first request sent to last
one ended).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import os
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from importlib import resources
from typing import Any
from urllib.parse import urlsplit

import httpx

from shardline.cli.flags import MAX_REPEATS, check_count, check_host_memory, check_seconds
from shardline.cli.table import render
from shardline.config.schema import MAX_COUNT
from shardline.errors import ConfigError, cut, echo

#: random: token-id prompts to /v1/completions; chat: CHAT_PROMPTS to /v1/chat/completions.
DATASETS = ("random", "chat")
CHAT_PROMPTS = "bench_serve_prompts.txt"
PERCENTILES = (50, 90, 99)
#: Distinct errors of failed requests listed under the table (the most frequent).
ERRORS_SHOWN = 5
#: Seconds a connection to the server may take to open.
CONNECT_TIMEOUT_S = 30.0
#: Seconds between progress lines when stderr is not a terminal.
PROGRESS_EVERY_S = 5.0
PROGRESS_WIDTH = 24
#: Memory a random prompt's token takes before it is sent: a list slot and an int object.
_PROMPT_BYTES_PER_TOKEN = 8 + 32


@dataclass(frozen=True)
class Settings:
    """A run: ``url`` is the server's root (no ``/v1``); ``request_rate`` is requests/s (inf:
    all at once); ``max_concurrency`` None: no limit; ``model`` None: the server's first."""

    url: str
    model: str | None
    api_key: str | None
    num_requests: int
    input_len: int
    output_len: int
    dataset: str
    vocab_size: int
    request_rate: float
    max_concurrency: int | None
    seed: int
    timeout_s: float


@dataclass
class Record:
    """One request, times in ms from when it was sent (None where it did not get that far);
    ``start_ms`` is when it was sent, from the run's start."""

    index: int
    ok: bool = False
    error: str | None = None
    start_ms: float = 0.0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int | None = None


class RequestFailed(Exception):
    """A request that got no complete answer; the message says what came back instead."""


def settings_from(args) -> Settings:
    """Validated settings from the command line; ConfigError names the bad option."""
    for flag, value in (
        ("--input-len", args.input_len),
        ("--output-len", args.output_len),
        ("--vocab-size", args.vocab_size),
    ):
        check_count(flag, value, 1, MAX_COUNT)
    check_count("--num-requests", args.num_requests, 1, MAX_REPEATS)
    if args.dataset == "random":
        # Every prompt is made before the first request is sent: a list of Python ints each.
        check_host_memory(
            f"--num-requests {args.num_requests} x --input-len {args.input_len}",
            args.num_requests * args.input_len * _PROMPT_BYTES_PER_TOKEN,
            "fewer requests or shorter prompts",
        )
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ConfigError(
            f"--max-concurrency = {args.max_concurrency}: allowed: 1 or more (leave it out "
            "for no limit)"
        )
    if args.dataset not in DATASETS:
        raise ConfigError(f"--dataset = {echo(args.dataset)}: allowed: {', '.join(DATASETS)}")
    check_seconds("--timeout-s", args.timeout_s)
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    if args.api_key is not None and not api_key.strip():
        raise ConfigError("--api-key is empty: give the server's key, or leave it out")
    return Settings(
        url=_root_url(args.url),
        model=args.model,
        api_key=api_key or None,
        num_requests=args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        dataset=args.dataset,
        vocab_size=args.vocab_size,
        request_rate=_request_rate(args.request_rate),
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        timeout_s=args.timeout_s,
    )


def _request_rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = math.nan
    if not rate > 0:
        raise ConfigError(
            f"--request-rate = {echo(text)}: allowed: requests per second > 0, or inf (all at once)"
        )
    return rate


def _root_url(url: str) -> str:
    """``url`` without a trailing ``/`` or ``/v1`` (the banner of ``shardline serve`` names
    ``.../v1``)."""
    parts = urlsplit(url.strip())
    try:
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # a port that is not a number in 1..65535
        valid = False
    if not valid:
        raise ConfigError(
            f"--url = {echo(url)}: allowed: http(s)://HOST:PORT, e.g. http://127.0.0.1:8000"
        )
    return url.strip().rstrip("/").removesuffix("/v1")


def run(settings: Settings, json_path: str | None) -> int:
    """Run the benchmark, print its table; 0 when every request succeeded, else 1.
    ConfigError when the server cannot be reached or refuses the model or key."""
    model, records, duration_s = asyncio.run(_benchmark(settings))
    summary = summarize(records, duration_s)
    print(_title(settings, model))
    print(_table(summary))
    failures = Counter(record.error for record in records if not record.ok)
    if failures:
        print("\nfailed requests:")
        shown = failures.most_common(ERRORS_SHOWN)
        for error, count in shown:
            print(f"  {count} x {error}")
        others = failures.total() - sum(count for _, count in shown)
        if others:
            print(f"  {others} x other errors (--json has every request's)")
    if json_path:
        shown = asdict(settings) | {"api_key": None, "request_rate": _rate_text(settings)}
        report = {
            "settings": shown,
            "model": model,
            "summary": summary,
            "requests": [asdict(record) for record in records],
        }
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=1)
    return 1 if failures else 0


async def _benchmark(settings: Settings) -> tuple[str, list[Record], float]:
    """The model asked for, every request's record, and the run's duration (s)."""
    limit = settings.max_concurrency or settings.num_requests
    headers = {"Authorization": f"Bearer {settings.api_key}"} if settings.api_key else {}
    async with httpx.AsyncClient(
        base_url=settings.url,
        headers=headers,
        timeout=httpx.Timeout(settings.timeout_s, connect=CONNECT_TIMEOUT_S),
        limits=httpx.Limits(max_connections=limit, max_keepalive_connections=limit),
    ) as client:
        model, context = await _served_model(client, settings)
        needed = settings.input_len + settings.output_len
        if settings.dataset == "random" and context is not None and needed > context:
            raise ConfigError(
                f"--input-len {settings.input_len} + --output-len {settings.output_len}: "
                f"{needed} tokens, more than the context of {model!r} ({context}, GET /v1/models)"
            )
        generator = random.Random(settings.seed)
        path, bodies = _requests(settings, model, generator)
        arrivals = _arrivals(settings, generator)
        gate = asyncio.Semaphore(limit)
        progress = _Progress(settings.num_requests)
        records = [Record(index) for index in range(settings.num_requests)]
        started = time.perf_counter()

        async def send(record: Record, body: dict[str, Any]) -> None:
            async with gate:
                await _measure(client, path, body, record, started, settings.timeout_s)
            progress.count(record.ok)

        tasks = []
        for record, body, arrival in zip(records, bodies, arrivals, strict=True):
            await asyncio.sleep(max(0.0, started + arrival - time.perf_counter()))
            tasks.append(asyncio.create_task(send(record, body)))
        await asyncio.gather(*tasks)
        duration_s = time.perf_counter() - started
        progress.close()
    return model, records, duration_s


async def _served_model(client: httpx.AsyncClient, settings: Settings) -> tuple[str, int | None]:
    """The model to ask for and its context length (None: the server does not say), from
    ``GET /v1/models``; ConfigError when the server cannot be reached or refuses."""
    try:
        response = await client.get("/v1/models")
    except (httpx.HTTPError, httpx.InvalidURL) as error:
        raise ConfigError(
            f"--url = {settings.url!r}: no server answers there ({_describe(error)}); start "
            "one (shardline serve) or give its address"
        ) from None
    if response.status_code != 200:
        flag = "--api-key" if response.status_code == 401 else "--url"
        raise ConfigError(f"{flag}: GET {settings.url}/v1/models answered {_http_error(response)}")
    try:
        cards = response.json()["data"]
    except (ValueError, KeyError, TypeError):
        cards = None
    if not isinstance(cards, list) or not all(isinstance(c, dict) for c in cards):
        raise ConfigError(
            f"--url = {settings.url!r}: GET /v1/models did not answer with OpenAI's model "
            "list; is it an OpenAI-compatible server?"
        )
    names = [card.get("id") for card in cards]
    if settings.model is None:
        if not cards:
            raise ConfigError("--model: the server lists no model (GET /v1/models); give one")
        card = cards[0]
    elif settings.model in names:
        card = cards[names.index(settings.model)]
    else:
        raise ConfigError(
            f"--model = {echo(settings.model)}: the server serves "
            f"{', '.join(repr(n) for n in names) or 'no model'} (GET /v1/models)"
        )
    context = card.get("max_model_len")
    return card["id"], context if isinstance(context, int) else None


def _requests(
    settings: Settings, model: str, generator: random.Random
) -> tuple[str, list[dict[str, Any]]]:
    """The endpoint and the bodies of every request of the run."""
    common = {
        "model": model,
        "max_tokens": settings.output_len,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if settings.dataset == "random":
        bodies = [
            common
            | {
                "prompt": [
                    generator.randrange(settings.vocab_size) for _ in range(settings.input_len)
                ]
            }
            for _ in range(settings.num_requests)
        ]
        return "/v1/completions", bodies
    questions = chat_prompts()
    generator.shuffle(questions)
    bodies = [
        common | {"messages": [{"role": "user", "content": questions[i % len(questions)]}]}
        for i in range(settings.num_requests)
    ]
    return "/v1/chat/completions", bodies


def chat_prompts() -> list[str]:
    """The questions of the chat dataset, one per line of :data:`CHAT_PROMPTS`."""
    text = resources.files("shardline.cli").joinpath(CHAT_PROMPTS).read_text(encoding="utf-8")
    return [line.strip() for line in text.splitlines() if line.strip()]


def _arrivals(settings: Settings, generator: random.Random) -> list[float]:
    """When each request arrives (s from the start): the first at once, then exponential
    gaps at ``request_rate`` (a Poisson process); all at 0 when the rate is inf."""
    times, now = [], 0.0
    for _ in range(settings.num_requests):
        times.append(now)
        if settings.request_rate != math.inf:
            now += generator.expovariate(settings.request_rate)
    return times


async def _measure(
    client: httpx.AsyncClient,
    path: str,
    body: dict[str, Any],
    record: Record,
    started: float,
    timeout_s: float,
) -> None:
    """Send one streamed request and fill ``record`` with what it measured."""
    sent = time.perf_counter()
    record.start_ms = (sent - started) * 1e3
    try:
        async with asyncio.timeout(timeout_s):
            stamps, usage = await _stream(client, path, body)
    except TimeoutError:
        record.error = f"timed out after {timeout_s:g} s (--timeout-s)"
        return
    except httpx.HTTPError as error:
        record.error = _describe(error)
        return
    except RequestFailed as error:
        record.error = str(error)
        return
    ended = time.perf_counter()
    record.ok = True
    record.ttft_ms = (stamps[0] - sent) * 1e3
    record.e2e_ms = (ended - sent) * 1e3
    record.itl_ms = [(b - a) * 1e3 for a, b in itertools.pairwise(stamps)]
    record.prompt_tokens = usage.get("prompt_tokens")
    record.output_tokens = usage.get("completion_tokens", len(stamps))
    if record.output_tokens > 1:
        record.tpot_ms = (record.e2e_ms - record.ttft_ms) / (record.output_tokens - 1)


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> tuple[list[float], dict[str, Any]]:
    """When each chunk with output arrived, and the stream's usage ({} if none came).
    A chunk has output when it has text, or, if none had, when it ends the output."""
    stamps: list[float] = []
    usage: dict[str, Any] = {}
    async with client.stream("POST", path, json=body) as response:
        if response.status_code != 200:
            await response.aread()
            raise RequestFailed(_http_error(response))
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                if not stamps:
                    raise RequestFailed("the stream ended with no output")
                return stamps, usage
            try:
                chunk = json.loads(data)
            except ValueError:
                raise RequestFailed(f"a stream event is not JSON: {echo(data)}") from None
            if "error" in chunk:
                raise RequestFailed(f"error event: {_error_message(chunk)}")
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text or (not stamps and choice.get("finish_reason")):
                    stamps.append(time.perf_counter())
    raise RequestFailed("the stream ended before data: [DONE]")


def _http_error(response: httpx.Response) -> str:
    """``HTTP 400: message`` (OpenAI's error message when the body has one)."""
    try:
        message = _error_message(response.json())
    except ValueError:
        message = response.text.strip()
    return f"HTTP {response.status_code}: {cut(message, 300)}"


def _error_message(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return json.dumps(body)


def _describe(error: Exception) -> str:
    text = str(error)
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def summarize(records: list[Record], duration_s: float) -> dict[str, Any]:
    """Counts, throughputs (successful requests over ``duration_s``) and the mean and
    percentiles of TTFT, TPOT, ITL (every gap of every request) and E2E in ms."""
    done = [record for record in records if record.ok]
    input_tokens = sum(record.prompt_tokens or 0 for record in done)
    output_tokens = sum(record.output_tokens for record in done)
    return {
        "requests_ok": len(done),
        "requests_failed": len(records) - len(done),
        "duration_s": duration_s,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_token_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
        "ttft_ms": distribution([record.ttft_ms for record in done]),
        "tpot_ms": distribution([r.tpot_ms for r in done if r.tpot_ms is not None]),
        "itl_ms": distribution([gap for record in done for gap in record.itl_ms]),
        "e2e_ms": distribution([record.e2e_ms for record in done]),
    }


def distribution(values: list[float]) -> dict[str, float | None]:
    """Mean and :data:`PERCENTILES` (linear between the nearest ranks); None when empty."""
    ordered = sorted(values)
    result: dict[str, float | None] = {"mean": sum(ordered) / len(ordered) if ordered else None}
    for q in PERCENTILES:
        result[f"p{q}"] = percentile(ordered, q) if ordered else None
    return result


def percentile(ordered: list[float], q: float) -> float:
    """The ``q``-th percentile of the non-empty sorted ``ordered``, as numpy's default."""
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def _rate_text(settings: Settings) -> str | float:
    return "inf" if settings.request_rate == math.inf else settings.request_rate


def _title(settings: Settings, model: str) -> str:
    if settings.dataset == "random":
        prompts = f"random prompts of {settings.input_len} tokens"
    else:
        prompts = "chat prompts"
    if settings.request_rate == math.inf:
        rate = "all at once"
    else:
        rate = f"{settings.request_rate:g} req/s (Poisson)"
    return (
        f"{settings.num_requests} requests ({prompts}, max_tokens {settings.output_len}) to "
        f"{model} at {settings.url}; arrivals {rate}, max concurrency "
        f"{settings.max_concurrency or 'unlimited'}"
    )


def _table(summary: dict[str, Any]) -> str:
    duration = summary["duration_s"]
    totals = [
        ("requests ok", summary["requests_ok"]),
        ("requests failed", summary["requests_failed"]),
        ("duration", f"{duration:.2f} s"),
        ("request throughput", f"{summary['request_throughput']:.2f} req/s"),
        ("input tokens", summary["input_tokens"]),
        ("output tokens", summary["output_tokens"]),
        ("output token throughput", f"{summary['output_token_throughput']:.1f} tok/s"),
        ("total token throughput", f"{summary['total_token_throughput']:.1f} tok/s"),
    ]
    latencies = []
    for name in ("ttft", "tpot", "itl", "e2e"):
        stats = summary[f"{name}_ms"]
        latencies.append([name.upper(), *(_ms(stats[key]) for key in stats)])
    headers = ["latency", "mean ms", *(f"p{q} ms" for q in PERCENTILES)]
    return render(["measure", "value"], totals) + "\n\n" + render(headers, latencies)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


class _Progress:
    """Requests done so far, on stderr: a bar redrawn in place on a terminal, else a plain
    line every :data:`PROGRESS_EVERY_S` seconds."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.failed = 0
        self.terminal = sys.stderr.isatty()
        self.started = self.shown = time.monotonic()

    def count(self, ok: bool) -> None:
        self.done += 1
        self.failed += not ok
        now = time.monotonic()
        state = (
            f"{self.done}/{self.total} requests done, {self.failed} failed, "
            f"{now - self.started:.1f} s"
        )
        if self.terminal:
            filled = PROGRESS_WIDTH * self.done // self.total
            bar = "#" * filled + "." * (PROGRESS_WIDTH - filled)
            print(f"\r[{bar}] {state}", end="", file=sys.stderr, flush=True)
        elif now - self.shown >= PROGRESS_EVERY_S:
            print(state, file=sys.stderr, flush=True)
            self.shown = now

    def close(self) -> None:
        if self.terminal:
            print(f"\r{'':<{PROGRESS_WIDTH + 80}}\r", end="", file=sys.stderr, flush=True)
