"""The Llama family's model runner: the decoder-only runner with a Llama stage, loaded from
an HF safetensors directory or a GGUF file, and the memory plan of its ranks."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from shardline.config.schema import GGUF_BLOCKS, EngineConfig
from shardline.dtypes import torch_dtype
from shardline.errors import ConfigError
from shardline.launch.threads import stage_threads
from shardline.layers.kernels import holds_quantization_blocks, layer_kernels
from shardline.models.llama import LlamaForCausalLM
from shardline.models.memory import HeldBlocks, LlamaPlan
from shardline.weights import open_checkpoint
from shardline.weights.gguf_checkpoint import GGUFCheckpoint
from shardline.worker.model_runner import CausalLMRunner

if TYPE_CHECKING:
    from shardline.weights.hf import HFCheckpoint


class LlamaModelRunner(CausalLMRunner):
    """Tensor- and pipeline-parallel Llama (HF safetensors or GGUF)."""

    @classmethod
    def plan(cls, config: EngineConfig) -> LlamaPlan:
        """The layout checked against the checkpoint's architecture (its metadata only, its
        string arrays decoded in C as the ranks' are), and what each rank will hold."""
        return _plan_of(open_checkpoint(config.model.path, os.environ), config)

    def build_model(self) -> LlamaForCausalLM:
        checkpoint = open_checkpoint(
            self.config.model.path, os.environ, keep_blocks=self.config.model.holds_gguf_blocks
        )
        model = LlamaForCausalLM(
            checkpoint.architecture,
            self.state,
            torch_dtype(self.config.model.dtype),
            layer_kernels(
                self.device,
                os.environ,
                torch_dtype(self.config.model.weight_precision),
                quantized=self.config.model.holds_gguf_blocks,
                codes=self.config.model.holds_codes,
                threads=stage_threads(self.config.parallel, os.environ),
            ),
        )
        model.load_weights(checkpoint.tensor, source=str(self.config.model.path))
        if self.config.model.holds_gguf_blocks:
            self._check_blocks_as_planned(model, checkpoint)
        return model

    def _check_blocks_as_planned(
        self, model: LlamaForCausalLM, checkpoint: GGUFCheckpoint | HFCheckpoint
    ) -> None:
        """A ConfigError where this rank holds more weight bytes than its plan counted with
        the file's block kinds (planned from ``checkpoint``, already open): some weight is
        held in float32 here (the plan was made on the driver's host: this rank's CPU may
        lack the block kernels)."""
        plan = _plan_of(checkpoint, self.config)
        memory = plan.rank_memory(self.state.pp.rank_in_group, self.state.tp.rank_in_group, 1, 0)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        if held > memory.weights:
            mib = 2**20
            raise ConfigError(
                f"model.weight_dtype = {GGUF_BLOCKS!r}: rank {self.state.rank} holds "
                f"{held / mib:.1f} MiB of weights, {memory.weights / mib:.1f} MiB planned from "
                "the file's block kinds: some weight stays float32 on this rank (its CPU "
                "needs AVX-512, or AVX2 with F16C, for the block kernels); allowed here: "
                "model.weight_dtype null"
            )


def _plan_of(checkpoint: GGUFCheckpoint | HFCheckpoint, config: EngineConfig) -> LlamaPlan:
    """:meth:`LlamaModelRunner.plan` from an opened checkpoint (its metadata only)."""
    held_blocks = None
    if config.model.holds_gguf_blocks:
        if not isinstance(checkpoint, GGUFCheckpoint):
            raise ConfigError(
                f"model.weight_dtype = {GGUF_BLOCKS!r} holds a GGUF file's quantization "
                f"blocks; model.path = {str(config.model.path)!r} is not a GGUF file "
                "(allowed with it: null, 'float32', 'bfloat16')"
            )
        if holds_quantization_blocks(config.parallel.device, os.environ):
            held_blocks = HeldBlocks.of(
                checkpoint.tensor_types(),
                checkpoint.architecture.tie_word_embeddings,
                codes=config.model.holds_codes,
            )
    return LlamaPlan.of(checkpoint.architecture, config, os.environ, held_blocks)
