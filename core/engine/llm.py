"""``LLM``: the front door. Text in, text (or embeddings) out, every part chosen by config."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from shardline.config.loader import LoadedConfig, load_config
from shardline.engine.engine import LLMEngine, RequestOutput
from shardline.errors import RequestError
from shardline.interfaces.step import SamplingParams
from shardline.registry import Registry

Prompt = str | Sequence[int]
Messages = Sequence[Mapping[str, str]]
#: Called after every step with a request's output so far and the text it just gained.
StreamCallback = Callable[[RequestOutput, str], None]


class LLM:
    """A model served by ranks the config describes.

    ``config`` is a :class:`LoadedConfig`, a config file path, or None (defaults);
    ``overrides`` are ``section.key=value`` strings applied on top. ``model.path`` may name a
    cataloged model (e.g. ``smollm2-135m``), pulled into the cache on first use.

    Use as a context manager, or call :meth:`shutdown`: the ranks live until then.
    """

    def __init__(
        self,
        config: LoadedConfig | str | Path | None = None,
        *,
        overrides: Sequence[str] = (),
        environ: Mapping[str, str] | None = None,
        registry: Registry | None = None,
        pull_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        if isinstance(config, LoadedConfig) and overrides:
            raise TypeError("overrides apply to a config path or None, not a LoadedConfig")
        if not isinstance(config, LoadedConfig):
            config = load_config(config, overrides, environ)
            for warning in config.warnings:
                warnings.warn(warning, stacklevel=2)
        loaded = config
        loaded = _with_resolved_model(loaded, pull_progress)
        self.engine = LLMEngine(loaded, registry, environ)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def reports_results(self) -> bool:
        """False in the processes of a launched world (torchrun, mpiexec) other than rank 0."""
        return self.engine.reports_results

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        stream: StreamCallback | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, or token ids) with continuous batching; outputs in
        prompt order. ``sampling_params``: one for all, or one per prompt (default: the
        config's ``sampling`` section)."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params or self.default_sampling_params(), len(batch))
        requests = [(self._token_ids(p), sp, None) for p, sp in zip(batch, params, strict=True)]
        return self._run(requests, stream)

    def default_sampling_params(self) -> SamplingParams:
        """The config's ``sampling`` section as SamplingParams."""
        return SamplingParams(**self.engine.config.sampling.model_dump())

    def chat(
        self,
        messages: Messages | Sequence[Messages],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        stream: StreamCallback | None = None,
    ) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role", "content"}``) or several, through the
        model's chat template."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else messages
        tokenizer = self._require_tokenizer()
        prompts = [tokenizer.apply_chat_template(list(c)) for c in conversations]
        return self.generate(prompts, sampling_params, stream)

    def embed(self, texts: Prompt | Sequence[Prompt]) -> list[Any]:
        """One vector (float32 tensor ``[hidden]``) per text: the final hidden states pooled
        as ``model.pooling`` says, L2-normalized unless ``model.normalize_embeddings`` is
        false."""
        batch = _as_batch(texts)
        pooling = self.engine.config.model.pooling
        requests = [(self._token_ids(t), SamplingParams(), pooling) for t in batch]
        return [output.embedding for output in self._run(requests, None)]

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def _run(
        self,
        requests: list[tuple[list[int], SamplingParams, str | None]],
        stream: StreamCallback | None,
    ) -> list[RequestOutput]:
        engine = self.engine
        try:
            outputs = [engine.add_request(ids, sp, pooling) for ids, sp, pooling in requests]
            while engine.has_unfinished_requests():
                for output, delta in engine.step():
                    if stream is not None:
                        stream(output, delta)
        except BaseException:
            engine.abort_all()
            raise
        return outputs

    def _token_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self._require_tokenizer().encode(prompt)
        return [int(t) for t in prompt]

    def _require_tokenizer(self):
        if self.engine.tokenizer is None:
            raise RequestError(
                f"{self.engine.config.model.path}: the model has no tokenizer "
                "(tokenizer.json); give prompts as token ids"
            )
        return self.engine.tokenizer


def _as_batch(prompts: Any) -> list[Prompt]:
    """One prompt (text or token ids) or a sequence of them, as a list."""
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]
    if not items:
        raise RequestError("no prompts given")
    return items


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams], count: int
) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise RequestError(f"{len(params)} sampling params for {count} prompts; give 1 or {count}")
    return params


def _with_resolved_model(
    loaded: LoadedConfig, progress: Callable[[int, int], None] | None
) -> LoadedConfig:
    """``loaded`` with ``model.path`` turned into a file or directory (a cataloged name is
    pulled into the cache when missing)."""
    from shardline.catalog import resolve_model_path

    path = loaded.config.model.path
    if path is None:
        return loaded
    resolved = str(resolve_model_path(path, progress=progress))
    if resolved == path:
        return loaded
    model = loaded.config.model.model_copy(update={"path": resolved})
    return dataclasses.replace(loaded, config=loaded.config.model_copy(update={"model": model}))
