"""What the scheduler sends each step, and what the output rank sends back."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token. ``temperature == 0`` is greedy; otherwise top-k (0: off)
    then top-p (1.0: off) filtering and a draw from a generator seeded with ``seed``, so every
    rank that samples draws the same token."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    max_tokens: int = 16

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature = {self.temperature}: must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k = {self.top_k}: must be >= 0 (0 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p = {self.top_p}: must be in (0, 1]")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens = {self.max_tokens}: must be >= 1")


@dataclass(frozen=True)
class NewRequest:
    """A request scheduled for the first time: its prompt and the cache blocks it owns."""

    req_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    block_ids: list[int]


@dataclass(frozen=True)
class CachedRequest:
    """A request seen before: tokens appended since its last step (e.g. the token sampled
    then), cache blocks added, and how many of its tokens are already in the cache."""

    req_id: str
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int


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
class ModelRunnerOutput:
    """Per scheduled request (batch order): the token sampled this step, or None when the
    step only computed part of its prompt."""

    req_ids: list[str]
    sampled_token_ids: list[int | None]
