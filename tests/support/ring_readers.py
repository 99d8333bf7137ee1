"""Reader processes for the shared-memory ring tests (module level: spawned by name)."""

import hashlib
import time

from shardline.sdk import Polling
from shardline_executors.shm_ring import ShmRing


def echo_digests(reader: int, calls, replies, native: bool, doorbell, spin_checks: int) -> None:
    """Read messages until ``b"stop"``; reader 0 answers each with its SHA-256 (the other
    readers only read). Every get has a deadline; ``doorbell`` lets long waits block; each
    wait spins ``spin_checks`` checks before it yields."""
    environ = {"SHARDLINE_NATIVE": "1" if native else "0"}
    polling = Polling(spin_checks=spin_checks)
    inbox = ShmRing.attach(calls, environ, polling=polling)
    outbox = ShmRing.attach(replies, environ)
    try:
        assert inbox.native == native
        while (message := inbox.get(reader, time.monotonic() + 30, doorbell=doorbell)) != b"stop":
            if reader == 0:
                outbox.put(hashlib.sha256(message).digest(), time.monotonic() + 30)
    finally:
        inbox.close()
        outbox.close()
