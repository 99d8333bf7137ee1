"""A process Shardline starts freezes its heap as its last exit handler."""

import subprocess
import sys

SCRIPT = """
import atexit, gc
atexit.register(lambda: print("last handler sees frozen objects:", gc.get_freeze_count() > 0))
from shardline.launch.process_exit import skip_final_collection
skip_final_collection()
skip_final_collection()
atexit.register(lambda: print("first handler sees frozen objects:", gc.get_freeze_count() > 0))
"""


def test_the_heap_is_frozen_after_every_handler_registered_later():
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.splitlines() == [
        "first handler sees frozen objects: False",
        "last handler sees frozen objects: True",
    ], result.stdout + result.stderr
