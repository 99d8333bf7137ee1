"""Messages as keys in the rendezvous store: ``<group>/<channel>/<src>><dst>/<seq>``."""

from __future__ import annotations

import datetime

import torch.distributed as dist

from shardline.errors import CommTimeoutError
from shardline.interfaces import CommunicatorBackend, Rendezvous
from shardline.sdk import MessagePassingCommunicator, connect_store
from shardline_storecomm.plugin import CAPABILITIES


class StoreBackend(CommunicatorBackend):
    name = "storecomm"
    capabilities = CAPABILITIES

    def init_world(self, rank, world_size, rendezvous: Rendezvous, timeout_s):
        store = connect_store(rendezvous.with_prefix("storecomm"), timeout_s)
        return StoreCommunicator(store, list(range(world_size)), rank, timeout_s, "w")


class StoreCommunicator(MessagePassingCommunicator):
    """One group; ``members`` are world ranks, used to name keys so groups never collide."""

    def __init__(self, store, members, rank, timeout_s, name):
        super().__init__()
        self._store, self._members, self._rank = store, members, rank
        self._timeout_s, self._name, self._groups = timeout_s, name, 0

    rank = property(lambda self: self._rank)
    world_size = property(lambda self: len(self._members))
    capabilities = property(lambda self: CAPABILITIES)
    timeout_s = property(lambda self: self._timeout_s)

    def _post(self, channel, dst, seq, data):
        self._store.set(f"{self._name}/{channel}/{self._rank}>{dst}/{seq}", data)

    def _fetch(self, channel, src, seq, timeout_s):
        key = f"{self._name}/{channel}/{src}>{self._rank}/{seq}"
        try:
            self._store.wait([key], datetime.timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistError) as error:
            raise CommTimeoutError(
                f"storecomm: rank {self._rank} of group {self._name!r} got no {channel} message "
                f"#{seq} from rank {src} within {timeout_s:g} s",
                op=channel,
                rank=self._rank,
            ) from error
        data = self._store.get(key)
        self._store.delete_key(key)
        return data

    def new_group(self, ranks, timeout_s=None):
        self._groups += 1
        if self._rank not in ranks:
            return None
        return StoreCommunicator(
            self._store,
            [self._members[r] for r in ranks],
            ranks.index(self._rank),
            self._timeout_s if timeout_s is None else timeout_s,
            f"{self._name}.g{self._groups}",
        )

    def close(self):
        pass
