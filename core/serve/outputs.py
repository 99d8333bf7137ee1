"""A request's engine updates as OpenAI responses: one JSON body when it ends, or a stream of
server-sent events (``data: {chunk}``, ``data: [DONE]``) as its text grows. An engine
failure ends a stream with an error event (``data: {"error": {...}}``), which the OpenAI
clients raise as an error."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

from shardline.serve.engine_loop import EngineLoop, Ticket, Update

DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class CompletionShape:
    """The bodies of ``/v1/completions`` for one request."""

    prefix = "cmpl"
    obj = "text_completion"
    chunk_obj = "text_completion"

    def __init__(self, model: str) -> None:
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.model = model
        #: When the request arrived (Unix seconds), in every body and chunk of its answer.
        self.created = int(time.time())

    def body(self, text: str, finish_reason: str, counts: dict[str, int]) -> dict[str, Any]:
        return self._envelope(self.obj, [self._choice(text, finish_reason)]) | {"usage": counts}

    def opening(self) -> dict[str, Any] | None:
        """The first chunk of a stream, before any text (None: there is none)."""
        return None

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self._envelope(self.chunk_obj, [self._choice(text, finish_reason)])

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

    def _choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}


class ChatShape(CompletionShape):
    """The bodies of ``/v1/chat/completions``: the text is the assistant message's content
    (streamed as ``delta``s after an opening chunk naming the role)."""

    prefix = "chatcmpl"
    obj = "chat.completion"
    chunk_obj = "chat.completion.chunk"

    def body(self, text: str, finish_reason: str, counts: dict[str, int]) -> dict[str, Any]:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": None,
            "finish_reason": finish_reason,
        }
        return self._envelope(self.obj, [choice]) | {"usage": counts}

    def opening(self) -> dict[str, Any]:
        return self._envelope(self.chunk_obj, [self._delta({"role": "assistant", "content": ""})])

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        return self._envelope(self.chunk_obj, [self._delta(delta, finish_reason)])

    def _delta(self, delta: dict[str, str], finish_reason: str | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


async def collect(engine: EngineLoop, ticket: Ticket) -> tuple[str, Update]:
    """The whole text and the last update of ``ticket``. Raises the update's ApiError when
    the engine could not finish it; aborts the request when cancelled (client gone)."""
    parts: list[str] = []
    ended = False
    try:
        while True:
            update = await ticket.updates.get()
            if update.error is not None:
                ended = True
                raise update.error
            parts.append(update.text)
            if update.finish_reason is not None:
                ended = True
                return "".join(parts), update
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
        if update.text or update.finish_reason is not None:
            yield event(shape.chunk(update.text, update.finish_reason))
        if update.finish_reason is not None:
            if include_usage:
                counts = usage(len(ticket.prompt_token_ids), update.num_tokens)
                yield event(shape.usage_chunk(counts))
            break
    yield DONE


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"
