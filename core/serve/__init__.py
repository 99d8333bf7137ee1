"""``shardline serve``'s parts: the OpenAI-compatible HTTP app (:mod:`.app`), the engine in a
thread of its own with restart after a failure (:mod:`.engine_loop`), request checking
(:mod:`.inputs`, :mod:`.protocol`), responses and streams (:mod:`.outputs`), the Prometheus
metrics (:mod:`.metrics`) and the server that drains the engine when told to stop
(:mod:`.draining`)."""

from shardline.serve.app import build_app
from shardline.serve.draining import DrainingServer
from shardline.serve.engine_loop import EngineLoop
from shardline.serve.inputs import ServedModel
from shardline.serve.metrics import ServeMetrics

__all__ = ["DrainingServer", "EngineLoop", "ServeMetrics", "ServedModel", "build_app"]
