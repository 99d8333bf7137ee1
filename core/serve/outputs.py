"""A request's engine updates as OpenAI responses: one JSON body when it ends, or a stream of
server-sent events (``data: {chunk}``, ``data: [DONE]``) as its text grows. An engine
failure ends a stream with an error event (``data: {"error": {...}}``), which the OpenAI
clients raise as an error.

Log-probabilities, where asked, come in OpenAI's two shapes: a completion's ``tokens``,
``token_logprobs``, ``top_logprobs`` (the k most likely and the chosen token, text to value)
and ``text_offset``; a chat's ``content`` list (``token``, ``logprob``, ``bytes``,
``top_logprobs``). Every generated token has one, the end-of-sequence token included; a
token is shown as its own bytes, UTF-8 decoded, with a byte that is only part of a character
written as ``\\xNN`` (``bytes`` has them exactly)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any, NamedTuple

from starlette.responses import StreamingResponse

from shardline.interfaces.step import SamplingParams, TokenLogprobs
from shardline.serve.engine_loop import EngineLoop, Ticket, Update

DONE = "data: [DONE]\n\n"
#: What a log-probability of minus infinity is written as (JSON has no infinity).
LOWEST_LOGPROB = -9999.0

#: Tokens with their scores (None: the prompt's first token, which nothing predicts).
Scored = Sequence[tuple[int, TokenLogprobs | None]]


class TokenTexts:
    """Token ids as logprobs show them: the served tokenizer's bytes of each token (without
    a tokenizer: ``token_id:N``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def bytes_of(self, token_id: int) -> bytes:
        if self._tokenizer is None:
            return f"token_id:{token_id}".encode()
        return self._tokenizer.token_bytes(token_id)

    def text_of(self, token_id: int) -> str:
        return _shown(self.bytes_of(token_id))


def _shown(raw: bytes) -> str:
    """A token's bytes as text: UTF-8, a byte that is only part of a character as ``\\xNN``."""
    return raw.decode("utf-8", errors="backslashreplace")


def _finite(logprob: float) -> float:
    return logprob if logprob > LOWEST_LOGPROB else LOWEST_LOGPROB  # -inf and NaN too


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Answer(NamedTuple):
    """One choice's whole answer: its text, last update, scored tokens and scored prompt
    tokens (where asked)."""

    text: str
    last: Update
    scored: list[tuple[int, TokenLogprobs]]
    prompt_scored: Scored = ()


class CompletionShape:
    """The bodies of ``/v1/completions`` for one request (its choices by index); ``texts``
    set: the request asked for log-probabilities, shown with it; ``echo`` set: each choice's
    text begins with this prompt text (and its logprobs with the prompt's tokens)."""

    prefix = "cmpl"
    obj = "text_completion"
    chunk_obj = "text_completion"

    def __init__(
        self, model: str, texts: TokenTexts | None = None, echo: str | None = None
    ) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.model = model
        #: When the request arrived (Unix seconds), in every body and chunk of its answer.
        self.created = int(time.time())
        self.texts = texts
        self.echo = echo
        self._echoed: set[int] = set()  # the choices whose text began with the echo
        self._text_offsets: dict[int, int] = {}  # per choice: where its next token's text starts

    def body(self, answers: Sequence[Answer], counts: dict[str, int]) -> dict[str, Any]:
        choices = [self._whole(index, answer) for index, answer in enumerate(answers)]
        return self._envelope(self.obj, choices) | {"usage": counts}

    def opening(self, choice: int) -> dict[str, Any] | None:
        """The first chunk of a choice's stream, before any text (None: there is none)."""
        return None

    def chunk(self, choice: int, update: Update) -> dict[str, Any]:
        """The chunk of what choice ``choice`` gained in ``update``."""
        return self._envelope(self.chunk_obj, [self._part(choice, update)])

    def usage_chunk(self, counts: dict[str, int]) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        return self._envelope(self.chunk_obj, []) | {"usage": counts}

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _whole(self, index: int, answer: Answer) -> dict[str, Any]:
        return self._choice(
            index, answer.text, answer.last.finish_reason, answer.scored, answer.prompt_scored
        )

    def _part(self, choice: int, update: Update) -> dict[str, Any]:
        return self._choice(
            choice, update.text, update.finish_reason, update.scored, update.prompt_scored
        )

    def _choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        scored: Scored,
        prompt_scored: Scored,
    ) -> dict[str, Any]:
        if self.echo is not None and index not in self._echoed:
            self._echoed.add(index)
            text, scored = self.echo + text, (*prompt_scored, *scored)
        return {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(index, scored),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, index: int, scored: Scored) -> dict[str, Any] | None:
        """The legacy shape: per token its text, value, the most likely (text to value, the
        chosen token among them) and where its text starts in choice ``index``."""
        if self.texts is None or not scored:
            return None
        tokens, values, tops, offsets = [], [], [], []
        offset = self._text_offsets.get(index, 0)
        for token_id, found in scored:
            token = self.texts.text_of(token_id)
            tokens.append(token)
            if found is None:  # the prompt's first token
                values.append(None)
                tops.append(None)
            else:
                values.append(_finite(found.logprob))
                top = {self.texts.text_of(i): _finite(value) for i, value in found.top}
                top.setdefault(token, _finite(found.logprob))
                tops.append(top)
            offsets.append(offset)
            offset += len(token)
        self._text_offsets[index] = offset
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }


