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

import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.responses import StreamingResponse

from shardline.interfaces.step import TokenLogprobs
from shardline.serve.engine_loop import EngineLoop, Ticket, Update

DONE = "data: [DONE]\n\n"
#: What a log-probability of minus infinity is written as (JSON has no infinity).
LOWEST_LOGPROB = -9999.0

Scored = Sequence[tuple[int, TokenLogprobs]]


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
        return self.bytes_of(token_id).decode("utf-8", errors="backslashreplace")


def _finite(logprob: float) -> float:
    return logprob if logprob > LOWEST_LOGPROB else LOWEST_LOGPROB  # -inf and NaN too


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class CompletionShape:
    """The bodies of ``/v1/completions`` for one request; ``texts`` set: the request asked
    for log-probabilities, shown with it."""

    prefix = "cmpl"
    obj = "text_completion"
    chunk_obj = "text_completion"

    def __init__(self, model: str, texts: TokenTexts | None = None) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.model = model
        #: When the request arrived (Unix seconds), in every body and chunk of its answer.
        self.created = int(time.time())
        self.texts = texts
        self._text_offset = 0  # where the next token's text starts in the completion

    def body(
        self, text: str, finish_reason: str, counts: dict[str, int], scored: Scored = ()
    ) -> dict[str, Any]:
        choice = self._choice(text, finish_reason, scored)
        return self._envelope(self.obj, [choice]) | {"usage": counts}

    def opening(self) -> dict[str, Any] | None:
        """The first chunk of a stream, before any text (None: there is none)."""
        return None

    def chunk(self, text: str, finish_reason: str | None, scored: Scored = ()) -> dict[str, Any]:
        return self._envelope(self.chunk_obj, [self._choice(text, finish_reason, scored)])

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

    def _choice(self, text: str, finish_reason: str | None, scored: Scored) -> dict[str, Any]:
        return {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs(scored),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, scored: Scored) -> dict[str, Any] | None:
        """The legacy shape: per token its text, value, the most likely (text to value, the
        chosen token among them) and where its text starts."""
        if self.texts is None or not scored:
            return None
        tokens, values, tops, offsets = [], [], [], []
        for token_id, found in scored:
            token = self.texts.text_of(token_id)
            tokens.append(token)
            values.append(_finite(found.logprob))
            top = {self.texts.text_of(i): _finite(value) for i, value in found.top}
            top.setdefault(token, _finite(found.logprob))
            tops.append(top)
            offsets.append(self._text_offset)
            self._text_offset += len(token)
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

    def body(
        self, text: str, finish_reason: str, counts: dict[str, int], scored: Scored = ()
    ) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": self._logprobs(scored),
            "finish_reason": finish_reason,
        }
        return self._envelope(self.obj, [choice]) | {"usage": counts}

    def opening(self) -> dict[str, Any]:
        return self._envelope(self.chunk_obj, [self._delta({"role": "assistant", "content": ""})])

    def chunk(self, text: str, finish_reason: str | None, scored: Scored = ()) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return self._envelope(self.chunk_obj, [self._delta(delta, finish_reason, scored)])

    def _delta(
        self, delta: dict[str, str], finish_reason: str | None = None, scored: Scored = ()
    ) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": delta,
            "logprobs": self._logprobs(scored),
            "finish_reason": finish_reason,
        }

    def _logprobs(self, scored: Scored) -> dict[str, Any] | None:
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
            "token": raw.decode("utf-8", errors="backslashreplace"),
            "logprob": _finite(logprob),
            "bytes": list(raw),
        }


async def collect(
    engine: EngineLoop, ticket: Ticket
) -> tuple[str, Update, list[tuple[int, TokenLogprobs]]]:
    """The whole text, the last update and the scored tokens (where asked) of ``ticket``.
    Raises the update's ApiError when the engine could not finish it; aborts the request
    when cancelled (client gone)."""
    parts: list[str] = []
    scored: list[tuple[int, TokenLogprobs]] = []
    ended = False
    try:
        while True:
            update = await ticket.updates.get()
            if update.error is not None:
                ended = True
                raise update.error
            parts.append(update.text)
            scored += update.scored
            if update.finish_reason is not None:
                ended = True
                return "".join(parts), update, scored
    finally:
        if not ended:
            engine.abort(ticket)


class EventStream(StreamingResponse):
    """The server-sent events of a streamed request. However the response ends (done, or
    the client gone before or while it streams) the request is aborted, which leaves a
    finished one alone."""

    def __init__(
        self, engine: EngineLoop, ticket: Ticket, shape: CompletionShape, include_usage: bool
    ) -> None:
        super().__init__(
            _events(ticket, shape, include_usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._engine = engine
        self._ticket = ticket

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine.abort(self._ticket)


async def _events(
    ticket: Ticket, shape: CompletionShape, include_usage: bool
) -> AsyncIterator[str]:
    """Each chunk as soon as the engine makes its text; an error event if it fails."""
    opening = shape.opening()
    if opening is not None:
        yield event(opening)
    while True:
        update = await ticket.updates.get()
        if update.error is not None:
            yield event(update.error.body())
            break
        if update.text or update.finish_reason is not None or update.scored:
            yield event(shape.chunk(update.text, update.finish_reason, update.scored))
        if update.finish_reason is not None:
            if include_usage:
                counts = usage(len(ticket.prompt_token_ids), update.num_tokens)
                yield event(shape.usage_chunk(counts))
            break
    yield DONE


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
