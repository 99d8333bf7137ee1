"""Registers the built-in Llama model runner through the ``shardline.plugins`` entry point,
the same way a third party registers one."""

from shardline.registry import Component, hookimpl


@hookimpl
def shardline_model_runners() -> list[Component]:
    return [
        Component(
            name="llama",
            target="shardline.models.llama_runner:LlamaModelRunner",
            summary="tensor- and pipeline-parallel Llama (HF safetensors or GGUF)",
        )
    ]
