"""A target whose module takes a second to import, as torch's does: a fork server that
preloads it is still importing for that long (tests/test_fork_server.py)."""

import time
from pathlib import Path

time.sleep(1.0)


def mark(marker: str) -> None:
    Path(marker).touch()
