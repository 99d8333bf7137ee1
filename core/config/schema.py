"""The configuration schema. Every section rejects unknown keys, takes values of their own
type only (``true`` is not a size, ``"2"`` in a JSON file is not a number), and bounds every
number, so that no single value can overflow or exhaust anything later."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from shardline.distributed.layout import ParallelLayout
from shardline.launch.core_binding import CoreBinding

DType = Literal["float32", "float16", "bfloat16"]

#: The largest size of one parallel dimension, and of the whole world.
MAX_PARALLEL_SIZE = 1024
MAX_WORLD_SIZE = 65536
#: The longest deadline: one day.
MAX_TIMEOUT_S = 86400.0
#: Counts of tokens, blocks and requests: at most 2^24.
MAX_COUNT = 1 << 24

ParallelSize = Annotated[int, Field(ge=1, le=MAX_PARALLEL_SIZE)]
Count = Annotated[int, Field(ge=1, le=MAX_COUNT)]
Seconds = Annotated[float, Field(gt=0, le=MAX_TIMEOUT_S, allow_inf_nan=False)]
Name = Annotated[str, Field(min_length=1, max_length=512)]


#: ``model.weight_dtype`` for a GGUF file's quantization blocks, held as they are.
GGUF_BLOCKS = "gguf"


def allowed_weight_dtypes(dtype: str) -> list[str | None]:
    """The ``model.weight_dtype`` values a model of ``dtype`` takes: null, ``dtype``, and
    bfloat16 and gguf for float32."""
    return [None, dtype] + (["bfloat16", GGUF_BLOCKS] if dtype == "float32" else [])


def allowed_activation_dtypes(weight_dtype: str | None) -> list[str | None]:
    """The ``model.activation_dtype`` values a model of ``weight_dtype`` takes: null, and int8
    with gguf."""
    return [None] + (["int8"] if weight_dtype == GGUF_BLOCKS else [])


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class ModelConfig(Section):
    """What to run."""

    path: Annotated[str, Field(min_length=1, max_length=4096)] | None = Field(
        default=None,
        description="HF safetensors directory, GGUF file or catalog name; None: no model",
    )
    dtype: DType = Field(default="float32", description="compute dtype of weights and activations")
    weight_dtype: DType | Literal["gguf"] | None = Field(
        default=None,
        description="dtype the linear layers' weights (the LM head's too) are held in; None: "
        "dtype. bfloat16 with dtype float32: each weight rounded to bfloat16, multiplied in "
        "float32 (held in half the memory where the C linear kernel runs: a CPU with AVX-512 "
        "or AVX2 and FMA). gguf with dtype float32 and a GGUF file: each weight held as the "
        "file's own quantization blocks (Q4_0, Q4_1, Q4_K, Q6_K as they are; Q8_0, Q5_0, "
        "IQ4_NL in Q8_0 blocks; other types split into int8 and float32 scales), widened as "
        "read: the "
        "float32 results, bit for bit, from 0.56-1.5 bytes a weight, planned so (where the "
        "CPU has AVX-512 or AVX2 with F16C; else float32)",
    )
    activation_dtype: Literal["int8"] | None = Field(
        default=None,
        description="null: the linear layers multiply float32 inputs; int8 with weight_dtype "
        "gguf: weights of the file's 4-bit types (Q4_0, Q4_1, Q4_K) and of its 8-bit ones "
        "of a scale per 32 (Q8_0, Q5_0, IQ4_NL) are held as codes and "
        "multiplied by their inputs quantized to int8 per 16 (a scale each) in integers "
        "(faster; no longer the float32 results: the activations are rounded), on a CPU with "
        "AVX-512 VNNI or AVX2; other weights as gguf holds them",
    )
    runner: Name = Field(
        default="llama", description="model runner: a registered name or package.module:Class"
    )
    pooling: Literal["last", "mean"] = Field(
        default="last",
        description="embeddings: the last token's final hidden state, or the mean over tokens",
    )
    normalize_embeddings: bool = Field(default=True, description="L2-normalize embeddings")

    @model_validator(mode="after")
    def _int8_activations_with_gguf_blocks(self) -> ModelConfig:
        if self.activation_dtype not in allowed_activation_dtypes(self.weight_dtype):
            raise ValueError(
                f"activation_dtype = {self.activation_dtype!r} with weight_dtype = "
                f"{self.weight_dtype!r}: allowed: activation_dtype null, or 'int8' with "
                f"weight_dtype {GGUF_BLOCKS!r}"
            )
        return self

    @model_validator(mode="after")
    def _weight_dtype_allowed(self) -> ModelConfig:
        allowed = allowed_weight_dtypes(self.dtype)
        if self.weight_dtype not in allowed:
            raise ValueError(
                f"weight_dtype = {self.weight_dtype!r} with dtype = {self.dtype!r}: allowed: "
                + ", ".join("null" if name is None else repr(name) for name in allowed)
            )
        return self

    @property
    def weight_precision(self) -> str:
        """The dtype whose values the linear weights have: ``weight_dtype``, else ``dtype``
        (gguf: ``dtype``, the values as loaded; what they are held in is the kernels'
        choice: ``held_weight_dtype``)."""
        if self.weight_dtype == GGUF_BLOCKS:
            return self.dtype
        return self.weight_dtype or self.dtype

    @property
    def holds_gguf_blocks(self) -> bool:
        """Whether the linear weights are held in the GGUF file's quantization blocks."""
        return self.weight_dtype == GGUF_BLOCKS

    @property
    def holds_codes(self) -> bool:
        """Whether weights of the file's 4-bit types (and Q8_0's) are held as codes that
        multiply inputs quantized to int8 (``activation_dtype: int8``)."""
        return self.holds_gguf_blocks and self.activation_dtype == "int8"


