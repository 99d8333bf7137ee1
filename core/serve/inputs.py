"""A request body turned into what the engine takes: prompt token ids and SamplingParams,
every limit checked first so that a bad request is a 400 naming its field, never a failed
engine step."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Any

from shardline.config.schema import SamplingConfig
from shardline.errors import RequestError, echo
from shardline.interfaces.step import MAX_LOGIT_BIAS, SamplingParams
from shardline.serve.errors import bad_request
from shardline.serve.protocol import (
    MAX_SEED,
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
)
from shardline.tokenizer import unicode_problem

#: The most stop strings one request may give (OpenAI takes 4).
MAX_STOP_STRINGS = 16


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP side knows of the model: its name in requests, tokenizer (None: prompts
    must be token ids), context length, vocabulary size, the config's default sampling and
    pooling, and when serving began (Unix seconds)."""

    name: str
    tokenizer: Any
    max_model_len: int
    vocab_size: int
    defaults: SamplingConfig
    pooling: str
    created: int

    def check_name(self, requested: str) -> None:
        if requested != self.name:
            raise bad_request(
                f"model = {echo(requested)}: this server serves {self.name!r} only "
                "(GET /v1/models)",
                "model",
                "model_not_found",
            )


def echoed_prompt(served: ServedModel, body: CompletionRequest, ids: list[int]) -> str | None:
    """The text a completion with ``echo`` begins with: the prompt as given, or its token ids'
    (``ids``) text (None: no echo)."""
    if not body.echo:
        return None
    prompt = _the_prompt(body)
    if isinstance(prompt, str):
        return prompt
    return served.tokenizer.decode(ids) if served.tokenizer is not None else ""


def completion_prompt(served: ServedModel, body: CompletionRequest) -> list[int]:
    """The prompt's token ids: text is encoded; a list holding one prompt is that prompt."""
    ids = _token_ids(served, _the_prompt(body), "prompt")
    _check_context(served, ids, "prompt", room_for_answer=True)
    return ids


def _the_prompt(body: CompletionRequest) -> str | list[int]:
    """The one prompt of a completion: text or token ids (a list holding one is that one)."""
    prompt = body.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise bad_request(
                f"prompt: {len(prompt)} prompts given; this server takes one per request",
                "prompt",
                "unsupported_value",
            )
        prompt = prompt[0]
    return prompt


def chat_prompt(served: ServedModel, body: ChatCompletionRequest) -> list[int]:
    """The messages rendered by the model's chat template, as token ids."""
    if served.tokenizer is None or not served.tokenizer.chat_template:
        raise bad_request(
            f"messages: the model {served.name!r} has no chat template; use /v1/completions",
            "messages",
            "unsupported_value",
        )
    messages = []
    for index, message in enumerate(body.messages):
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        problem = unicode_problem(content or "")
        if problem is not None:
            raise bad_request(f"messages.{index}.content {problem}", f"messages.{index}.content")
        messages.append({"role": message.role, "content": content or ""})
    try:
        text = served.tokenizer.apply_chat_template(messages)
    except Exception as error:  # the template's own checks (e.g. raise_exception)
        raise bad_request(
            f"messages: the chat template refused them: {error}", "messages"
        ) from None
    ids = served.tokenizer.encode(text)
    _check_context(served, ids, "messages", room_for_answer=True)
    return ids


def embedding_inputs(served: ServedModel, body: EmbeddingRequest) -> list[list[int]]:
    """One list of token ids per input (text, token ids, or a list of either)."""
    if body.dimensions is not None:
        raise bad_request(
            f"dimensions = {body.dimensions}: vectors are not shortened here; leave it out",
            "dimensions",
            "unsupported_value",
        )
    items = body.input
    if isinstance(items, str) or (items and isinstance(items[0], int)):
        items = [items]
    if not items:
        raise bad_request("input: empty; give a text or a list of texts", "input")
    batch = []
    for index, item in enumerate(items):
        field = f"input.{index}" if len(items) > 1 else "input"
        ids = _token_ids(served, item, field)
        _check_context(served, ids, field, room_for_answer=False)
        batch.append(ids)
    return batch


