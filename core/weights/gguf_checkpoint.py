"""GGUF files (llama architecture): metadata, tokenizer and lazily dequantized tensors.

Tensors are read through the file's memory map: a rank that keeps rows ``[a, b)`` of a
weight dequantizes only those rows, and a column range aligned to quantization blocks is cut
from the raw bytes before dequantizing. Q and K projections are un-permuted: GGUF conversion
reorders each head's rows for its interleaved RoPE; Shardline uses HF's "rotate half" order.

Quantized blocks are decoded by the optional extension ``shardline.weights._dequantize``
(``dequantize.c``: the gguf package's arithmetic, the same bits, a pass over the bytes) where it
was built and the checkpoint was opened with an environment that does not say
``SHARDLINE_NATIVE=0``; otherwise by the gguf package's numpy code.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from shardline.errors import ConfigError
from shardline.models.architecture import LlamaArchitecture
from shardline.native import native_extension
from shardline.weights.gguf_layout import GGUFLayout, TensorLayout

if TYPE_CHECKING:
    import torch

#: The block types decoded in C where the extension is built (see the module docstring): the
#: legacy 32-weight blocks, IQ4_NL, the 256-weight "K" super-blocks, and BF16.
NATIVE_TYPES = (
    "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "BF16",
)  # fmt: skip
SUPPORTED_TYPES = ("F32", "F16", *NATIVE_TYPES)
NATIVE = "shardline.weights._dequantize"

_LAYER_NAMES = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_name(hf_name: str) -> str:
    """The GGUF tensor name of an HF Llama tensor name."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)  # model, layers, i, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    raise KeyError(hf_name)