class CacheConfig(Section):
    """The paged KV cache of every rank, and the share of the host's memory the job may use
    (checked against the model's plan before anything starts: :mod:`shardline.config.capacity`)."""

    block_size: Annotated[int, Field(ge=1, le=4096)] = Field(
        default=16, description="tokens per cache block"
    )
    num_blocks: Annotated[int, Field(ge=1, le=(1 << 31) - 1)] | Literal["auto"] = Field(
        default=512,
        description="cache blocks per rank and layer; auto: as many as the memory budget "
        "leaves, at most what scheduler.max_num_seqs sequences of max_model_len can use",
    )
    prefix_caching: bool = Field(
        default=True,
        description="share the cache blocks of a prompt's beginning between requests that "
        "begin the same way (whole blocks; a request computes from the first block not found)",
    )
    memory_fraction: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = Field(
        default=0.9,
        description="the most of this host's available memory the job's ranks on it may use "
        "in all (weights, KV cache, activations, a process each); a plan over it is refused",
    )


class SchedulerConfig(Section):
    """Continuous batching: what one engine step may hold."""

    max_num_seqs: Annotated[int, Field(ge=1, le=65536)] = Field(
        default=32, description="requests in one step at most"
    )
    max_num_batched_tokens: Count = Field(
        default=512, description="token budget of one step (prefill chunks + decode tokens)"
    )
    max_model_len: Count | None = Field(
        default=None,
        description="longest sequence (prompt + output); None: the model's context length, "
        "capped by what the KV cache holds",
    )


#: The most draft tokens a speculative step may propose for a request: with its last token
#: they stay a short run of queries (shardline.layers.kernels.ROW_WISE_QUERIES).
MAX_SPECULATIVE_TOKENS = 15


