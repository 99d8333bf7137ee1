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

The word operations (write and publish a chunk, take the next one, read positions, sleeping
flags) run in C (``_ring_native.RingCore``: release stores, acquire loads, a bounded spin
before a reader falls back to :func:`wait_until`) when the extension is built and
``SHARDLINE_NATIVE`` is not ``0``; otherwise :class:`PythonRingCore` does the same in Python.
A reader waits as its :class:`~shardline.comm.waiting.Polling` says (given when it attaches):
its spin checks run in C where the word operations do, then it yields between checks.

Segments are created mode 0600 (private to the user) under a name the owner chooses (the job's
name in it), by the owner, which alone unlinks them: once every reader has attached
(:meth:`ShmRing.unlink`; the memory lives on while mapped), or at close; Python's resource
tracker removes them should the owner be killed before. Other processes map them directly,
without the resource tracker (which would remove a segment when any one of them exits).
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from multiprocessing import shared_memory
from types import ModuleType
from typing import Any

from shardline.sdk import Polling, native_extension, wait_until

_WORDS_PER_SLOT = 3  # sequence, length, more-follows
#: A reader's default wait: spin, then yield (for a reader with a core to itself).
_SPIN_FIRST = Polling()
#: The C word operations (built by pip install where a compiler is), else PythonRingCore.
NATIVE = "shardline_executors._ring_native"


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


class PythonRingCore:
    """The ring's word operations in Python, with the interface of ``_ring_native.RingCore``
    (see there). Plain memoryview words: an index is one aligned 8-byte load or store."""

    def __init__(self, memory: memoryview, slots: int, readers: int, slot_bytes: int) -> None:
        header_words = _header_words(slots, readers)
        self._memory = memory
        self._words = memory[: header_words * 8].cast("q")
        self._slots = slots
        self._slot_bytes = slot_bytes
        self._positions = slice(slots * _WORDS_PER_SLOT, slots * _WORDS_PER_SLOT + readers)
        self._position_base = slots * _WORDS_PER_SLOT
        self._sleeping_base = self._position_base + readers
        self._readers = readers
        self._data_offset = header_words * 8

    def put(self, seq: int, chunk: bytes, more: bool) -> int:
        if not self.has_room(seq):
            return -1
        words, slot = self._words, seq % self._slots
        start = self._data_offset + slot * self._slot_bytes
        self._memory[start : start + len(chunk)] = chunk
        base = slot * _WORDS_PER_SLOT
        words[base + 1] = len(chunk)
        words[base + 2] = 1 if more else 0
        words[base] = seq + 1  # publish last
        sleepers = 0
        for reader in range(self._readers):
            if words[self._sleeping_base + reader]:
                sleepers |= 1 << reader
        return sleepers

    def has_room(self, seq: int) -> bool:
        return min(self._words[self._positions]) >= seq - self._slots + 1

    def ready(self, reader: int) -> bool:
        seq = self._words[self._position_base + reader]
        return self._words[(seq % self._slots) * _WORDS_PER_SLOT] == seq + 1

    def take(self, reader: int, spin_checks: int) -> tuple[bytes, bool] | None:
        if not self.ready(reader):
            return None
        words, position = self._words, self._position_base + reader
        seq = words[position]
        slot = seq % self._slots
        base = slot * _WORDS_PER_SLOT
        start = self._data_offset + slot * self._slot_bytes
        payload = bytes(self._memory[start : start + words[base + 1]])
        more = bool(words[base + 2])
        words[position] = seq + 1
        return payload, more

    def set_sleeping(self, reader: int, asleep: bool) -> None:
        self._words[self._sleeping_base + reader] = 1 if asleep else 0

    def release(self) -> None:
        """Let go of the mapping's words (before it is closed)."""
        self._words.release()


