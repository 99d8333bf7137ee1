"""Reading checkpoints so that each rank reads only the parts it keeps."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardline.errors import ConfigError, echo


def open_checkpoint(
    path: str | None, environ: Mapping[str, str] | None = None, keep_blocks: bool = False
):
    """An HF directory or a ``.gguf`` file, opened lazily; ``environ`` (where the reader of
    weights looks for ``SHARDLINE_NATIVE``) lets a GGUF file's blocks be decoded in C, and
    ``keep_blocks`` has the parts read carry them too (a GGUF file only)."""
    if path is None:
        raise ConfigError("model.path is not set: give an HF model directory or a .gguf file")
    location = Path(path)
    if location.is_dir() and (location / "config.json").is_file():
        from shardline.weights.hf import HFCheckpoint

        return HFCheckpoint(location)
    if location.suffix == ".gguf" and location.is_file():
        from shardline.weights.gguf_checkpoint import GGUFCheckpoint

        return GGUFCheckpoint(location, environ, keep_blocks)
    if location.is_dir():
        what = "a directory without config.json"
    elif location.exists():
        what = "not a .gguf file"
    else:
        what = "no such file or directory"
    raise ConfigError(
        f"model.path = {echo(path)}: {what}; allowed: an HF model directory (with config.json) "
        "or an existing .gguf file"
    )


def load_tokenizer(checkpoint: Any):
    """The checkpoint's tokenizer: from GGUF metadata, or an HF directory's tokenizer.json
    (None when the directory has none: prompts must then be token ids)."""
    from shardline.tokenizer import Tokenizer
    from shardline.weights.gguf_checkpoint import GGUFCheckpoint

    if isinstance(checkpoint, GGUFCheckpoint):
        return Tokenizer.from_gguf(checkpoint)
    return Tokenizer.from_hf_directory(checkpoint.directory)
