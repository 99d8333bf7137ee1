"""Sharing a host's cores between the ranks on it."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from shardline.comm.waiting import host_cores
from shardline.launch.core_binding import NONE, bind_process

if TYPE_CHECKING:
    from shardline.config.schema import ParallelConfig


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


def stage_threads(parallel: ParallelConfig, environ: Mapping[str, str]) -> int:
    """The threads a rank's own kernels (the C linear's team) may use: its torch threads,
    except where every rank of the job shares this host unbound (``parallel.nnodes`` 1,
    ``cpu_binding`` none) and torch's thread count is Shardline's (no ``OMP_NUM_THREADS`` in
    ``environ``): then the host's cores divided among the ranks that compute at the same time,
    one pipeline stage's in each world (a stage waits while another computes its step: at
    PP=2 on two cores, each stage's calls take both cores where torch has one thread a rank).
    """
    threads = torch.get_num_threads()
    if parallel.nnodes > 1 or parallel.core_binding.mode != NONE or "OMP_NUM_THREADS" in environ:
        return threads
    at_once = parallel.world_size * parallel.worlds_side_by_side // parallel.pipeline_parallel_size
    return max(threads, host_cores() // max(1, at_once))