class SpeculativeConfig(Section):
    """Speculative decoding: a step checks a request's guessed next tokens (drafts) along with
    its last one, and keeps those the model itself chooses (greedy, or drawn with the seed of
    each output token's index: the tokens are those of a run without drafts)."""

    method: Literal["none", "ngram"] = Field(
        default="none",
        description="none: off; ngram: draft the tokens that followed an earlier occurrence "
        "of the request's last tokens in its prompt and output (prompt lookup)",
    )
    num_speculative_tokens: Annotated[int, Field(ge=1, le=MAX_SPECULATIVE_TOKENS)] = Field(
        default=4,
        description="draft tokens a request proposes per step at most (heuristic: at first)",
    )
    draft_schedule: Literal["constant", "heuristic"] = Field(
        default="constant",
        description="constant: num_speculative_tokens a step; heuristic: each request's "
        "draft length starts there, grows by 2 after a step whose drafts were all accepted "
        f"and shrinks by 1 after one whose were not (1 to {MAX_SPECULATIVE_TOKENS}), as "
        "transformers' assisted generation schedules it",
    )
    prompt_lookup_max: Annotated[int, Field(ge=1, le=64)] = Field(
        default=4, description="the longest match with the request's last tokens that counts"
    )
    prompt_lookup_min: Annotated[int, Field(ge=1, le=64)] = Field(
        default=2,
        description="how many last tokens are looked up: their latest earlier places are "
        "the candidates, the one matching furthest back (to prompt_lookup_max) wins",
    )

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min = {self.prompt_lookup_min}: must be at most "
                f"prompt_lookup_max = {self.prompt_lookup_max}"
            )
        return self


class SamplingConfig(Section):
    """Default sampling of ``LLM.generate`` and ``shardline run`` (a call may pass its own)."""

    temperature: float = Field(
        default=0.0, ge=0, le=100, allow_inf_nan=False, description="0: greedy"
    )
    top_k: int = Field(
        default=0, ge=0, le=MAX_COUNT, description="keep the k likeliest tokens; 0: off"
    )
    top_p: float = Field(
        default=1.0, gt=0, le=1, allow_inf_nan=False, description="nucleus mass; 1.0: off"
    )
    seed: int = Field(
        default=0, ge=0, le=(1 << 63) - 1, description="seed of each request's random stream"
    )
    max_tokens: Count = Field(default=256, description="tokens generated at most")


