"""The collective watchdog: wraps any communicator, remembers a fingerprint of every operation
each rank enters, and when one passes its deadline (or finds a peer gone), the ranks compare
fingerprints over a side channel (the rendezvous store) so the error says who is where:

    all_reduce timed out on ranks [0, 1]: rank 1 is at #1204 all_gather [8, 576] float32;
    rank 0 at #1204 all_reduce [8, 576] float32

With ``check_every = N`` (a debug mode) the ranks also compare fingerprints every N
operations and raise :class:`CollectiveMismatchError` at the first that differs, before the
mismatch can hang or corrupt anything. Fingerprints travel as JSON, never pickled.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from shardline.comm.delegating import DelegatingCommunicator
from shardline.comm.host_directory import HostDirectory
from shardline.comm.store import connect_store
from shardline.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    PeerLostError,
    ShardlineError,
)
from shardline.interfaces import Communicator, NativeAllReduce, ReduceOp, Work
from shardline.interfaces.communicator_backend import Rendezvous

#: How long a rank that timed out waits for the others' fingerprints (inside the "deadline
#: + 1 s" every fault must end by; a rank whose own deadline comes later is "did not report").
REPORT_GRACE_S = 0.5
#: How long a rank that failed may take to reach the store for that diagnosis when it has not
#: reached it before (the store's host may be the one lost: the error is not held up long).
DIAGNOSIS_CONNECT_S = 2.0


@dataclass(frozen=True)
class Fingerprint:
    """What a rank was doing: the ``seq``-th operation of its group, and its arguments."""

    seq: int
    op: str
    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    peer: int | None = None

    def describe(self) -> str:
        text = f"#{self.seq} {self.op}"
        if self.peer is not None:
            text += f" with rank {self.peer}"
        if self.shape is not None:
            text += f" {list(self.shape)} {self.dtype}"
        return text

    def same_call(self, other: Fingerprint) -> bool:
        """Whether two ranks' fingerprints are the same collective (p2p ops differ by peer)."""
        return (self.op, self.shape, self.dtype) == (other.op, other.shape, other.dtype)


class SideChannel:
    """Fingerprint exchange over the rendezvous store (connected on first use), scoped to one
    group. Only JSON goes through it."""

    def __init__(self, rendezvous: Rendezvous, connect_timeout_s: float = 10.0) -> None:
        self.rendezvous = rendezvous
        self.connect_timeout_s = connect_timeout_s
        self._store: Any = None

    def for_group(self, label: str) -> SideChannel:
        return SideChannel(self.rendezvous.with_prefix(label), self.connect_timeout_s)

    def connect(self, within_s: float | None = None) -> Any:
        """The store's client, connected on first use within ``within_s`` (default: the
        channel's ``connect_timeout_s``); raises CommTimeoutError past it."""
        if self._store is None:
            timeout_s = self.connect_timeout_s if within_s is None else within_s
            self._store = connect_store(self.rendezvous, timeout_s)
        return self._store

    def publish(self, key: str, fingerprint: Fingerprint) -> None:
        self.connect().set(key, json.dumps(asdict(fingerprint)))

    def collect(self, keys: list[str], wait_s: float) -> dict[str, Fingerprint | None]:
        """Each key's fingerprint, or None for a key nobody set within ``wait_s``."""
        store = self.connect()
        found: dict[str, Fingerprint | None] = dict.fromkeys(keys)
        deadline = time.monotonic() + wait_s
        while True:
            for key in keys:
                if found[key] is None and store.check([key]):
                    data = json.loads(store.get(key))
                    shape = tuple(data["shape"]) if data["shape"] is not None else None
                    found[key] = Fingerprint(**{**data, "shape": shape})
            if all(found.values()) or time.monotonic() >= deadline:
                return found
            time.sleep(0.01)


