"""What a rank computes: the ModelRunner contract."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from shardline.interfaces.intermediate import IntermediateTensors
from shardline.interfaces.step import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from shardline.config.schema import EngineConfig


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank needs beside its process: its weights, the transient of loading them
    (freed before the first step), the activations of its largest step, and one KV-cache
    block over all its layers (the cache is ``num_blocks`` of these)."""

    weights: int
    loading: int
    activations: int
    kv_cache_block: int

    def peak(self, num_blocks: int) -> int:
        """The most the rank holds at once: weights and cache, plus the larger of loading
        and a step."""
        return self.weights + num_blocks * self.kv_cache_block + max(self.loading, self.activations)


class ModelPlan(abc.ABC):
    """What a model decides before any process starts (see :meth:`ModelRunner.plan`)."""

    #: The longest sequence the model itself allows (its context length).
    context_length: int

    @abc.abstractmethod
    def rank_memory(
        self, pp_rank: int, tp_rank: int, max_model_len: int, cache_tokens: int
    ) -> RankMemory:
        """The memory of the rank at pipeline stage ``pp_rank`` and tensor-parallel rank
        ``tp_rank`` (ranks of other data-parallel replicas hold the same), when sequences are
        at most ``max_model_len`` tokens and the KV cache holds ``cache_tokens`` tokens."""


class ModelRunner(abc.ABC):
    """Owns one rank's model shard, its request state and KV cache, and runs one step.

    A ModelRunner is built by the rank's Worker with the rank's ``ParallelState`` and the
    engine config; it never looks up groups through globals.
    """

    #: Whether :meth:`execute_model` starts a new request after its first
    #: ``NewRequest.num_computed_tokens`` tokens, whose keys and values are already in the
    #: first of its blocks (shared with other requests: read, never written). Without it the
    #: engine runs with ``cache.prefix_caching`` off.
    prefix_caching: ClassVar[bool] = False
    #: Whether :meth:`execute_model` verifies drafts: a request with
    #: ``CachedRequest.spec_token_ids`` is scheduled for its last token and those drafts; the
    #: runner samples at each of their positions (as if the drafts before it were the
    #: request's tokens: penalties, the seed of the output token's index), accepts the drafts
    #: up to the first that differs from its own choice, and reports how many in
    #: ``ModelRunnerOutput.num_accepted_drafts`` (and their log-probabilities in
    #: ``draft_logprobs`` where the request asks for them). Without it ``speculative.method`` must
    #: stay ``none``.
    speculative_decoding: ClassVar[bool] = False

    @classmethod
    def plan(cls, config: EngineConfig) -> ModelPlan | None:
        """Called in the driver before any rank process starts (and by ``shardline config
        validate`` and ``explain``), with ``model.path`` resolved to a file or directory.

        Raise :class:`~shardline.errors.ConfigError` listing, in one message, every way the
        config cannot run this model (e.g. more pipeline stages than layers, a
        tensor-parallel size the heads cannot be split over), each naming the field, the
        value and the limit. Return what the ranks will hold so that the host's memory is
        checked before anything is allocated, or None (the default) when the runner cannot
        tell: then only the config's own bounds apply.
        """
        return None

    @abc.abstractmethod
    def load_model(self) -> None:
        """Build the model for this rank's pipeline stage and load only this rank's shard.

        Raises :class:`~shardline.errors.ConfigError` for a checkpoint that does not fit the
        parallel layout (e.g. heads not divisible by the tensor-parallel size).
        """

    @abc.abstractmethod
    def execute_model(
        self, scheduler_output: SchedulerOutput, intermediate_tensors: IntermediateTensors | None
    ) -> ModelRunnerOutput | IntermediateTensors | None:
        """Run one scheduler step on this rank.

        ``scheduler_output`` describes new, continuing and finished requests and how many
        tokens of each to compute. ``intermediate_tensors`` is None on the first pipeline stage
        and the previous stage's output elsewhere (possibly still arriving: touching it waits).

        Returns:
        - ``IntermediateTensors`` on a stage that is not the last, for the Worker to send on;
        - on the last stage, a :class:`ModelRunnerOutput`: the token sampled per request, or
          for a step of embedding requests (``pooling`` set) the pooled vector of each
          request whose prompt the step completed;
        - ``None`` when this rank produces nothing for the caller (e.g. a step with no tokens).
        Every rank of a tensor-parallel group samples identically.
        """