def sampling_params(
    served: ServedModel, body: CompletionRequest | ChatCompletionRequest, prompt_len: int
) -> SamplingParams:
    """The request's sampling; what it leaves out comes from the config's ``sampling``
    section, except ``seed`` (a fresh one per request) and ``max_tokens`` (capped by what
    the context leaves after the prompt)."""
    field, max_tokens = "max_tokens", body.max_tokens
    if getattr(body, "max_completion_tokens", None) is not None:
        field, max_tokens = "max_completion_tokens", body.max_completion_tokens
    room = served.max_model_len - prompt_len
    if max_tokens is None:
        max_tokens = min(served.defaults.max_tokens, room)
    elif max_tokens < 1:
        raise bad_request(f"{field} = {max_tokens}: must be at least 1", field)
    elif max_tokens > room:
        raise bad_request(
            f"{field} = {max_tokens}: the prompt has {prompt_len} tokens and the context "
            f"{served.max_model_len}, so at most {room} can be generated",
            field,
            "context_length_exceeded",
        )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise bad_request("stop: an empty stop string; every one must have text", "stop")
    if len(stop) > MAX_STOP_STRINGS:
        # Each is looked for in the new text of every step of this request.
        raise bad_request(f"stop: {len(stop)} strings; allowed: at most {MAX_STOP_STRINGS}", "stop")
    defaults = served.defaults
    top_k = defaults.top_k if body.top_k is None else max(body.top_k, 0)
    logprobs = _logprobs(body)
    return SamplingParams(
        temperature=defaults.temperature if body.temperature is None else body.temperature,
        top_k=top_k,
        top_p=defaults.top_p if body.top_p is None else body.top_p,
        seed=secrets.randbelow(MAX_SEED + 1) if body.seed is None else body.seed,
        max_tokens=max_tokens,
        stop=tuple(stop),
        ignore_eos=body.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=logprobs if isinstance(body, CompletionRequest) and body.echo else None,
        repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
        frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty,
        logit_bias=_logit_bias(served, body.logit_bias or {}),
    )


def _logit_bias(served: ServedModel, bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` as pairs; every key a token id of the vocabulary."""
    if len(bias) > MAX_LOGIT_BIAS:
        raise bad_request(
            f"logit_bias: {len(bias)} tokens; allowed: at most {MAX_LOGIT_BIAS}", "logit_bias"
        )
    pairs = []
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() else None
        if token is None or token >= served.vocab_size:
            raise bad_request(
                f"logit_bias: key {echo(key)} is not a token id; allowed: 0 to "
                f"{served.vocab_size - 1}",
                "logit_bias",
            )
        pairs.append((token, value))
    return tuple(pairs)


def choice_sampling(sampling: SamplingParams, choice: int) -> SamplingParams:
    """The sampling of choice ``choice`` of ``n``: the request's, its seed moved on by the
    index, so that the choices draw apart and a given seed repeats them all."""
    return replace(sampling, seed=(sampling.seed + choice) % (MAX_SEED + 1))


def _logprobs(body: CompletionRequest | ChatCompletionRequest) -> int | None:
    """How many alternatives to give each token's log-probability with (None: none): the
    completion's ``logprobs``; a chat's ``top_logprobs`` (0 by default) once ``logprobs``
    is true."""
    if isinstance(body, CompletionRequest):
        return body.logprobs
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request(
            f"top_logprobs = {body.top_logprobs}: needs logprobs = true", "top_logprobs"
        )
    return (body.top_logprobs or 0) if body.logprobs else None


def _token_ids(served: ServedModel, prompt: str | list[int], field: str) -> list[int]:
    if isinstance(prompt, str):
        if served.tokenizer is None:
            raise bad_request(
                f"{field}: the model {served.name!r} has no tokenizer; give token ids",
                field,
            )
        try:
            ids = served.tokenizer.encode(prompt)
        except RequestError as error:  # text that is not Unicode
            raise bad_request(f"{field}: {error}", field) from None
    else:
        ids = list(prompt)
    if not ids:
        raise bad_request(f"{field}: empty; give at least one token", field)
    outside = next((t for t in ids if not 0 <= t < served.vocab_size), None)
    if outside is not None:
        raise bad_request(
            f"{field}: token id {outside} is outside the vocabulary (0..{served.vocab_size - 1})",
            field,
        )
    return ids


def _check_context(served: ServedModel, ids: list[int], field: str, room_for_answer: bool) -> None:
    limit = served.max_model_len - 1 if room_for_answer else served.max_model_len
    if len(ids) > limit:
        kept = " (one token of the context is kept for the answer)" if room_for_answer else ""
        raise bad_request(
            f"{field}: {len(ids)} tokens; this model's context is {served.max_model_len} "
            f"tokens, so at most {limit} fit{kept}",
            field,
            "context_length_exceeded",
        )
