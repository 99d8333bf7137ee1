"""A shared-memory ring of message slots: one writer, a fixed set of readers, no locks.

Layout of the segment: a header of int64 words, then ``slots`` data areas of ``slot_bytes``.
Header: for each slot its sequence word (message number + 1 once written), its payload length
and a "more chunks follow" flag; then one read position per reader, then one "sleeping" flag
per reader.

Message ``s`` goes to slot ``s % slots``. The writer may reuse a slot only when every reader's
position has passed the message in it; a reader takes message ``s`` once the slot's sequence
word says ``s + 1``, then advances its position. Each word has exactly one writer and is
stored with one aligned 8-byte store, so no lock is needed (x86-64 and arm64 keep such stores
whole; the writer publishes the sequence word only after the payload).

A message larger than a slot is split over consecutive slots (the overflow path); readers
reassemble it.

Blocking: a reader that has waited a while raises its "sleeping" word and waits on its
doorbell (a pipe); the writer rings the doorbell of every sleeping reader after publishing.
A wake-up lost to a race costs at most the reader's block timeout (200 ms). Segments are
created mode 0600 (private to the user) by the owner, which alone
unlinks them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from shardline_executors.waiting import wait_until

_WORDS_PER_SLOT = 3  # sequence, length, more-follows


def _header_words(slots: int, readers: int) -> int:
    # Per slot: sequence, length, more-follows; per reader: read position, sleeping flag.
    return slots * _WORDS_PER_SLOT + 2 * readers


@dataclass(frozen=True)
class RingHandle:
    """What a process needs to attach to a ring (picklable)."""

    name: str
    readers: int
    slots: int
    slot_bytes: int


class ShmRing:
    """One side of a ring. Build the owner with :meth:`create` (the writer's side usually),
    then :meth:`attach` from other processes with their reader index (or ``None`` to write)."""

    def __init__(self, shm: shared_memory.SharedMemory, handle: RingHandle, owner: bool) -> None:
        self._shm = shm
        self.handle = handle
        self._owner = owner
        header_words = _header_words(handle.slots, handle.readers)
        self._header = np.ndarray((header_words,), dtype=np.int64, buffer=shm.buf)
        slot_area = handle.slots * _WORDS_PER_SLOT
        self._slot_words = self._header[:slot_area].reshape(handle.slots, _WORDS_PER_SLOT)
        self._positions = self._header[slot_area : slot_area + handle.readers]
        self._sleeping = self._header[slot_area + handle.readers :]
        self._data_offset = header_words * 8
        self._next_write = 0
        self._doorbells: list[Any] | None = None

    @classmethod
    def create(cls, readers: int, slots: int = 16, slot_bytes: int = 1 << 20) -> ShmRing:
        header = _header_words(slots, readers) * 8
        shm = shared_memory.SharedMemory(create=True, size=header + slots * slot_bytes)
        shm.buf[:header] = bytes(header)
        return cls(shm, RingHandle(shm.name, readers, slots, slot_bytes), owner=True)

    @classmethod
    def attach(cls, handle: RingHandle) -> ShmRing:
        # Ranks are the owner's descendants and share its resource tracker, which keeps one
        # entry per name: attaching adds nothing, and only the owner unlinks.
        shm = shared_memory.SharedMemory(name=handle.name)
        return cls(shm, handle, owner=False)

    def set_doorbells(self, doorbells: list[Any]) -> None:
        """Writer side: one sending ``Connection`` per reader, rung when it sleeps."""
        self._doorbells = doorbells

    # ---- writing ---------------------------------------------------------------------------

    def put(
        self,
        payload: bytes,
        deadline: float | None = None,
        on_idle: Callable[[], None] | None = None,
    ) -> None:
        """Write one message (split over slots when larger than one); waits while readers
        still need the slots it reuses."""
        size = self.handle.slot_bytes
        chunks = [payload[i : i + size] for i in range(0, len(payload), size)] or [b""]
        for index, chunk in enumerate(chunks):
            seq = self._next_write
            slot = seq % self.handle.slots
            oldest_allowed = seq - self.handle.slots + 1
            wait_until(
                lambda oldest=oldest_allowed: int(self._positions.min()) >= oldest,
                deadline,
                "readers to free a ring slot",
                on_idle,
            )
            start = self._data_offset + slot * size
            self._shm.buf[start : start + len(chunk)] = chunk
            words = self._slot_words[slot]
            words[1] = len(chunk)
            words[2] = 1 if index < len(chunks) - 1 else 0
            words[0] = seq + 1  # publish last
            self._next_write = seq + 1
            if self._doorbells is not None:
                for reader in np.flatnonzero(self._sleeping):
                    self._doorbells[reader].send_bytes(b"")

    # ---- reading -----------------------------------------------------------------------------

    def ready(self, reader: int) -> bool:
        """True when a message for ``reader`` is waiting (never blocks)."""
        seq = int(self._positions[reader])
        return int(self._slot_words[seq % self.handle.slots][0]) == seq + 1

    def get(
        self,
        reader: int,
        deadline: float | None = None,
        on_idle: Callable[[], None] | None = None,
        doorbell: Any = None,
    ) -> bytes:
        """The next message for ``reader``, waiting until one is written. With ``doorbell``
        (the receiving end of this reader's pipe) a long wait blocks instead of polling."""
        block = None
        if doorbell is not None:

            def block(seconds: float) -> None:
                self._sleeping[reader] = 1
                if not self.ready(reader) and doorbell.poll(seconds):
                    while doorbell.poll(0):
                        doorbell.recv_bytes()
                self._sleeping[reader] = 0

        parts = []
        while True:
            seq = int(self._positions[reader])
            slot = seq % self.handle.slots
            words = self._slot_words[slot]
            wait_until(
                lambda words=words, seq=seq: int(words[0]) == seq + 1,
                deadline,
                "a message on the ring",
                on_idle,
                block,
            )
            start = self._data_offset + slot * self.handle.slot_bytes
            parts.append(bytes(self._shm.buf[start : start + int(words[1])]))
            more = int(words[2])
            self._positions[reader] = seq + 1
            if not more:
                return b"".join(parts)

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Detach; the owner also unlinks the segment. Idempotent."""
        if self._shm is None:
            return
        del self._header, self._slot_words, self._positions, self._sleeping
        self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
        self._shm = None
