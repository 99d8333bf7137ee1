"""The engine: continuous-batching scheduler, executor driver, and the ``LLM`` front door."""

from shardline.engine.engine import LLMEngine, RequestOutput
from shardline.engine.llm import LLM
from shardline.interfaces.step import SamplingParams

__all__ = ["LLM", "LLMEngine", "RequestOutput", "SamplingParams"]
