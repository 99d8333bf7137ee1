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
A wake-up lost to a race costs at most the reader's block timeout (200 ms).

Segments are created mode 0600 (private to the user) under a name the owner chooses (the job's
name in it), by the owner, which alone unlinks them; Python's resource tracker removes them
should the owner be killed. Other processes map them directly, without the resource tracker
(which would remove a segment when any one of them exits).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory
from typing import Any

from shardline.sdk import wait_until

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

    def __init__(self, shm: Any, handle: RingHandle, owner: bool) -> None:
        self._shm = shm
        self.handle = handle
        self._owner = owner
        self._buf = shm.buf
        header_words = _header_words(handle.slots, handle.readers)
        # Plain memoryview words: an index is one aligned 8-byte load or store, and much
        # cheaper from Python than a numpy scalar (this is the spin loop's whole cost).
        self._header = self._buf[: header_words * 8]
        self._words = self._header.cast("q")
        self._position_base = handle.slots * _WORDS_PER_SLOT
        self._sleeping_base = self._position_base + handle.readers
        self._data_offset = header_words * 8
        self._next_write = 0
        self._doorbells: list[Any] | None = None

    @classmethod
    def create(cls, name: str, readers: int, slots: int = 16, slot_bytes: int = 1 << 20) -> ShmRing:
        """The owner's side of a new segment called ``name`` (FileExistsError if taken)."""
        header = _header_words(slots, readers) * 8
        shm = shared_memory.SharedMemory(name=name, create=True, size=header + slots * slot_bytes)
        shm.buf[:header] = bytes(header)
        return cls(shm, RingHandle(shm.name, readers, slots, slot_bytes), owner=True)

    @classmethod
    def attach(cls, handle: RingHandle) -> ShmRing:
        return cls(_Mapping(handle.name), handle, owner=False)

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
        words = self._words
        positions = slice(self._position_base, self._position_base + self.handle.readers)
        for index, chunk in enumerate(chunks):
            seq = self._next_write
            slot = seq % self.handle.slots
            oldest_allowed = seq - self.handle.slots + 1
            if min(words[positions]) < oldest_allowed:
                wait_until(
                    lambda oldest=oldest_allowed: min(words[positions]) >= oldest,
                    deadline,
                    "readers to free a ring slot",
                    on_idle,
                )
            start = self._data_offset + slot * size
            self._buf[start : start + len(chunk)] = chunk
            base = slot * _WORDS_PER_SLOT
            words[base + 1] = len(chunk)
            words[base + 2] = 1 if index < len(chunks) - 1 else 0
            words[base] = seq + 1  # publish last
            self._next_write = seq + 1
            if self._doorbells is not None:
                for reader in range(self.handle.readers):
                    if words[self._sleeping_base + reader]:
                        self._doorbells[reader].send_bytes(b"")

    # ---- reading -----------------------------------------------------------------------------

    def ready(self, reader: int) -> bool:
        """True when a message for ``reader`` is waiting (never blocks)."""
        seq = self._words[self._position_base + reader]
        return self._words[(seq % self.handle.slots) * _WORDS_PER_SLOT] == seq + 1

    def get(
        self,
        reader: int,
        deadline: float | None = None,
        on_idle: Callable[[], None] | None = None,
        doorbell: Any = None,
    ) -> bytes:
        """The next message for ``reader``, waiting until one is written. With ``doorbell``
        (the receiving end of this reader's pipe) a long wait blocks instead of polling."""
        words = self._words
        position = self._position_base + reader
        block = None
        if doorbell is not None:
            sleeping = self._sleeping_base + reader

            def block(seconds: float) -> None:
                words[sleeping] = 1
                if not self.ready(reader) and doorbell.poll(seconds):
                    while doorbell.poll(0):
                        doorbell.recv_bytes()
                words[sleeping] = 0

        parts = []
        while True:
            seq = words[position]
            slot = seq % self.handle.slots
            sequence_word = slot * _WORDS_PER_SLOT
            if words[sequence_word] != seq + 1:
                wait_until(
                    lambda word=sequence_word, expected=seq + 1: words[word] == expected,
                    deadline,
                    "a message on the ring",
                    on_idle,
                    block,
                )
            start = self._data_offset + slot * self.handle.slot_bytes
            parts.append(bytes(self._buf[start : start + words[sequence_word + 1]]))
            more = words[sequence_word + 2]
            words[position] = seq + 1
            if not more:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Detach; the owner also unlinks the segment. Idempotent."""
        if self._shm is None:
            return
        self._words.release()
        self._header.release()
        del self._words, self._header, self._buf
        self._shm.close()
        if self._owner:
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()
        self._shm = None


class _Mapping:
    """A segment mapped by name, without the resource tracker: ``buf`` and ``close``."""

    def __init__(self, name: str) -> None:
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self.buf = memoryview(self._mmap)

    def close(self) -> None:
        self.buf.release()
        self._mmap.close()
