"""The typed step: what the scheduler sends every rank each step (:class:`SchedulerOutput`),
and what the output rank sends back (:class:`ModelRunnerOutput`, sampled tokens, with their
log-probabilities where asked, or pooled vectors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The most alternatives a request may ask log-probabilities of, per token (vLLM's default
#: ``max_logprobs``; OpenAI's chat ``top_logprobs`` allows as many).
MAX_LOGPROBS = 20
#: The most tokens one request may bias (OpenAI's limit is 300).
MAX_LOGIT_BIAS = 1024
#: The largest repetition penalty (vLLM allows any positive value; past this it only bans).
MAX_REPETITION_PENALTY = 100.0


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. ``temperature == 0`` is greedy;
    otherwise top-k (0: off) then top-p (1.0: off) filtering and a draw from a generator
    seeded with ``seed`` and the output token's index, so every rank that samples draws the
    same token, and a request computed again after preemption draws what it would have.

    A request stops after ``max_tokens`` tokens, at the model's end-of-sequence token (unless
    ``ignore_eos``), at any of ``stop_token_ids``, or when its text contains one of ``stop``
    (the text is cut before it).

    Before any of that the logits are adjusted, as OpenAI's and vLLM's parameters say:
    ``repetition_penalty`` r (1: off) divides a positive logit by r and multiplies a
    negative one by r for every token already in the prompt or the output;
    ``frequency_penalty`` f and ``presence_penalty`` p (0: off, -2 to 2) subtract
    ``f * count + p * (count > 0)``, ``count`` being how often the token is in the output so
    far; ``logit_bias`` adds ``(token id, bias)`` pairs (bias -100 to 100) last.

    ``logprobs`` k (None: off) asks for each generated token's log-probability and those of
    the k most likely tokens at its position (0 to :data:`MAX_LOGPROBS`), from the model's
    own distribution, before any adjustment, temperature, top-k and top-p (``log_softmax``
    of the logits); ``prompt_logprobs`` k the same for every prompt token but the first
    (which nothing predicts)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes the logits before the choice."""
        return bool(
            self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.logit_bias
        )

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens}: must be >= 1")
        if isinstance(self.stop, str) or any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop = {self.stop!r}: must be a sequence of non-empty strings")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(self, name)
            if asked is not None and not 0 <= asked <= MAX_LOGPROBS:
                raise ValueError(
                    f"{name} = {asked}: must be from 0 to {MAX_LOGPROBS} (or None: off)"
                )
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise ValueError(
                f"repetition_penalty = {self.repetition_penalty}: must be in "
                f"(0, {MAX_REPETITION_PENALTY}] (1: off)"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name} = {getattr(self, name)}: must be from -2 to 2 (0: off)")
        bias = tuple((int(token), float(value)) for token, value in self.logit_bias)
        for token, value in bias:
            if token < 0 or not -100 <= value <= 100:
                raise ValueError(
                    f"logit_bias: token {token} with bias {value}: token ids are >= 0 and "
                    "biases from -100 to 100"
                )
        if len(bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias: {len(bias)} tokens; at most {MAX_LOGIT_BIAS}")
        object.__setattr__(self, "logit_bias", bias)


@dataclass(frozen=True)
class NewRequest:
    """A request scheduled for the first time (or again after preemption): its tokens so far
    and the cache blocks it holds (the first ones may be shared with other requests: read
    them, never write them). ``pooling`` ("last" or "mean") makes it an embedding
    request: its prompt is run, nothing is sampled, and the step that completes the prompt
    returns one vector of the final hidden states in :attr:`ModelRunnerOutput.pooled`."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]
    pooling: str | None = None
    #: How many of ``prompt_token_ids`` were generated (a request scheduled again after
    #: preemption): the penalties count them as output.
    num_output_tokens: int = 0
    #: How many of ``prompt_token_ids`` already have their keys and values in the first of
    #: ``block_ids`` (blocks found in the prefix cache): computing starts after them.
    num_computed_tokens: int = 0


@dataclass(frozen=True)
class CachedRequest:
    """A request seen before: tokens appended since its last step (e.g. the token sampled
    then), cache blocks added, and how many of its tokens are already in the cache.
    ``spec_token_ids``: this step's drafts (speculative decoding), guessed tokens after its
    last one; the step is scheduled for the last token and every draft (their keys and values
    are written, the drafts after the first rejected one are overwritten later), and they are
    not the request's tokens unless accepted (they come back in the next step's
    ``new_token_ids`` then)."""

    req_id: str
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int
    spec_token_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: which requests run and how many tokens of each (prefill chunks and decode
    tokens mixed), in batch order, and which requests finished since the last step."""

    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())


@dataclass(frozen=True)
class TokenLogprobs:
    """A generated token's log-probability and, most likely first, the ``(token id,
    log-probability)`` of the k most likely tokens at its position (k: the request's
    ``logprobs``)."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class ModelRunnerOutput:
    """Per scheduled request (batch order): the token sampled this step, or None when the
    step only computed part of its prompt. A pooling step has ``pooled`` instead: per request
    its embedding (float32, ``[hidden]``), or None for a prompt chunk that is not the last.
    ``logprobs``, when some request of the step asked for them: per request its token's
    :class:`TokenLogprobs`, or None (no token, or not asked). A request with drafts gets
    ``num_accepted_drafts``. ``prompt_logprobs``, likewise:
    per request ``(i, scores)``, the scores of its prompt tokens ``i``, ``i + 1``, ... that
    this step's part of the prompt predicts, or None."""

    req_ids: list[str]
    sampled_token_ids: list[int | None]
    pooled: list[Any] | None = None
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: list[tuple[int, list[TokenLogprobs]] | None] | None = None
    #: Per request, how many of its drafts (``CachedRequest.spec_token_ids``) were accepted:
    #: its new tokens are those drafts and then the sampled token; None when the step had no
    #: drafts.
    num_accepted_drafts: list[int] | None = None
    #: Per request with drafts, where ``logprobs`` are given: its accepted drafts'
    #: :class:`TokenLogprobs`, in order (before ``logprobs``' entry, the sampled token's);
    #: None for the other requests, and when the step had no drafts.
    draft_logprobs: list[list[TokenLogprobs] | None] | None = None
