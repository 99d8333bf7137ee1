"""HF checkpoint directories: ``config.json`` plus ``model.safetensors`` or a sharded index.

Tensors are opened lazily through safetensors' memory map: indexing a tensor reads only the
rows or columns asked for, so a rank's peak memory is its shard, not the whole model.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from shardline.errors import ConfigError, echo
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
    """The tensor names in a safetensors file, from its header (a little-endian u64 length,
    then that many bytes of JSON: name -> dtype, shape, offsets; ``__metadata__`` aside)."""
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if length > path.stat().st_size - 8:
                raise ValueError(f"a header of {length} bytes in a smaller file")
            header = json.loads(handle.read(length))
    except (OSError, ValueError, struct.error) as error:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{path}: not a readable safetensors file: {error}") from None
    return [name for name in header if name != "__metadata__"]
