"""Values the workers of one pytest run compute once between them (``pytest -n``: each worker
is a process of its own, and builds its own module fixtures)."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable
from typing import Any

import pytest


def computed_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[], Any]
) -> Any:
    """``compute()``'s value (JSON), computed by the first worker of this run to ask and read
    by the others from a file in the run's temporary folder; the workers wait for each other
    on a lock there. Without workers: ``compute()``, kept in the same way."""
    folder = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        folder = folder.parent  # the run's folder, above each worker's own
    path = folder / f"{name}.json"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.is_file():
            return json.loads(path.read_text())
        value = compute()
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(value))
        partial.replace(path)
        return value
