"""A character-level tokenizer and a chat template for the tiny random Llama (100 tokens), so
that the model takes text and chat messages like a real one: ``tokenizer.json`` and
``tokenizer_config.json`` written beside its weights. No end-of-sequence token is declared,
so greedy generation runs to ``max_tokens``."""

from __future__ import annotations

import json
import string
from pathlib import Path

SPECIAL = ["<unk>", "<s>", "</s>"]
#: 97 characters: ids 3..99, one token each.
CHARACTERS = string.ascii_letters + string.digits + " .,:;!?'\"-()\n#$%&*+/<=>@[]^_{|}~\t`\\"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def add_tiny_tokenizer(directory: Path) -> Path:
    """Write the tokenizer files into ``directory`` (a tiny Llama with ``vocab_size=100``)."""
    from tokenizers import AddedToken, Tokenizer, decoders
    from tokenizers.models import BPE

    vocab = {token: i for i, token in enumerate([*SPECIAL, *CHARACTERS])}
    assert len(vocab) == 100
    backend = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    backend.save(str(directory / "tokenizer.json"))
    config = {"bos_token": "<s>", "unk_token": "<unk>", "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory
