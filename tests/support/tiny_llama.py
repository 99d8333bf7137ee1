"""A small random Llama written by HF transformers (real safetensors files), and the reference
logits transformers computes for it."""

from __future__ import annotations

from pathlib import Path

import torch

PROMPTS = [[1, 5, 9, 33, 2, 7, 7, 80], [3, 99, 4]]


def write_tiny_llama(directory: Path, **overrides) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    settings = dict(
        vocab_size=100,  # not a multiple of 64 * tp: exercises vocab padding
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    settings.update(overrides)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**settings)).eval()
    model.save_pretrained(directory)
    return directory


def reference_logits(
    directory: Path, sequences: list[list[int]], linear_weights: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Per sequence, transformers' logits ``[len, vocab]`` for the whole sequence, in float32;
    with ``linear_weights``, every linear layer's weight (the LM head's too) first rounded to
    that dtype."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if linear_weights is not None:
        round_linear_weights(model, linear_weights)
    with torch.no_grad():
        return [model(torch.tensor([seq])).logits[0] for seq in sequences]


def round_linear_weights(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Round every linear layer's weight of ``model`` (the LM head's too) to ``dtype``, in
    place, keeping its own dtype."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(module.weight.to(dtype))
