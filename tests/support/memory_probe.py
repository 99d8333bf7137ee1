"""What a rank really holds, read inside its process (for ``collective_rpc``)."""

from __future__ import annotations


def bytes_held(worker) -> tuple[int, int]:
    """The bytes of the rank's model parameters and of its KV cache tensors."""
    runner = worker.model_runner
    parameters = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    cache = sum(
        t.numel() * t.element_size() for c in runner.kv_caches.values() for t in (c.key, c.value)
    )
    return parameters, cache
