"""The Llama family's model runner: the decoder-only runner with a Llama stage, loaded from
an HF safetensors directory or a GGUF file, and the memory plan of its ranks."""

from __future__ import annotations

import os

from shardline.config.schema import GGUF_BLOCKS, EngineConfig
from shardline.dtypes import torch_dtype
from shardline.errors import ConfigError
from shardline.layers.kernels import layer_kernels
from shardline.models.llama import LlamaForCausalLM
from shardline.models.memory import LlamaPlan
from shardline.weights import open_checkpoint
from shardline.weights.gguf_checkpoint import GGUFCheckpoint
from shardline.worker.model_runner import CausalLMRunner


class LlamaModelRunner(CausalLMRunner):
    """Tensor- and pipeline-parallel Llama (HF safetensors or GGUF)."""

    @classmethod
    def plan(cls, config: EngineConfig) -> LlamaPlan:
        """The layout checked against the checkpoint's architecture (its metadata only), and
        what each rank will hold."""
        checkpoint = open_checkpoint(config.model.path)
        if config.model.holds_gguf_blocks and not isinstance(checkpoint, GGUFCheckpoint):
            raise ConfigError(
                f"model.weight_dtype = {GGUF_BLOCKS!r} holds a GGUF file's quantization "
                f"blocks; model.path = {str(config.model.path)!r} is not a GGUF file "
                "(allowed with it: null, 'float32', 'bfloat16')"
            )
        return LlamaPlan.of(checkpoint.architecture, config, os.environ)

    def build_model(self) -> LlamaForCausalLM:
        checkpoint = open_checkpoint(self.config.model.path, os.environ)
        model = LlamaForCausalLM(
            checkpoint.architecture,
            self.state,
            torch_dtype(self.config.model.dtype),
            layer_kernels(
                self.device,
                os.environ,
                torch_dtype(self.config.model.weight_precision),
                quantized=self.config.model.holds_gguf_blocks,
            ),
        )
        model.load_weights(checkpoint.tensor, source=str(self.config.model.path))
        return model