class WatchedCommunicator(DelegatingCommunicator):
    """Any communicator, with a fingerprint of every operation and a diagnosis of timeouts.

    ``label`` names the group in messages (the world: "world"; subgroups: their ranks).
    Everything else is the wrapped communicator's behaviour, unchanged.
    """

    def __init__(
        self,
        inner: Communicator,
        side_channel: SideChannel,
        check_every: int = 0,
        label: str = "world",
        global_ranks: list[int] | None = None,
        hosts: HostDirectory | None = None,
    ) -> None:
        super().__init__(inner)
        self.label = label
        self.hosts = hosts or HostDirectory()
        self.check_every = check_every
        self.global_ranks = global_ranks or list(range(inner.world_size))
        self._channel = side_channel.for_group(label.replace(" ", ""))
        self._seq = 0
        self.last: Fingerprint | None = None

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        return self._watch("all_reduce", tensor, None, super().all_reduce, tensor, op)

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        return self._watch("all_gather", tensor, None, super().all_gather, tensor, dim)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        return self._watch("reduce_scatter", tensor, None, super().reduce_scatter, tensor, dim, op)

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = 0) -> torch.Tensor | None:
        return self._watch("gather", tensor, None, super().gather, tensor, dst, dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        return self._watch("broadcast", tensor, None, super().broadcast, tensor, src)

    def barrier(self) -> None:
        return self._watch("barrier", None, None, super().barrier)

    def native_all_reduce(self, like: torch.Tensor, calls: int) -> NativeAllReduce | None:
        """The inner communicator's, fingerprinted as one operation (``calls`` all-reduces
        from C); its failures get the watchdog's diagnosis. None in debug mode
        (``check_every``), which compares every operation."""
        native = None if self.check_every else self.inner.native_all_reduce(like, calls)
        if native is None:
            return None
        self._seq += 1
        fingerprint = Fingerprint(
            self._seq, f"all_reduce x{calls} (native)", tuple(like.shape),
            str(like.dtype).removeprefix("torch."), None,
        )  # fmt: skip
        self.last = fingerprint

        def failed(message: str, timed_out: bool) -> ShardlineError:
            error = native.failed(message, timed_out)
            if isinstance(error, CommTimeoutError | PeerLostError):
                return self.diagnose(error, fingerprint)
            return error

        return NativeAllReduce(native.capsule, calls, failed)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        return self._watch("send", tensor, dst, super().send, tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self._watch("recv", tensor, src, super().recv, tensor, src)

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        work = self._watch("isend", tensor, dst, super().isend, tensor, dst)
        return _WatchedWork(work, self, self.last)

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        work = self._watch("irecv", tensor, src, super().irecv, tensor, src)
        return _WatchedWork(work, self, self.last)

    def wrap_group(self, group: Communicator, ranks: list[int]) -> WatchedCommunicator:
        members = [self.global_ranks[r] for r in ranks]
        return WatchedCommunicator(
            group, self._channel, self.check_every, f"ranks {members}", members, self.hosts
        )

    def _watch(self, op, tensor, peer, call, *args):
        self._seq += 1
        fingerprint = Fingerprint(
            self._seq,
            op,
            tuple(tensor.shape) if tensor is not None else None,
            str(tensor.dtype).removeprefix("torch.") if tensor is not None else None,
            self.global_ranks[peer] if peer is not None else None,
        )
        self.last = fingerprint
        if self.check_every and peer is None and self._seq % self.check_every == 0:
            self._compare(fingerprint)
        try:
            return call(*args)
        except (CommTimeoutError, PeerLostError) as error:
            raise self.diagnose(error, fingerprint) from error

    def diagnose(
        self, error: CommTimeoutError | PeerLostError, mine: Fingerprint
    ) -> CommTimeoutError | PeerLostError:
        """``error`` (same type) with where every rank of the group is, as each rank reports
        itself (the first failure of a group; later ones may see the earlier reports). A dead
        rank is among those that did not report."""
        try:
            self._channel.connect(DIAGNOSIS_CONNECT_S)
            where = self._exchange("stuck", mine, REPORT_GRACE_S)
        except Exception as failure:  # the side channel is a diagnosis aid, never the error
            return type(error)(
                f"{error} [watchdog on {self.label}: this rank is at {mine.describe()}; the "
                f"side channel failed: {failure}]",
                op=error.op,
                rank=error.rank,
            )
        return type(error)(
            f"{error} [watchdog on {self.label}: {_who_is_where(where, self.hosts)}]",
            op=error.op,
            rank=error.rank,
        )

    def _compare(self, mine: Fingerprint) -> None:
        """Debug mode: every rank's N-th operation must be the same call."""
        where = self._exchange(f"check/{mine.seq}", mine, self.timeout_s)
        if any(fp is None or not fp.same_call(mine) for fp in where.values()):
            raise CollectiveMismatchError(
                f"collective mismatch on {self.label}: {_who_is_where(where, self.hosts)}",
                op=mine.op,
            )

    def _exchange(self, topic: str, mine: Fingerprint, wait_s: float) -> dict:
        """Publish ``mine`` under ``topic`` and read every rank's: global rank -> its
        fingerprint, or None for a rank that did not publish within ``wait_s``."""
        self._channel.publish(f"{topic}/{self.rank}", mine)
        found = self._channel.collect([f"{topic}/{r}" for r in range(self.world_size)], wait_s)
        return {self.global_ranks[r]: found[f"{topic}/{r}"] for r in range(self.world_size)}


class _WatchedWork(Work):
    """A pending p2p operation whose timeout is diagnosed like a blocking one's."""

    def __init__(self, inner: Work, comm: WatchedCommunicator, fingerprint: Fingerprint) -> None:
        self.inner = inner
        self.comm = comm
        self.fingerprint = fingerprint

    def wait(self, timeout: float | None = None) -> Any:
        try:
            return self.inner.wait(timeout)
        except (CommTimeoutError, PeerLostError) as error:
            raise self.comm.diagnose(error, self.fingerprint) from error

    def is_completed(self) -> bool:
        return self.inner.is_completed()


def _who_is_where(where: dict[int, Fingerprint | None], hosts: HostDirectory) -> str:
    """ "rank 3 is at #12 all_gather [8, 576] float32; ranks 0-2 at #12 all_reduce ...": the
    smallest group first, ranks that did not report last (with their hosts when the world
    spans several: "rank 3 on host h2 did not report")."""
    groups: dict[str | None, list[int]] = {}
    for rank, fingerprint in sorted(where.items()):
        groups.setdefault(fingerprint.describe() if fingerprint else None, []).append(rank)
    ordered = sorted(groups.items(), key=lambda item: (item[0] is None, len(item[1])))
    parts = []
    for index, (text, ranks) in enumerate(ordered):
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {_span(ranks)}"
        who += hosts.where(ranks)
        if text is None:
            parts.append(
                f"{who} did not report (not in an operation of this group: computing, "
                "hung elsewhere, or dead)"
            )
        elif index == 0:
            parts.append(f"{who} {'is' if len(ranks) == 1 else 'are'} at {text}")
        else:
            parts.append(f"{who} at {text}")
    return "; ".join(parts)


def _span(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[-1] + 1)) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))
