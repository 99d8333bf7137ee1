"""The request bodies the server accepts (OpenAI's names and types; wrong types are refused,
not coerced: ``"max_tokens": "5"`` is an error). Fields OpenAI defines that the server does
not implement are accepted at their neutral value only (see :func:`refuse_unsupported`);
unknown fields are ignored, as clients send newer ones."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from shardline.interfaces.step import MAX_LOGPROBS, MAX_REPETITION_PENALTY
from shardline.serve.errors import bad_request

MAX_SEED = (1 << 63) - 1


#: The most choices (``n``) of one request, and inputs of one embeddings request (OpenAI's
#: limits). A request with more prompts than ``serve.max_waiting_requests`` waits alone.
MAX_CHOICES = 128
MAX_EMBEDDING_INPUTS = 2048


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Body):
    include_usage: bool = False


class _Generation(_Body):
    """What completions and chat completions share. None: the server's default (the
    config's ``sampling`` section; ``max_tokens`` at most what the context leaves)."""

    model: str
    max_tokens: int | None = None
    temperature: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] | None = None
    top_k: Annotated[int, Field(ge=-1)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    #: Not OpenAI's: vLLM's extension, which benchmarks send to get exactly max_tokens tokens.
    ignore_eos: bool = False
    #: Choices (answers drawn apart) per request.
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] = 1
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    #: Not OpenAI's: vLLM's extension (1: off).
    repetition_penalty: (
        Annotated[float, Field(gt=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False)] | None
    ) = None
    #: Token id (as a string, as OpenAI writes it) to a bias added to its logit.
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = (
        None
    )


class CompletionRequest(_Generation):
    """``POST /v1/completions``: one prompt, as text or token ids (a list holding one
    prompt is taken too)."""

    prompt: str | list[int] | list[str] | list[list[int]]
    #: The answer's text begins with the prompt's (and its logprobs with the prompt tokens').
    echo: bool = False
    best_of: int | None = None
    #: The log-probability of each token and of the ``logprobs`` most likely at its place.
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    """One message; the roles are OpenAI's (the chat template decides what it renders)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None


class ChatCompletionRequest(_Generation):
    """``POST /v1/chat/completions``: messages through the model's chat template.
    ``max_completion_tokens`` is OpenAI's newer name of ``max_tokens``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = None
    #: The log-probability of each token, and (``top_logprobs``) of the most likely at its
    #: place.
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Any] | None = None


class EmbeddingRequest(_Body):
    """``POST /v1/embeddings``: texts or token-id lists, one vector each."""

    model: str
    input: str | list[int] | list[str] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None


#: Fields the server accepts only at their neutral value: (field, neutral, what to say).
_UNSUPPORTED = (
    ("best_of", None, "best_of is not implemented; leave it out"),
    ("suffix", None, "suffix is not implemented; leave it out"),
    ("tools", None, "tool calls are not implemented; leave tools out"),
)


def refuse_unsupported(body: BaseModel) -> None:
    """Raise a 400 naming the first field set to something the server does not implement."""
    for name, neutral, advice in _UNSUPPORTED:
        value = getattr(body, name, neutral)
        neutral_value = value is None or value is False or value in ({}, []) or value == neutral
        if not neutral_value:
            raise bad_request(f"{name} = {value!r}: {advice}", name, "unsupported_value")
