"""Sharing a host's cores between the ranks on it."""

from __future__ import annotations

import os

import torch

from shardline.comm.waiting import host_cores
from shardline.launch.core_binding import bind_process


def share_cores(ranks_on_host: int) -> int:
    """Give this rank its share of the host's cores for torch's intra-op threads, unless the
    user chose (``OMP_NUM_THREADS`` set). N ranks each using every core oversubscribe the
    CPU, and idle OpenMP threads spinning for work starve the ranks' own waits. Returns the
    thread count in effect."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, host_cores() // max(1, ranks_on_host)))
    return torch.get_num_threads()


def place_rank(cores: frozenset[int] | None, ranks_on_host: int) -> int:
    """Bind this rank's process to ``cores`` (its set of ``parallel.cpu_binding``; None:
    where the scheduler puts it), then give torch's intra-op threads one per core it is bound
    to, or its share of the host's when unbound (:func:`share_cores`; ``OMP_NUM_THREADS``
    set: that). Returns the thread count in effect."""
    if cores is None:
        return share_cores(ranks_on_host)
    bind_process(cores)
    return share_cores(1)
