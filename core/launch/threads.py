"""Sharing a host's cores between the ranks on it."""

from __future__ import annotations

import os

import torch


def share_cores(ranks_on_host: int) -> int:
    """Give this rank its share of the host's cores for torch's intra-op threads, unless the
    user chose (``OMP_NUM_THREADS`` set). N ranks each using every core oversubscribe the
    CPU, and idle OpenMP threads spinning for work starve the ranks' own waits. Returns the
    thread count in effect."""
    if "OMP_NUM_THREADS" not in os.environ:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        torch.set_num_threads(max(1, (cores or 1) // max(1, ranks_on_host)))
    return torch.get_num_threads()
