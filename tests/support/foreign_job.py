"""Another job on the host (for the tests that must never touch it): shared-memory segments
named as other software names them, held until stdin closes; prints their names first."""

import json
import os
import secrets
import sys
from multiprocessing import shared_memory

segments = [
    shared_memory.SharedMemory(create=True, size=4096),  # psm_..., as Python names them
    shared_memory.SharedMemory(
        name=f"shardline-{secrets.token_hex(6)}-calls", create=True, size=64
    ),  # another Shardline job's
]
print(json.dumps([segment.name for segment in segments]), flush=True)
sys.stdin.read()
for segment in segments:
    segment.close()
    segment.unlink()
print("done", flush=True)
os._exit(0)
