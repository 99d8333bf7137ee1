"""HF checkpoint directories: ``config.json`` plus ``model.safetensors`` or a sharded index.

Tensors are opened lazily through safetensors' memory map: indexing a tensor reads only the
rows or columns asked for, so a rank's peak memory is its shard, not the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from shardline.errors import ConfigError, echo, first_line
from shardline.models.architecture import LlamaArchitecture

if TYPE_CHECKING:  # opening a checkpoint (its config and names) imports no torch
    import torch


class LazySafetensor:
    """A tensor in a safetensors file: ``shape`` and slicing, nothing read until indexed."""

    def __init__(self, handle: Any, name: str) -> None:
        self._slice = handle.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        return self._slice[index]


class HFCheckpoint:
    """An HF model directory, read lazily."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        try:
            config = json.loads(config_path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ConfigError(
                f"model.path = {echo(str(self.directory))}: cannot read its config.json: {error}"
            ) from None
        self.architecture = LlamaArchitecture.from_hf_config(config, str(config_path))
        self._files = self._tensor_files()
        self._handles: dict[Path, Any] = {}

    def _tensor_files(self) -> dict[str, Path]:
        index = self.directory / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            return {name: self.directory / file for name, file in weight_map.items()}
        single = self.directory / "model.safetensors"
        if not single.exists():
            raise ConfigError(
                f"{self.directory}: no model.safetensors or model.safetensors.index.json found"
            )
        return dict.fromkeys(_tensor_names(single), single)

    def tensor(self, name: str) -> LazySafetensor:
        """The checkpoint tensor ``name`` (HF naming), unread until sliced."""
        path = self._files.get(name)
        if path is None:
            raise ConfigError(f"{self.directory}: the checkpoint has no tensor {name!r}")
        if path not in self._handles:
            self._handles[path] = safe_open(path, framework="pt")
        return LazySafetensor(self._handles[path], name)


def _tensor_names(path: Path) -> list[str]:
    """The tensor names in a safetensors file, read through numpy (not torch: opening a
    checkpoint imports no torch); ConfigError naming the file where it cannot be read."""
    try:
        with safe_open(path, framework="numpy") as handle:
            return list(handle.keys())
    except (OSError, SafetensorError) as error:
        raise ConfigError(f"{path}: not a readable safetensors file: {first_line(error)}") from None
