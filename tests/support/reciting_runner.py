"""A Llama runner that computes every step but answers by reciting its prompt: output token
``j`` is prompt token ``j`` (modulo the prompt's length), and drafts are accepted as far as
they recite it. Prompt lookup then guesses whole runs right: steps add several tokens."""

from shardline.interfaces.step import ModelRunnerOutput
from shardline.models.llama_runner import LlamaModelRunner


class RecitingRunner(LlamaModelRunner):
    def execute_model(self, scheduler_output, intermediate_tensors):
        output = super().execute_model(scheduler_output, intermediate_tensors)
        if not isinstance(output, ModelRunnerOutput):
            return output
        sampled, accepted = [], []
        for req_id, token in zip(output.req_ids, output.sampled_token_ids, strict=True):
            request = self.requests[req_id]
            prompt = request.token_ids[: request.num_prompt_tokens]
            said = len(request.token_ids) - request.num_prompt_tokens
            drafts = request.spec_token_ids if token is not None else ()
            kept = 0
            while kept < len(drafts) and drafts[kept] == prompt[(said + kept) % len(prompt)]:
                kept += 1
            sampled.append(None if token is None else prompt[(said + kept) % len(prompt)])
            accepted.append(kept)
        counts = None if output.num_accepted_drafts is None else accepted
        return ModelRunnerOutput(output.req_ids, sampled, num_accepted_drafts=counts)
