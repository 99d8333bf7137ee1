"""An executor that breaks the contract, for the executor suite's own tests: it names the wrong
output rank, ignores ``non_block``, lets a worker's exception through unwrapped and forgets
that it was shut down."""

from shardline_executors.uni import UniProcExecutor


class CarelessExecutor(UniProcExecutor):
    @property
    def output_rank(self) -> int:
        return 1

    def collective_rpc(self, method, args=(), kwargs=None, **ignored):
        worker = self._context.worker
        if isinstance(method, str):
            return [getattr(worker, method)(*args, **(kwargs or {}))]
        return [method(worker, *args, **(kwargs or {}))]
