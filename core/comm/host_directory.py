"""Which host each rank of a world runs on, so that errors can say "rank 3 on host h2".

Every rank announces its host name in the rendezvous store (under ``hosts/``) before it
joins any world; the directory is read once a world is joined (every rank has announced by
then) and, for a join that failed, when the error is reported. Host names are only
added to messages when the world spans more than one host.
"""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from shardline.comm.store import connect_store
from shardline.interfaces.communicator_backend import Rendezvous

_PREFIX = "hosts"


def announce_host(rendezvous: Rendezvous, rank: int, timeout_s: float) -> None:
    """Record this process's host name as ``rank``'s (which also says the rank started)."""
    store = connect_store(rendezvous.with_prefix(_PREFIX), timeout_s)
    store.set(str(rank), socket.gethostname())


def wait_for_announcements(rendezvous: Rendezvous, world_size: int, timeout_s: float) -> list[int]:
    """Wait until every rank of the world has announced its host, at most ``timeout_s``
    (a failed join then names the hosts, and the watchdog reads them once the worlds are
    joined); the ranks that have not (none: all did). :class:`CommTimeoutError` when the
    store cannot be reached within ``timeout_s``."""
    store = connect_store(rendezvous.with_prefix(_PREFIX), timeout_s)
    with contextlib.suppress(RuntimeError, dist.DistError):  # a timeout: see who is missing
        store.wait([str(rank) for rank in range(world_size)], timedelta(seconds=timeout_s))
    return [rank for rank in range(world_size) if not store.check([str(rank)])]


@dataclass(frozen=True)
class HostDirectory:
    """Rank -> host name, for the ranks that announced themselves."""

    host_of: dict[int, str] = field(default_factory=dict)

    @classmethod
    def read(cls, rendezvous: Rendezvous, world_size: int, timeout_s: float) -> HostDirectory:
        """What the store holds now (no wait for ranks that have not announced); an empty
        directory when the store cannot be reached within ``timeout_s``."""
        try:
            store = connect_store(rendezvous.with_prefix(_PREFIX), timeout_s)
            found = {}
            for rank in range(world_size):
                if store.check([str(rank)]):
                    found[rank] = store.get(str(rank)).decode(errors="replace")
        except Exception:  # naming hosts is an aid to a message, never a new failure
            return cls()
        return cls(found)

    @property
    def spans_hosts(self) -> bool:
        return len(set(self.host_of.values())) > 1

    def where(self, ranks: Iterable[int]) -> str:
        """`` on host h2`` (or ``on hosts h1, h2``) for ``ranks`` when the world spans
        hosts, else ``""``; a rank that never announced itself is ``on an unknown host``."""
        if not self.spans_hosts:
            return ""
        hosts = sorted({self.host_of.get(rank, "") for rank in ranks})
        if hosts == [""]:
            return " on an unknown host (its process never reached the rendezvous)"
        named = [host or "an unknown host" for host in hosts]
        return f" on host{'s' if len(named) > 1 else ''} {', '.join(named)}"

    def summary(self) -> str:
        """`` [hosts: ranks 0-1 on host h1; ranks 2-3 on host h2]`` when the world spans
        hosts, else ``""``."""
        if not self.spans_hosts:
            return ""
        by_host: dict[str, list[int]] = {}
        for rank, host in sorted(self.host_of.items()):
            by_host.setdefault(host, []).append(rank)
        parts = [f"{_ranks_text(ranks)} on host {host}" for host, ranks in by_host.items()]
        return f" [hosts: {'; '.join(parts)}]"


def _ranks_text(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"ranks {', '.join(map(str, ranks))}"