class ShmRing:
    """One side of a ring. Build the owner with :meth:`create` (the writer's side usually),
    then :meth:`attach` from other processes with their reader index (or ``None`` to write).
    ``native`` is the C module of the word operations (None: :class:`PythonRingCore`);
    ``polling``, how this side waits for a message (:meth:`get`)."""

    def __init__(
        self,
        shm: Any,
        handle: RingHandle,
        owner: bool,
        native: ModuleType | None,
        polling: Polling = _SPIN_FIRST,
    ):
        self._shm = shm
        self.handle = handle
        self._owner = owner
        self._buf = shm.buf
        self._spin_checks = polling.spin_checks
        if native is not None and handle.readers <= native.MAX_READERS:
            self._core = native.RingCore(self._buf, handle.slots, handle.readers, handle.slot_bytes)
            # take() has spun in C: a wait goes on by yielding (a longer spin only delays the
            # writer where the driver and the workers outnumber the cores).
            self._reader_polling = Polling(spin_checks=0, share_cpu=polling.share_cpu)
        else:
            self._core = PythonRingCore(self._buf, handle.slots, handle.readers, handle.slot_bytes)
            self._reader_polling = polling
        self._next_write = 0
        self._doorbells: list[Any] | None = None

    @property
    def native(self) -> bool:
        """Whether the word operations run in C."""
        return not isinstance(self._core, PythonRingCore)

    @classmethod
    def create(
        cls,
        name: str,
        readers: int,
        slots: int = 16,
        slot_bytes: int = 1 << 20,
        environ: Mapping[str, str] = os.environ,
    ) -> ShmRing:
        """The owner's side of a new segment called ``name`` (FileExistsError if taken)."""
        header = _header_words(slots, readers) * 8
        shm = shared_memory.SharedMemory(name=name, create=True, size=header + slots * slot_bytes)
        shm.buf[:header] = bytes(header)
        handle = RingHandle(shm.name, readers, slots, slot_bytes)
        return cls(shm, handle, owner=True, native=native_extension(NATIVE, environ))

    @classmethod
    def attach(
        cls,
        handle: RingHandle,
        environ: Mapping[str, str] = os.environ,
        polling: Polling = _SPIN_FIRST,
    ) -> ShmRing:
        """Another process's side of the ring ``handle`` names; ``polling``: how it waits for
        a message (spinning first only where it has a core to itself:
        :meth:`Polling.for_ranks_on_host`)."""
        return cls(
            _Mapping(handle.name),
            handle,
            owner=False,
            native=native_extension(NATIVE, environ),
            polling=polling,
        )

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
        size, core = self.handle.slot_bytes, self._core
        if len(payload) <= size:
            chunks = (payload,)
        else:
            chunks = tuple(payload[i : i + size] for i in range(0, len(payload), size))
        last = len(chunks) - 1
        for index, chunk in enumerate(chunks):
            seq = self._next_write
            sleepers = core.put(seq, chunk, index < last)
            if sleepers < 0:
                wait_until(
                    lambda seq=seq: core.has_room(seq),
                    deadline,
                    "readers to free a ring slot",
                    on_idle,
                )
                sleepers = core.put(seq, chunk, index < last)
            self._next_write = seq + 1
            if sleepers and self._doorbells is not None:
                for reader in range(self.handle.readers):
                    if sleepers >> reader & 1:
                        self._doorbells[reader].send_bytes(b"")

    # ---- reading -----------------------------------------------------------------------------

    def ready(self, reader: int) -> bool:
        """True when a message for ``reader`` is waiting (never blocks)."""
        return self._core.ready(reader)

    def set_sleeping(self, reader: int, asleep: bool) -> None:
        """Say whether ``reader`` sleeps on its doorbell (the writer rings it after a put);
        for a reader that waits on several rings with one doorbell."""
        self._core.set_sleeping(reader, asleep)

    def get(
        self,
        reader: int,
        deadline: float | None = None,
        on_idle: Callable[[], None] | None = None,
        doorbell: Any = None,
    ) -> bytes:
        """The next message for ``reader``, waiting until one is written. With ``doorbell``
        (the receiving end of this reader's pipe) a long wait blocks instead of polling."""
        core = self._core
        block = None
        if doorbell is not None:

            def block(seconds: float) -> None:
                core.set_sleeping(reader, True)
                if not core.ready(reader) and doorbell.poll(seconds):
                    while doorbell.poll(0):
                        doorbell.recv_bytes()
                core.set_sleeping(reader, False)

        parts = []
        while True:
            taken = core.take(reader, self._spin_checks)
            if taken is None:
                wait_until(
                    lambda: core.ready(reader),
                    deadline,
                    "a message on the ring",
                    on_idle,
                    block,
                    polling=self._reader_polling,
                )
                taken = core.take(reader, 0)
            chunk, more = taken
            if not more:
                return chunk if not parts else b"".join([*parts, chunk])
            parts.append(chunk)

    # ---- lifetime ------------------------------------------------------------------------------

    def unlink(self) -> None:
        """Owner side: remove the segment's name now (once every reader has attached); the
        memory stays mapped until the last process closes it or ends, so nothing is left in
        /dev/shm even when every process is killed at once. Idempotent."""
        if self._owner:
            with contextlib.suppress(FileNotFoundError):  # unlinked already
                self._shm.unlink()

    def close(self) -> None:
        """Detach; the owner also unlinks the segment. Idempotent."""
        if self._shm is None:
            return
        self._core.release()  # a traceback may still hold the core: release the mapping now
        del self._core, self._buf
        self._shm.close()
        self.unlink()
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
