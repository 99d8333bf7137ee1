"""``shardline serve``'s parts: the OpenAI-compatible HTTP app (:mod:`.app`), the engine in a
thread of its own with restart after a failure (:mod:`.engine_loop`), request checking
(:mod:`.inputs`, :mod:`.protocol`), responses and streams (:mod:`.outputs`) and the
Prometheus metrics (:mod:`.metrics`)."""

from shardline.serve.app import build_app
from shardline.serve.engine_loop import EngineLoop
from shardline.serve.inputs import ServedModel
from shardline.serve.metrics import ServeMetrics

__all__ = ["EngineLoop", "ServeMetrics", "ServedModel", "build_app"]
