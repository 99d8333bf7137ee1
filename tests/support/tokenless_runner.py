"""A Llama runner that computes every step but never returns the token it sampled: the
engine's requests can then never finish."""

from shardline.interfaces.step import ModelRunnerOutput
from shardline.models.llama_runner import LlamaModelRunner


class TokenlessRunner(LlamaModelRunner):
    def execute_model(self, scheduler_output, intermediate_tensors):
        output = super().execute_model(scheduler_output, intermediate_tensors)
        if isinstance(output, ModelRunnerOutput):
            return ModelRunnerOutput(output.req_ids, [None] * len(output.req_ids))
        return output
