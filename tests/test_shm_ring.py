"""The mp executor's shared-memory ring between real processes, with its word operations in C
and in Python (and a C writer with Python readers: one layout), readers that spin before they
yield and readers that yield at once: messages in order, split over slots when larger than
one, the writer held back by a slow reader, sleeping readers woken by their doorbells, and no
segment left."""

import hashlib
import multiprocessing
import os
import time

import pytest

from shardline_executors.shm_ring import ShmRing
from support import ring_readers

READERS = 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("writer_native", "readers_native", "spin_checks"),
    [
        (True, True, 200),
        (False, False, 200),
        (True, False, 200),
        (True, True, 0),
        (False, False, 0),
    ],
    ids=["c", "python", "c-writer-python-readers", "c-yield-at-once", "python-yield-at-once"],
)
def test_messages_arrive_whole_and_in_order(writer_native, readers_native, spin_checks):
    if writer_native or readers_native:
        pytest.importorskip("shardline_executors._ring_native", reason="extension not built")
    name = f"shardline-test-ring-{os.getpid()}"
    environ = {"SHARDLINE_NATIVE": "1" if writer_native else "0"}
    calls = ShmRing.create(f"{name}-calls", READERS, slots=4, slot_bytes=4096, environ=environ)
    replies = ShmRing.create(f"{name}-replies", 1, slots=4, slot_bytes=4096, environ=environ)
    context = multiprocessing.get_context("spawn")
    bells = [context.Pipe(duplex=False) for _ in range(READERS)]
    calls.set_doorbells([send for _, send in bells])
    readers = [
        context.Process(
            target=ring_readers.echo_digests,
            args=(r, calls.handle, replies.handle, readers_native, bells[r][0], spin_checks),
        )
        for r in range(READERS)
    ]
    try:
        assert calls.native == writer_native
        for process in readers:
            process.start()
        # Empty, small, exactly one slot, and split over 2 and 5 slots (more than the ring
        # holds: the writer waits for the readers).
        messages = [b"", b"x", bytes(range(256)) * 16, os.urandom(5000), os.urandom(17000)]
        messages += [os.urandom(n) for n in (1, 100, 4095, 8193)] * 10
        for index, message in enumerate(messages):
            if index == 3:
                time.sleep(0.1)  # the readers go to sleep on their doorbells
            calls.put(message, time.monotonic() + 30)
            digest = replies.get(0, time.monotonic() + 30)
            assert digest == hashlib.sha256(message).digest(), index
        calls.put(b"stop", time.monotonic() + 30)
        for process in readers:
            process.join(30)
            assert process.exitcode == 0
    finally:
        for process in readers:
            if process.is_alive():
                process.kill()
                process.join(5)
        calls.close()
        replies.close()
    # Only this test's own two segments are judged (the host's /dev/shm is shared).
    assert not [s for s in (f"{name}-calls", f"{name}-replies") if os.path.exists(f"/dev/shm/{s}")]
