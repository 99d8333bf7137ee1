"""A target whose module takes a second to import, as torch's does: a fork server that
preloads it is still importing for that long (tests/test_fork_server.py)."""

import os
import time
from pathlib import Path

time.sleep(1.0)
#: Where the importing process writes its pid, when set (who imported it, and how often).
IMPORTED_BY = "SLOW_FORK_TARGETS_IMPORTED_BY"
if IMPORTED_BY in os.environ:
    with open(os.environ[IMPORTED_BY], "a") as record:
        record.write(f"{os.getpid()}\n")


def mark(marker: str) -> None:
    """Write this child's parent's pid (its fork server's) to ``marker``."""
    Path(marker).write_text(str(os.getppid()))
