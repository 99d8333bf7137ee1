"""Reader processes for the shared-memory ring tests (module level: spawned by name)."""

import hashlib
import time

from shardline_executors.shm_ring import ShmRing


def echo_digests(reader: int, calls, replies, native: bool, doorbell) -> None:
    """Read messages until ``b"stop"``; reader 0 answers each with its SHA-256 (the other
    readers only read). Every get has a deadline; ``doorbell`` lets long waits block."""
    environ = {"SHARDLINE_NATIVE": "1" if native else "0"}
    inbox, outbox = ShmRing.attach(calls, environ), ShmRing.attach(replies, environ)
    try:
        assert inbox.native == native
        while (message := inbox.get(reader, time.monotonic() + 30, doorbell=doorbell)) != b"stop":
            if reader == 0:
                outbox.put(hashlib.sha256(message).digest(), time.monotonic() + 30)
    finally:
        inbox.close()
        outbox.close()
