"""The server's Prometheus metrics, in a registry of their own (one per server, no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

#: Histogram buckets (seconds): time to first token spans queueing and prefill, inter-token
#: latency one decode step.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class ServeMetrics:
    """What ``GET /metrics`` reports (names prefixed ``shardline_``). The engine thread
    updates them; prometheus_client makes each update thread-safe."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests_running = Gauge(
            "shardline_requests_running", "requests in the running batch", registry=registry
        )
        self.requests_waiting = Gauge(
            "shardline_requests_waiting",
            "requests accepted and waiting for the running batch",
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "shardline_prompt_tokens", "prompt tokens of admitted requests", registry=registry
        )
        self.generation_tokens = Counter(
            "shardline_generation_tokens", "tokens generated", registry=registry
        )
        self.requests_finished = Counter(
            "shardline_requests_finished",
            "requests ended, by reason: stop, length, pooled (an embedding), abort (the client "
            "went away), error (the engine failed under it)",
            ["reason"],
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "shardline_time_to_first_token_seconds",
            "from a request's arrival to its first token",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "shardline_inter_token_latency_seconds",
            "between consecutive tokens of one request",
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.kv_blocks_used = Gauge(
            "shardline_kv_cache_blocks_used", "KV-cache blocks owned by requests", registry=registry
        )
        self.kv_blocks_total = Gauge(
            "shardline_kv_cache_blocks_total", "KV-cache blocks of the engine", registry=registry
        )
        self.prefix_cache_queries = Counter(
            "shardline_prefix_cache_queries",
            "tokens of admitted requests looked up in the prefix cache",
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "shardline_prefix_cache_hits",
            "tokens of admitted requests found in the prefix cache (not computed again)",
            registry=registry,
        )
        self.spec_draft_tokens = Counter(
            "shardline_spec_decode_draft_tokens",
            "draft tokens proposed by speculative decoding and checked by the model",
            registry=registry,
        )
        self.spec_accepted_tokens = Counter(
            "shardline_spec_decode_accepted_tokens",
            "draft tokens the model accepted (each a token gained without a step of its own)",
            registry=registry,
        )
        self.engine_restarts = Counter(
            "shardline_engine_restarts",
            "times the engine and its ranks were restarted after a failure",
            registry=registry,
        )

    def render(self) -> bytes:
        """The text exposition format."""
        return generate_latest(self.registry)
