"""Rendezvous stores: a TCP key-value store on an OS-chosen port, and clients of it."""

from __future__ import annotations

import datetime
import secrets

import torch.distributed as dist

from shardline.errors import CommTimeoutError
from shardline.interfaces.communicator_backend import Rendezvous


def serve_store(
    host: str = "127.0.0.1", timeout_s: float = 60.0, port: int = 0
) -> tuple[dist.Store, Rendezvous]:
    """Start a store server on ``host`` at ``port``; 0 (the default) lets the OS choose, the
    only safe choice unless a launcher reserved the port.

    The caller keeps the returned store alive for as long as ranks may connect to it, and
    hands the returned rendezvous (with a new random job secret) to them privately.
    """
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return store, Rendezvous(host=host, port=store.port, secret=secrets.token_bytes(32))


def connect_store(rendezvous: Rendezvous, timeout_s: float) -> dist.Store:
    """A client of the store at ``rendezvous``, scoped to its prefix.

    Raises :class:`CommTimeoutError` when the store cannot be reached within ``timeout_s``.
    """
    try:
        store: dist.Store = dist.TCPStore(
            rendezvous.host,
            rendezvous.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except (RuntimeError, dist.DistError) as error:
        raise CommTimeoutError(
            f"cannot reach the rendezvous store at {rendezvous.host}:{rendezvous.port} "
            f"within {timeout_s:g} s: {error}",
            op="rendezvous",
        ) from error
    if rendezvous.prefix:
        store = dist.PrefixStore(rendezvous.prefix, store)
    return store


def announce_arrival(store: dist.Store, rank: int) -> None:
    """Mark ``rank`` as arrived at a join, so that a timeout can name who did not."""
    store.set(f"arrived/{rank}", "1")


def never_arrived(store: dist.Store, world_size: int) -> list[int]:
    """The ranks of ``world_size`` that have not called :func:`announce_arrival`."""
    return [rank for rank in range(world_size) if not store.check([f"arrived/{rank}"])]
