"""The configuration schema. Every section rejects unknown keys."""

from __future__ import annotations

from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
)

from shardline.distributed.layout import ParallelLayout

DType = Literal["float32", "float16", "bfloat16"]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(Section):
    """What to run."""

    path: str | None = Field(
        default=None, description="HF safetensors directory or GGUF file; None: no model"
    )
    dtype: DType = Field(default="float32", description="compute dtype of weights and activations")
    runner: str = Field(
        default="llama", description="model runner: a registered name or package.module:Class"
    )
    pooling: Literal["last", "mean"] = Field(
        default="last",
        description="embeddings: the last token's final hidden state, or the mean over tokens",
    )
    normalize_embeddings: bool = Field(default=True, description="L2-normalize embeddings")


class CacheConfig(Section):
    """The paged KV cache of every rank."""

    block_size: PositiveInt = Field(default=16, description="tokens per cache block")
    num_blocks: PositiveInt = Field(default=512, description="cache blocks per rank and layer")


class SchedulerConfig(Section):
    """Continuous batching: what one engine step may hold."""

    max_num_seqs: PositiveInt = Field(default=32, description="requests in one step at most")
    max_num_batched_tokens: PositiveInt = Field(
        default=512, description="token budget of one step (prefill chunks + decode tokens)"
    )
    max_model_len: PositiveInt | None = Field(
        default=None,
        description="longest sequence (prompt + output); None: the model's context length, "
        "capped by what the KV cache holds",
    )


class SamplingConfig(Section):
    """Default sampling of ``LLM.generate`` and ``shardline run`` (a call may pass its own)."""

    temperature: float = Field(default=0.0, ge=0, description="0: greedy")
    top_k: int = Field(default=0, ge=0, description="keep the k likeliest tokens; 0: off")
    top_p: float = Field(default=1.0, gt=0, le=1, description="nucleus mass; 1.0: off")
    seed: int = Field(default=0, description="seed of each request's random stream")
    max_tokens: PositiveInt = Field(default=256, description="tokens generated at most")


class ParallelConfig(Section):
    """How ranks are laid out, started and connected."""

    tensor_parallel_size: PositiveInt = Field(default=1, description="ranks sharing each layer")
    pipeline_parallel_size: PositiveInt = Field(default=1, description="pipeline stages")
    data_parallel_size: PositiveInt = Field(default=1, description="model replicas")
    external_data_parallel_size: PositiveInt = Field(
        default=1, description="replicas driven by separate engines"
    )
    nnodes: PositiveInt = Field(default=1, description="hosts the ranks run on")
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="device of the tensors")
    distributed_executor_backend: str = Field(
        default="auto",
        description="executor: auto, a registered name (uni, mp, external_launcher, ...) or "
        "package.module:Class",
    )
    communicator: str = Field(
        default="gloo",
        description="data-plane communicator: a registered name, package.module:Class, or "
        "auto (the fastest installed one that fits: custom_ar_mpi, custom_ar, nccl, mpi, gloo)",
    )
    control_communicator: str = Field(
        default="gloo",
        description="control-plane communicator (objects, metadata, barriers); CPU only",
    )
    timeout_s: PositiveFloat = Field(
        default=300.0, description="deadline of every collective and point-to-point wait"
    )
    watchdog: bool = Field(
        default=True,
        description="fingerprint every data-plane operation; a timeout then says which rank "
        "is in which operation",
    )
    watchdog_check_every: NonNegativeInt = Field(
        default=0,
        description="debug: ranks compare fingerprints every N collectives (0: only on a "
        "timeout) and stop at the first mismatch",
    )
    startup_timeout_s: PositiveFloat = Field(
        default=120.0, description="deadline of each start-up phase (spawn, join, load)"
    )

    @property
    def layout(self) -> ParallelLayout:
        return ParallelLayout(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=self.data_parallel_size,
            external_data_parallel_size=self.external_data_parallel_size,
        )

    @property
    def world_size(self) -> int:
        return self.layout.world_size


class PluginsConfig(Section):
    """Which plugins load. ``SHARDLINE_PLUGINS`` (comma-separated names) overrides ``allow``."""

    allow: list[str] | None = Field(
        default=None, description="entry-point names to load; None: every installed plugin"
    )
    strict: bool = Field(default=False, description="a plugin that fails to load is fatal")


class EngineConfig(Section):
    """The whole configuration."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    sampling: SamplingConfig = SamplingConfig()
    parallel: ParallelConfig = ParallelConfig()
    plugins: PluginsConfig = PluginsConfig()