class ChatShape(CompletionShape):
    """The bodies of ``/v1/chat/completions``: the text is the assistant message's content
    (streamed as ``delta``s after an opening chunk naming the role)."""

    prefix = "chatcmpl"
    obj = "chat.completion"
    chunk_obj = "chat.completion.chunk"

    def opening(self, choice: int) -> dict[str, Any]:
        delta = {"role": "assistant", "content": ""}
        return self._envelope(self.chunk_obj, [self._delta(choice, delta, None, ())])

    def _whole(self, index: int, answer: Answer) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": answer.text},
            "logprobs": self._logprobs(index, answer.scored),
            "finish_reason": answer.last.finish_reason,
        }

    def _part(self, choice: int, update: Update) -> dict[str, Any]:
        delta = {"content": update.text} if update.text else {}
        return self._delta(choice, delta, update.finish_reason, update.scored)

    def _delta(
        self, choice: int, delta: dict[str, str], finish_reason: str | None, scored: Scored
    ) -> dict[str, Any]:
        return {
            "index": choice,
            "delta": delta,
            "logprobs": self._logprobs(choice, scored),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, index: int, scored: Scored) -> dict[str, Any] | None:
        """The chat shape: per token its text, value, bytes and the most likely tokens."""
        if self.texts is None or not scored:
            return None
        return {
            "content": [
                self._entry(token_id, found.logprob)
                | {"top_logprobs": [self._entry(i, value) for i, value in found.top]}
                for token_id, found in scored
            ],
            "refusal": None,
        }

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        raw = self.texts.bytes_of(token_id)
        return {
            "token": _shown(raw),
            "logprob": _finite(logprob),
            "bytes": list(raw),
        }


def request_tickets(
    prompts: Sequence[list[int]], sampling: Sequence[SamplingParams], pooling: str | None = None
) -> list[Ticket]:
    """One ticket per prompt (a choice of ``n``, or an embeddings input), sharing one queue
    of updates, each with its index."""
    updates: asyncio.Queue = asyncio.Queue()
    return [
        Ticket(prompt, params, pooling, choice=index, updates=updates)
        for index, (prompt, params) in enumerate(zip(prompts, sampling, strict=True))
    ]


async def collect(engine: EngineLoop, tickets: Sequence[Ticket]) -> list[Answer]:
    """Every ticket's whole answer, in index order (the tickets of one request, sharing
    their queue). Raises the first update's ApiError when the engine could not finish one;
    aborts them all when it fails or is cancelled (client gone)."""
    parts: dict[int, list[str]] = {ticket.choice: [] for ticket in tickets}
    scored: dict[int, list[tuple[int, TokenLogprobs]]] = {ticket.choice: [] for ticket in tickets}
    prompt_scored: dict[int, Scored] = {}
    answers: dict[int, Answer] = {}
    try:
        while len(answers) < len(tickets):
            choice, update = await tickets[0].updates.get()
            if update.error is not None:
                raise update.error
            parts[choice].append(update.text)
            scored[choice] += update.scored
            if update.prompt_scored:
                prompt_scored[choice] = update.prompt_scored
            if update.finish_reason is not None:
                text = "".join(parts[choice])
                answers[choice] = Answer(
                    text, update, scored[choice], prompt_scored.get(choice, ())
                )
        return [answers[ticket.choice] for ticket in tickets]
    finally:
        if len(answers) < len(tickets):
            for ticket in tickets:
                engine.abort(ticket)


class EventStream(StreamingResponse):
    """The server-sent events of a streamed request (its choices' chunks interleaved as the
    engine makes them). However the response ends (done, or the client gone before or while
    it streams) its prompts are aborted, which leaves finished ones alone."""

    def __init__(
        self,
        engine: EngineLoop,
        tickets: Sequence[Ticket],
        shape: CompletionShape,
        include_usage: bool,
    ) -> None:
        super().__init__(
            _events(tickets, shape, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._engine = engine
        self._tickets = tickets

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for ticket in self._tickets:
                self._engine.abort(ticket)


async def _events(
    tickets: Sequence[Ticket], shape: CompletionShape, include_usage: bool
) -> AsyncIterator[str]:
    """Each chunk as soon as the engine makes its text; an error event if one choice fails
    (which ends them all)."""
    for ticket in tickets:
        opening = shape.opening(ticket.choice)
        if opening is not None:
            yield event(opening)
    generated: dict[int, int] = {}
    while len(generated) < len(tickets):
        choice, update = await tickets[0].updates.get()
        if update.error is not None:
            yield event(update.error.body())
            break
        if update.text or update.finish_reason is not None or update.scored:
            yield event(shape.chunk(choice, update))
        if update.finish_reason is not None:
            generated[choice] = update.num_tokens
    else:
        if include_usage:
            counts = usage(len(tickets[0].prompt_token_ids), sum(generated.values()))
            yield event(shape.usage_chunk(counts))
    yield DONE


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
