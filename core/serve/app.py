"""The HTTP front end: an OpenAI-compatible FastAPI app over an :class:`EngineLoop`.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``,
``POST /v1/embeddings``, ``GET /health`` (200 while the engine and every rank live, else 503)
and ``GET /metrics`` (Prometheus). With an API key, every endpoint but ``/health`` needs
``Authorization: Bearer KEY``. Every error has OpenAI's shape
(``{"error": {"message", "type", "param", "code"}}``); a malformed body is a 400 naming the
field, not FastAPI's 422.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import secrets
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from shardline.errors import echo
from shardline.interfaces.step import SamplingParams
from shardline.serve import inputs, outputs
from shardline.serve.engine_loop import EngineLoop, Update
from shardline.serve.errors import ApiError, bad_request
from shardline.serve.inputs import ServedModel
from shardline.serve.metrics import ServeMetrics
from shardline.serve.protocol import (
    MAX_EMBEDDING_INPUTS,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    refuse_unsupported,
)

T = TypeVar("T")
#: The largest request body the server reads: a whole context of token ids or text is a small
#: part of it; a larger body is refused (413) before it is held in memory.
MAX_BODY_BYTES = 16 << 20
#: Loc entries pydantic adds for the member of a union that failed; not field names.
_UNION_TAGS = ("str", "int", "float", "bool", "none")


def build_app(
    engine: EngineLoop, served: ServedModel, metrics: ServeMetrics, api_key: str | None
) -> FastAPI:
    """The app serving ``served`` through ``engine``; ``api_key`` None: no key needed."""
    app = FastAPI(title="Shardline", docs_url=None, redoc_url=None, openapi_url=None)
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)

    def require_key(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), api_key.encode()
        ):
            raise ApiError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer KEY' with "
                "the key the server was started with (--api-key)",
                code="invalid_api_key",
            )

    @app.get("/health")
    def health() -> Response:
        if engine.healthy():
            return JSONResponse({"status": "ok"})
        return _api_error(
            None,
            ApiError(503, "the engine or one of its ranks is down", code="engine_unhealthy"),
        )

    api = APIRouter(dependencies=[Depends(require_key)])

    @api.get("/metrics")
    def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @api.get("/v1/models")
    def models() -> dict[str, Any]:
        card = {
            "id": served.name,
            "object": "model",
            "created": served.created,
            "owned_by": "shardline",
            "max_model_len": served.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @api.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served.check_name(body.model)
        refuse_unsupported(body)
        prompt = inputs.completion_prompt(served, body)
        texts = None if body.logprobs is None else outputs.TokenTexts(served.tokenizer)
        echo = inputs.echoed_prompt(served, body, prompt)
        shape = outputs.CompletionShape(served.name, texts, echo)
        return await _generate(request, body, prompt, shape)

    @api.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        served.check_name(body.model)
        refuse_unsupported(body)
        prompt = inputs.chat_prompt(served, body)
        texts = outputs.TokenTexts(served.tokenizer) if body.logprobs else None
        shape = outputs.ChatShape(served.name, texts)
        return await _generate(request, body, prompt, shape)

    @api.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> Response:
        served.check_name(body.model)
        batch = inputs.embedding_inputs(served, body)
        if len(batch) > MAX_EMBEDDING_INPUTS:
            raise bad_request(
                f"{len(batch)} inputs: allowed: at most {MAX_EMBEDDING_INPUTS}", "input"
            )
        tickets = outputs.request_tickets(batch, [SamplingParams()] * len(batch), served.pooling)
        engine.submit(*tickets)
        done = await _while_connected(request, outputs.collect(engine, tickets))
        if done is None:
            return Response(status_code=499)
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _vector(answer.last, body.encoding_format),
            }
            for i, answer in enumerate(done)
        ]
        tokens = sum(len(ids) for ids in batch)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": served.name,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )

    async def _generate(
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        prompt: list[int],
        shape: outputs.CompletionShape,
    ) -> Response:
        sampling = inputs.sampling_params(served, body, len(prompt))
        tickets = outputs.request_tickets(
            [prompt] * body.n, [inputs.choice_sampling(sampling, i) for i in range(body.n)]
        )
        engine.submit(*tickets)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return outputs.EventStream(engine, tickets, shape, include_usage)
        done = await _while_connected(request, outputs.collect(engine, tickets))
        if done is None:
            return Response(status_code=499)
        generated = sum(answer.last.num_tokens for answer in done)
        return JSONResponse(shape.body(done, outputs.usage(len(prompt), generated)))

    app.include_router(api)
    app.add_middleware(_BodyLimit, limit=MAX_BODY_BYTES)
    return app


class _BodyLimit:
    """ASGI middleware refusing a request body over ``limit`` bytes with a 413 in OpenAI's
    shape: at once when its Content-Length says so; a body without one (chunked) is read
    here up to the limit and handed on whole."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit():
            if int(declared) > self.limit:
                await self._refuse(f"{int(declared)} bytes", scope, receive, send)
            else:
                await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(f"more than {self.limit} bytes", scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        handed_on = False

        async def replay() -> dict:
            nonlocal handed_on
            if handed_on:
                return await receive()  # what follows the body: a disconnect
            handed_on = True
            return whole

        await self.app(scope, replay, send)

    async def _refuse(self, size: str, scope: dict, receive: Any, send: Any) -> None:
        too_large = ApiError(
            413,
            f"the request body has {size}; allowed: at most {self.limit} bytes",
            code="body_too_large",
        )
        await _api_error(None, too_large)(scope, receive, send)


async def _while_connected(request: Request, work: Awaitable[T]) -> T | None:
    """The result of ``work``, or None when the client disconnects first (``work`` is then
    cancelled, which aborts its requests)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


async def _disconnected(request: Request) -> None:
    """Returns once the client has disconnected (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _vector(update: Update, encoding_format: str) -> list[float] | str:
    vector = update.embedding.float()
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode()
    return vector.tolist()


def _api_error(request: Request | None, error: ApiError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    """Starlette's own errors (an unknown path, a wrong method, a body that is not text) in
    OpenAI's shape."""
    detail, code = error.detail, _HTTP_CODES.get(error.status_code, "invalid_request")
    if error.status_code == 400:  # FastAPI could not parse the body
        detail = "the body is not valid JSON (UTF-8 text)"
    message = f"{request.method} {request.url.path}: {detail}"
    return _api_error(request, ApiError(error.status_code, message, code=code))


_HTTP_CODES = {400: "invalid_json", 404: "not_found", 405: "method_not_allowed"}


def _internal_error(request: Request, error: Exception) -> JSONResponse:
    """A bug in the server (its traceback goes to the log): a 500 in OpenAI's shape."""
    message = f"internal error: {type(error).__name__}: {error} (a Shardline bug; see the log)"
    return _api_error(request, ApiError(500, message, code="internal_error"))


def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    """FastAPI's 422 as OpenAI's 400, naming the field (for a union, every type allowed)."""
    problems = error.errors()
    first = problems[0]
    if first["type"] == "json_invalid":
        message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}"
        return _api_error(request, ApiError(400, message, code="invalid_json"))
    param = _param(first["loc"])
    content_type = request.headers.get("content-type", "")
    if param is None and not content_type.startswith("application/json"):
        message = (
            f"the body is read as JSON only with Content-Type: application/json (it came "
            f"with {content_type or 'none'!r})"
        )
        return _api_error(request, ApiError(400, message, code="invalid_json"))
    if param is None:
        message = f"the body must be a JSON object: {first['msg']}"
    elif first["type"] == "missing":
        message = f"{param}: required"
    else:
        shown = f"{param} = {echo(first.get('input'))}"
        allowed = [_tag(p["loc"]) for p in problems if _param(p["loc"]) == param]
        allowed = [a for a in allowed if a]
        if len(allowed) > 1:
            message = f"{shown}: wrong type; allowed: {', '.join(dict.fromkeys(allowed))}"
        else:
            message = f"{shown}: {first['msg']}"
    return _api_error(request, ApiError(400, message, param=param, code="invalid_value"))


def _param(loc: tuple[Any, ...]) -> str | None:
    """The dotted field of a validation error (``messages.0.role``), union tags left out."""
    names = [str(p) for p in loc[1:] if not _is_union_tag(p)]
    return ".".join(names) or None


def _tag(loc: tuple[Any, ...]) -> str | None:
    """The union member a validation error is about (``list[int]``), if any."""
    tags = [str(p) for p in loc[1:] if _is_union_tag(p)]
    return tags[0] if tags else None


def _is_union_tag(part: Any) -> bool:
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS)