class GGUFCheckpoint:
    """A llama-architecture GGUF file, opened lazily. ``environ`` says whether tensors (and
    the header's string arrays) are decoded in C (see the module docstring); None: by the gguf
    package (and Python). ``keep_blocks``: each quantized tensor part read also carries the
    file's blocks it was decoded from (:class:`GGUFTensor`)."""

    def __init__(
        self, path: str | Path, environ: Mapping[str, str] | None = None, keep_blocks: bool = False
    ) -> None:
        self.path = Path(path)
        self._native = None if environ is None else native_extension(NATIVE, environ)
        self._keep_blocks = keep_blocks
        try:
            self._layout = GGUFLayout.read(self.path, self._native)
        except (OSError, ValueError, KeyError, IndexError) as error:
            raise ConfigError(
                f"{self.path}: not a readable GGUF file ({type(error).__name__}: {error})"
            ) from None
        self._tensors = self._layout.tensors
        self.architecture = self._architecture()

    def metadata(self, key: str, default: Any = None) -> Any:
        """A metadata value (strings decoded, arrays as lists)."""
        return self._layout.metadata.get(key, default)

    def _architecture(self) -> LlamaArchitecture:
        arch = self.metadata("general.architecture")
        if arch != "llama":
            raise ConfigError(
                f"{self.path}: general.architecture = {arch!r}: only 'llama' is supported"
            )

        def need(key: str) -> Any:
            value = self.metadata(f"llama.{key}")
            if value is None:
                raise ConfigError(f"{self.path}: metadata llama.{key} is missing")
            return value

        hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
        vocab = self.metadata("llama.vocab_size") or len(self.metadata("tokenizer.ggml.tokens", []))
        return LlamaArchitecture(
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(need("feed_forward_length")),
            num_layers=int(need("block_count")),
            num_heads=heads,
            num_kv_heads=int(self.metadata("llama.attention.head_count_kv") or heads),
            head_dim=int(self.metadata("llama.attention.key_length") or hidden // heads),
            rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
            rope_theta=float(self.metadata("llama.rope.freq_base") or 10000.0),
            max_positions=int(need("context_length")),
            tie_word_embeddings="output.weight" not in self._tensors,
        )

    def tensor_types(self) -> dict[str, str]:
        """Every tensor's GGUF type name (``Q4_1``, ``F32``, ...), by GGUF tensor name."""
        return {name: layout.tensor_type.name for name, layout in self._tensors.items()}

    def tensor(self, hf_name: str) -> GGUFTensor:
        """The tensor HF calls ``hf_name``, unread until indexed."""
        try:
            name = gguf_name(hf_name)
            raw = self._tensors[name]
        except KeyError:
            raise ConfigError(f"{self.path}: no tensor for {hf_name!r}") from None
        if raw.tensor_type.name not in SUPPORTED_TYPES:
            raise ConfigError(
                f"{self.path}: tensor {name} has type {raw.tensor_type.name}; "
                f"supported: {', '.join(SUPPORTED_TYPES)}"
            )
        arch = self.architecture
        heads = {"attn_q.weight": arch.num_heads, "attn_k.weight": arch.num_kv_heads}.get(
            name.split(".", 2)[-1]
        )
        return GGUFTensor(raw, arch.head_dim if heads else None, self._native, self._keep_blocks)


class GGUFTensor:
    """One GGUF tensor in torch's ``[out, in]`` order; slicing dequantizes only that part.
    With ``keep_blocks``, a part of a quantized tensor whose columns are whole blocks carries
    them as ``file_blocks``: (type name, its rows of the file's bytes, in the part's row
    order), for kernels that hold a weight as the file's blocks
    (:meth:`~shardline.layers.kernels.NativeKernels.pack_linear`)."""

    def __init__(
        self,
        raw: TensorLayout,
        permuted_head_dim: int | None,
        native: ModuleType | None = None,
        keep_blocks: bool = False,
    ) -> None:
        import gguf

        self._native = native
        self._keep_blocks = keep_blocks
        self._raw = raw
        self._type = raw.tensor_type
        self._block, self._block_bytes = gguf.GGML_QUANT_SIZES[raw.tensor_type]
        self._quantized = raw.data.dtype == np.uint8 and self._type.name not in ("F32", "F16")
        self.shape = tuple(int(n) for n in reversed(raw.shape))  # GGUF lists ne0 first
        self._head_dim = permuted_head_dim

    def __getitem__(self, index: Any) -> torch.Tensor:
        import torch  # on the first read, not on opening: a file's metadata needs no torch

        if not isinstance(index, tuple):
            index = (index,)
        rows = index[0] if index else slice(None)
        cols = index[1] if len(index) > 1 else slice(None)
        row_start, row_stop, _ = rows.indices(self.shape[0])
        if len(self.shape) == 1:
            return torch.from_numpy(np.array(self._raw.data[row_start:row_stop], dtype=np.float32))
        col_start, col_stop, _ = cols.indices(self.shape[1])
        # On the host whatever torch's default device: the caller copies the shard to its own.
        out = torch.empty(
            row_stop - row_start, col_stop - col_start, dtype=torch.float32, device="cpu"
        )
        # Dequantize a bounded number of rows at a time: the transient buffers of
        # dequantization stay small whatever the tensor's size.
        for first in range(row_start, row_stop, _ROWS_PER_CHUNK):
            last = min(first + _ROWS_PER_CHUNK, row_stop)
            self._rows(first, last, col_start, col_stop, out[first - row_start : last - row_start])
        blocks = None
        if self._keep_blocks and self._quantized and self._block > 1:  # not BF16's halves
            blocks = self._blocks_of(row_start, row_stop, col_start, col_stop)
        if self._head_dim is not None:
            out = _unpermute_rows(out, self._head_dim, row_start)
            if blocks is not None:
                blocks = blocks[_unpermuted_order(blocks.shape[0], self._head_dim)]
        if blocks is not None:
            out.file_blocks = (self._type.name, blocks)
        return out

    def _blocks_of(self, first: int, last: int, col_start: int, col_stop: int):
        """Rows ``[first, last)`` of the file's bytes for those columns (a view), or None
        where the columns cut a block."""
        if col_start % self._block or col_stop % self._block:
            return None
        lo = col_start // self._block * self._block_bytes
        hi = col_stop // self._block * self._block_bytes
        return self._raw.data[first:last, lo:hi]

    def _rows(self, first: int, last: int, col_start: int, col_stop: int, into: torch.Tensor):
        """Rows ``[first, last)``, columns ``[col_start, col_stop)``, as float32 ``into``
        (contiguous rows)."""
        data, target = self._raw.data[first:last], into.numpy()
        if not self._quantized:
            target[:] = data[:, col_start:col_stop]
        elif (blocks := self._blocks_of(first, last, col_start, col_stop)) is not None:
            # Whole quantization blocks: dequantize only those bytes.
            self._dequantize(np.ascontiguousarray(blocks), target)
        else:
            whole = np.empty((last - first, self.shape[1]), np.float32)
            self._dequantize(data, whole)
            target[:] = whole[:, col_start:col_stop]

    def _dequantize(self, blocks: np.ndarray, into: np.ndarray) -> None:
        """Rows of whole quantized blocks (bytes) decoded into the float32 rows ``into``."""
        if self._native is not None and self._type.name in NATIVE_TYPES:
            self._native.dequantize(self._type.name, blocks, into)
        else:
            import gguf

            into[:] = gguf.dequantize(blocks, self._type)


_ROWS_PER_CHUNK = 1024


def _unpermuted_order(count: int, head_dim: int) -> np.ndarray:
    """Which of ``count`` GGUF rows (whole heads) :func:`_unpermute_rows` puts at each row."""
    pairs = np.arange(count).reshape(count // head_dim, head_dim // 2, 2)
    return pairs.transpose(0, 2, 1).reshape(count)


def _unpermute_rows(rows: torch.Tensor, head_dim: int, first_row: int) -> torch.Tensor:
    """Undo llama.cpp's per-head row permutation for whole heads. GGUF stores each head's
    rows as pairs (0, d/2, 1, d/2+1, ...); HF keeps (0, 1, ..., d/2-1, d/2, ...)."""
    if first_row % head_dim or rows.shape[0] % head_dim:
        raise ValueError("Q/K rows must be read in whole heads to undo the GGUF permutation")
    heads = rows.shape[0] // head_dim
    return rows.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(rows.shape)
