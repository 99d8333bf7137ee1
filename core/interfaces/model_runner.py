"""What a rank computes: the ModelRunner contract."""

from __future__ import annotations

import abc
from typing import Any

from shardline.interfaces.intermediate import IntermediateTensors


class ModelRunner(abc.ABC):
    """Owns one rank's model shard, its request state and KV cache, and runs one step.

    A ModelRunner is built by the rank's Worker with the rank's ``ParallelState`` and the
    engine config; it never looks up groups through globals.
    """

    @abc.abstractmethod
    def load_model(self) -> None:
        """Build the model for this rank's pipeline stage and load only this rank's shard.

        Raises :class:`~shardline.errors.ConfigError` for a checkpoint that does not fit the
        parallel layout (e.g. heads not divisible by the tensor-parallel size).
        """

    @abc.abstractmethod
    def execute_model(
        self, scheduler_output: Any, intermediate_tensors: IntermediateTensors | None
    ) -> Any:
        """Run one scheduler step on this rank.

        ``scheduler_output`` describes new, continuing and finished requests and how many
        tokens of each to compute. ``intermediate_tensors`` is None on the first pipeline stage
        and the previous stage's output elsewhere (possibly still arriving: touching it waits).

        Returns:
        - ``IntermediateTensors`` on a stage that is not the last, for the Worker to send on;
        - a model-runner output (sampled token ids per request) on the last stage;
        - ``None`` when this rank produces nothing for the caller (e.g. a step with no tokens).
        Every rank of a tensor-parallel group samples identically.
        """

    def pool(self) -> Any:
        """The pooling output of the last step (reference: seed 000's pooling path), called by
        the Worker on the last pipeline stage when ``execute_model`` returned None. Returns a
        model-runner output carrying one embedding per finished pooling request, or None when
        the last step pooled nothing (the default: a runner without pooling)."""
        return None
