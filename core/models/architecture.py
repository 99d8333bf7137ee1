"""A Llama-family architecture, read from an HF ``config.json`` (transformers 4.x or 5.x)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shardline.errors import ConfigError


@dataclass(frozen=True)
class LlamaArchitecture:
    """The shape of a Llama-family decoder."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_positions: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    checkpoint_dtype: str = "float32"

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], source: str = "config.json"
    ) -> LlamaArchitecture:
        """Parse an HF config dict. Transformers 5.x writes ``rope_parameters`` (with
        ``rope_theta``), ``head_dim`` and ``dtype``; 4.x writes ``rope_theta``, sometimes
        ``rope_scaling`` and ``torch_dtype``. Anything not a plain Llama is refused, naming the
        field."""
        model_type = config.get("model_type")
        if model_type != "llama":
            raise ConfigError(f"{source}: model_type = {model_type!r}: only 'llama' is supported")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(
                f"{source}: rope type {rope_type!r} is not supported; allowed: 'default'"
            )
        theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            return cls(
                vocab_size=int(config["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(config["intermediate_size"]),
                num_layers=int(config["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(config.get("num_key_value_heads") or heads),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                rope_theta=float(theta),
                max_positions=int(config.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                attention_bias=bool(config.get("attention_bias", False)),
                mlp_bias=bool(config.get("mlp_bias", False)),
                checkpoint_dtype=str(config.get("dtype") or config.get("torch_dtype") or "float32"),
            )
        except KeyError as error:
            raise ConfigError(f"{source}: required field {error.args[0]!r} is missing") from None


def partition_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Decoder layers of pipeline stage ``pp_rank``: contiguous, sizes differing by at most
    one, earlier stages taking the extra layers. Every stage gets at least one layer."""
    problem = pipeline_parallel_problem(num_layers, pp_size)
    if problem is not None:
        raise ConfigError(problem)
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (1 if pp_rank < extra else 0))


def pipeline_parallel_problem(num_layers: int, pp_size: int) -> str | None:
    """Why the model cannot be cut into ``pp_size`` stages (each needs a layer), or None."""
    if pp_size <= num_layers:
        return None
    return (
        f"parallel.pipeline_parallel_size = {pp_size}: the model has only {num_layers} layers "
        f"(every stage needs one); allowed: 1..{num_layers}"
    )


def check_tensor_parallel(arch: LlamaArchitecture, tp_size: int) -> None:
    """Refuse a tensor-parallel size the model cannot be split over (see
    :func:`tensor_parallel_problem`)."""
    problem = tensor_parallel_problem(arch, tp_size)
    if problem is not None:
        raise ConfigError(problem)


def tensor_parallel_problem(arch: LlamaArchitecture, tp_size: int) -> str | None:
    """Why the model cannot be split over ``tp_size`` ranks, naming the field and the sizes
    that would work, or None. Heads may split unevenly; the MLP width must divide evenly."""
    if arch.num_heads % arch.num_kv_heads:
        return (
            f"model: num_attention_heads ({arch.num_heads}) is not a multiple of "
            f"num_key_value_heads ({arch.num_kv_heads})"
        )
    if tp_size <= arch.num_heads and arch.intermediate_size % tp_size == 0:
        return None
    allowed = [t for t in range(1, arch.num_heads + 1) if arch.intermediate_size % t == 0]
    reason = (
        f"more than the model's {arch.num_heads} attention heads"
        if tp_size > arch.num_heads
        else f"does not divide the model's intermediate_size ({arch.intermediate_size})"
    )
    return (
        f"parallel.tensor_parallel_size = {tp_size}: {reason}; allowed: "
        f"{', '.join(map(str, allowed))}"
    )


def expected_shape(arch: LlamaArchitecture, hf_name: str) -> tuple[int, ...]:
    """The full shape the config implies for checkpoint tensor ``hf_name`` (HF naming)."""
    hidden, q, kv = (
        arch.hidden_size,
        arch.num_heads * arch.head_dim,
        arch.num_kv_heads * arch.head_dim,
    )
    suffix = hf_name.split(".", 3)[-1] if hf_name.startswith("model.layers.") else hf_name
    shapes = {
        "model.embed_tokens.weight": (arch.vocab_size, hidden),
        "lm_head.weight": (arch.vocab_size, hidden),
        "model.norm.weight": (hidden,),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (q, hidden),
        "self_attn.k_proj.weight": (kv, hidden),
        "self_attn.v_proj.weight": (kv, hidden),
        "self_attn.o_proj.weight": (hidden, q),
        "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.bias": (hidden,),
        "mlp.gate_proj.weight": (arch.intermediate_size, hidden),
        "mlp.up_proj.weight": (arch.intermediate_size, hidden),
        "mlp.down_proj.weight": (hidden, arch.intermediate_size),
        "mlp.gate_proj.bias": (arch.intermediate_size,),
        "mlp.up_proj.bias": (arch.intermediate_size,),
        "mlp.down_proj.bias": (hidden,),
    }
    return shapes[suffix]
