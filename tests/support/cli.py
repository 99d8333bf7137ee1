"""Run the installed ``shardline`` console script as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SHARDLINE = str(Path(sys.executable).with_name("shardline"))
ROOT = Path(__file__).resolve().parents[2]


def shardline(
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    cwd: Path | None = None,
    stdin: str | None = None,
    wrap=None,
):
    """``shardline ARGS`` with a deadline (``stdin``: text typed in; ``wrap``: changes the
    command, e.g. ``own_shm.wrap``); returns the CompletedProcess (text output)."""
    full_env = {**os.environ, **(env or {})}
    command = [SHARDLINE, *args]
    return subprocess.run(
        wrap(command) if wrap else command,
        capture_output=True,
        text=True,
        input=stdin,
        timeout=timeout,
        env=full_env,
        cwd=cwd or ROOT,
    )
