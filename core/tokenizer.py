"""Text <-> token ids, and chat templates, from a GGUF file's metadata or an HF directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shardline.errors import ConfigError, RequestError

# GGUF token types (llama.cpp's llama_token_type): 3 control, 4 user-defined.
_SPECIAL_TOKEN_TYPES = (3, 4)


def _byte_of_character() -> dict[str, int]:
    """Byte-level BPE's alphabet, read backwards: a token is spelled with one character per
    byte, the byte itself where it is a printable Latin-1 character other than a space
    (``!``-``~``, ``¡``-``¬``, ``®``-``ÿ``), otherwise the next character from U+0100 on."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    character = {byte: chr(byte) for byte in printable}
    for byte in range(256):
        if byte not in character:
            character[byte] = chr(256 + len(character) - len(printable))
    return {char: byte for byte, char in character.items()}


_BYTE_OF_CHARACTER = _byte_of_character()


def unicode_problem(text: str) -> str | None:
    """What keeps ``text`` from being tokenized, or None: a lone surrogate, which is what
    bytes that are not UTF-8 become in Python's arguments and input, and what a JSON escape
    such as ``"\\ud800"`` makes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"is not Unicode text (a lone surrogate at character {error.start}); allowed: UTF-8"
    return None


class Tokenizer:
    """A byte-level BPE tokenizer (``tokenizers`` backend) with the model's special tokens and
    chat template."""

    def __init__(
        self,
        backend: Any,
        *,
        bos_token_id: int | None,
        eos_token_ids: set[int],
        chat_template: str | None,
        add_bos: bool,
    ) -> None:
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.chat_template = chat_template
        self.add_bos = add_bos
        from tokenizers import decoders

        self._byte_level = isinstance(backend.decoder, decoders.ByteLevel)
        self._added_ids = frozenset(backend.get_added_tokens_decoder())

    @classmethod
    def from_gguf(cls, checkpoint: Any) -> Tokenizer:
        """Build from ``tokenizer.ggml.*`` metadata of a :class:`GGUFCheckpoint`."""
        from tokenizers import AddedToken, decoders, pre_tokenizers
        from tokenizers import Tokenizer as Backend
        from tokenizers.models import BPE

        model = checkpoint.metadata("tokenizer.ggml.model")
        if model != "gpt2":
            raise ConfigError(
                f"{checkpoint.path}: tokenizer.ggml.model = {model!r}: "
                "only 'gpt2' (byte-level BPE) is supported"
            )
        tokens = checkpoint.metadata("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in checkpoint.metadata("tokenizer.ggml.merges")]
        types = checkpoint.metadata("tokenizer.ggml.token_type") or [1] * len(tokens)
        backend = Backend(
            BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
        )
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if checkpoint.metadata("tokenizer.ggml.pre") == "smollm":
            # llama.cpp's "smollm" pre-tokenizer splits every digit before the GPT-2 regex.
            byte_level = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level]
            )
        backend.pre_tokenizer = byte_level
        backend.decoder = decoders.ByteLevel()
        specials = [
            AddedToken(tokens[i], special=True, normalized=False)
            for i, kind in enumerate(types)
            if kind in _SPECIAL_TOKEN_TYPES
        ]
        backend.add_special_tokens(specials)
        eos = checkpoint.metadata("tokenizer.ggml.eos_token_id")
        eos_ids = {int(eos)} if eos is not None else set()
        eot = checkpoint.metadata("tokenizer.ggml.eot_token_id")
        if eot is not None:
            eos_ids.add(int(eot))
        bos = checkpoint.metadata("tokenizer.ggml.bos_token_id")
        return cls(
            backend,
            bos_token_id=int(bos) if bos is not None else None,
            eos_token_ids=eos_ids,
            chat_template=checkpoint.metadata("tokenizer.chat_template"),
            add_bos=bool(checkpoint.metadata("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_directory(cls, directory: str | Path) -> Tokenizer | None:
        """Build from ``tokenizer.json`` and ``tokenizer_config.json``; None when absent."""
        from tokenizers import Tokenizer as Backend

        directory = Path(directory)
        if not (directory / "tokenizer.json").exists():
            return None
        backend = Backend.from_file(str(directory / "tokenizer.json"))
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.exists() else {}

        def token_id(key: str) -> int | None:
            token = config.get(key)
            if isinstance(token, dict):
                token = token.get("content")
            return backend.token_to_id(token) if token else None

        eos = token_id("eos_token")
        return cls(
            backend,
            bos_token_id=token_id("bos_token"),
            eos_token_ids={eos} if eos is not None else set(),
            chat_template=config.get("chat_template"),
            add_bos=bool(config.get("add_bos_token", False)),
        )

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text are recognized.
        RequestError for text that is not Unicode (see :func:`unicode_problem`)."""
        problem = unicode_problem(text)
        if problem is not None:
            raise RequestError(f"the text to encode {problem}")
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for on its own, which may be part of a UTF-8 character
        (a special token: its text, e.g. ``<|im_end|>``; an id outside the vocabulary:
        nothing)."""
        token = self.backend.id_to_token(token_id)
        if token is None:
            return b""
        if token_id not in self._added_ids and self._byte_level:
            try:
                return bytes(_BYTE_OF_CHARACTER[char] for char in token)
            except KeyError:
                pass  # not spelled in the byte alphabet: decode it
        return self.backend.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for ``messages`` (``[{"role": ..., "content": ...}]``), rendered
        with the model's own template in a sandbox."""
        if not self.chat_template:
            raise ConfigError("this model has no chat template; give a plain prompt instead")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        template = environment.from_string(self.chat_template)
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt)
