"""Rendezvous stores: a TCP key-value store on an OS-chosen port, and clients of it.

The server (torch's libuv ``TCPStore``) listens only on the address it is given: loopback for
the worlds of one host. It drops a connection that sends junk, a huge length or another
protocol; so that such bytes cannot print into the user's terminal, the process that serves
a store has the C++ (c10) log level raised to ERROR, unless ``TORCH_CPP_LOG_LEVEL`` says
otherwise.
"""

from __future__ import annotations

import ctypes
import datetime
import os
import secrets
import socket

import torch
import torch.distributed as dist

from shardline.errors import CommTimeoutError, first_line
from shardline.interfaces.communicator_backend import Rendezvous

#: c10's log levels: 0 INFO, 1 WARNING, 2 ERROR.
_ERROR = 2


def serve_store(
    host: str = "127.0.0.1",
    timeout_s: float = 60.0,
    port: int = 0,
    advertised_host: str | None = None,
) -> tuple[dist.Store, Rendezvous]:
    """Start a store server listening on ``host`` only (``0.0.0.0``: every interface) at
    ``port``; 0 (the default) lets the OS choose, the only safe choice unless a launcher
    reserved the port. Ranks reach it at ``advertised_host`` (default ``host``).

    The caller keeps the returned store alive for as long as ranks may connect to it, and
    hands the returned rendezvous (with a new random job secret) to them privately. Raises
    OSError when the address cannot be bound.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(512)
        port = listener.getsockname()[1]
    except BaseException:
        listener.close()
        raise
    _quiet_cpp_warnings()
    store = dist.TCPStore(
        host,
        port,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),
        use_libuv=True,
    )
    return store, Rendezvous(
        host=advertised_host or host, port=port, secret=secrets.token_bytes(32)
    )


def _quiet_cpp_warnings() -> None:
    """Raise c10's log level to ERROR (see the module docstring), unless the user chose one."""
    if "TORCH_CPP_LOG_LEVEL" in os.environ:
        return
    try:
        library = ctypes.CDLL(os.path.join(torch.__path__[0], "lib", "libc10.so"))
        level = ctypes.c_int32.in_dll(library, "FLAGS_caffe2_log_level")
    except (OSError, ValueError):  # another build of torch: its warnings stay
        return
    level.value = max(level.value, _ERROR)


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
            f"within {timeout_s:g} s: {first_line(error)}",
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