class ParallelConfig(Section):
    """How ranks are laid out, started and connected."""

    tensor_parallel_size: ParallelSize = Field(default=1, description="ranks sharing each layer")
    pipeline_parallel_size: ParallelSize = Field(default=1, description="pipeline stages")
    data_parallel_size: ParallelSize = Field(default=1, description="model replicas")
    external_data_parallel_size: ParallelSize = Field(
        default=1, description="replicas driven by separate engines"
    )
    data_parallel_rank: Annotated[int, Field(ge=0, le=MAX_COUNT)] | None = Field(
        default=None,
        description="set by the engine, not by users: this config is the world of replica "
        "data_parallel_rank of data_parallel_size (its layout has one replica); None: the job",
    )
    nnodes: ParallelSize = Field(default=1, description="hosts the ranks run on")
    device: Literal["cpu", "cuda"] = Field(default="cpu", description="device of the tensors")
    distributed_executor_backend: Name = Field(
        default="auto",
        description="executor: auto, a registered name (uni, mp, external_launcher, ...) or "
        "package.module:Class",
    )
    communicator: Name = Field(
        default="gloo",
        description="data-plane communicator: a registered name, package.module:Class, or "
        "auto (the installed one that fits with the highest preference its plugin declares: "
        "the fastest; `shardline explain` lists the order)",
    )
    control_communicator: Name = Field(
        default="gloo",
        description="control-plane communicator (objects, metadata, barriers); CPU only",
    )
    timeout_s: Seconds = Field(
        default=300.0, description="deadline of every collective and point-to-point wait"
    )
    watchdog: bool = Field(
        default=True,
        description="fingerprint every data-plane operation; a timeout then says which rank "
        "is in which operation",
    )
    watchdog_check_every: Annotated[int, Field(ge=0, le=MAX_COUNT)] = Field(
        default=0,
        description="debug: ranks compare fingerprints every N collectives (0: only on a "
        "timeout) and stop at the first mismatch",
    )
    startup_timeout_s: Seconds = Field(
        default=120.0, description="deadline of each start-up phase (spawn, join, load)"
    )
    cpu_binding: Annotated[str, Field(min_length=1, max_length=4096)] = Field(
        default="none",
        description="cores of the rank processes Shardline or a launcher starts: none (where "
        "the scheduler puts them), auto (the cores this process may use split into one "
        "contiguous set per rank on the host; an mp driver joins the last rank's), or one set "
        "per rank on the host, '|' between sets: '0-3|4-7'",
    )

    @model_validator(mode="after")
    def _replica_rank_in_range(self) -> ParallelConfig:
        rank = self.data_parallel_rank
        if rank is not None and rank >= self.data_parallel_size:
            raise ValueError(
                f"data_parallel_rank = {rank}: allowed: 0..{self.data_parallel_size - 1} "
                f"(data_parallel_size = {self.data_parallel_size})"
            )
        return self

    @field_validator("cpu_binding", mode="before")
    @classmethod
    def _one_core_as_text(cls, value: object) -> object:
        # One rank's one core written as a number (`cpu_binding: 3`) is that core's set.
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value

    @model_validator(mode="after")
    def _cpu_binding_parses(self) -> ParallelConfig:
        CoreBinding.parse(self.cpu_binding)
        return self

    @model_validator(mode="after")
    def _bounded_world(self) -> ParallelConfig:
        if self.world_size > MAX_WORLD_SIZE:
            raise ValueError(
                f"the layout has {self.world_size} ranks (tensor x pipeline x data x external "
                f"data parallel sizes); allowed: at most {MAX_WORLD_SIZE}"
            )
        return self

    @property
    def layout(self) -> ParallelLayout:
        """The rank layout of these sizes: groups, each rank's coordinates, and
        ``output_rank`` (the rank whose ``execute_model`` reply the executor returns)."""
        return ParallelLayout(
            tensor_parallel_size=self.tensor_parallel_size,
            pipeline_parallel_size=self.pipeline_parallel_size,
            data_parallel_size=1
            if self.data_parallel_rank is not None
            else self.data_parallel_size,
            external_data_parallel_size=self.external_data_parallel_size,
        )

    @property
    def world_size(self) -> int:
        """Ranks in this world: tensor x pipeline x data x external data parallel sizes (one
        replica's when ``data_parallel_rank`` is set)."""
        return self.layout.world_size

    @property
    def core_binding(self) -> CoreBinding:
        """``cpu_binding`` parsed."""
        return CoreBinding.parse(self.cpu_binding)

    @property
    def worlds_side_by_side(self) -> int:
        """How many worlds like this one the job runs at once (``data_parallel_size`` for a
        replica's config, else 1): a rank's share of the host's cores counts them all."""
        return self.data_parallel_size if self.data_parallel_rank is not None else 1

    def replica(self, index: int) -> ParallelConfig:
        """The config of data-parallel replica ``index``'s world."""
        return type(self).model_validate({**self.model_dump(), "data_parallel_rank": index})


class ServeConfig(Section):
    """``shardline serve``: how much it lets wait."""

    max_waiting_requests: Count = Field(
        default=128,
        description="prompts that may wait for a place in the running batch (a request is one "
        "per choice of n, an embeddings request one per input; one with more waits alone); "
        "beyond them a request is refused at once (HTTP 503 with Retry-After)",
    )


class PluginsConfig(Section):
    """Which plugins load. ``SHARDLINE_PLUGINS`` (comma-separated names) overrides ``allow``."""

    allow: Annotated[list[Name], Field(max_length=1024)] | None = Field(
        default=None, description="entry-point names to load; None: every installed plugin"
    )
    strict: bool = Field(default=False, description="a plugin that fails to load is fatal")


class EngineConfig(Section):
    """The whole configuration, one section per concern (an executor reads ``parallel``:
    ``world_size``, ``layout.output_rank``, ``timeout_s``, ``startup_timeout_s``). Frozen:
    derive a changed copy with ``model_copy(update=...)``."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    sampling: SamplingConfig = SamplingConfig()
    speculative: SpeculativeConfig = SpeculativeConfig()
    parallel: ParallelConfig = ParallelConfig()
    serve: ServeConfig = ServeConfig()
    plugins: PluginsConfig = PluginsConfig()
