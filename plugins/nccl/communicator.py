"""The NCCL communicator: raw ``ProcessGroupNCCL`` objects on ``cuda:{local_rank}``, one per
group, over the shared process-group machinery
(:class:`~shardline.comm.process_group.ProcessGroupCommunicator`).

CUDA tensors go to NCCL as they are; CPU tensors are staged through the rank's device (copied
there and the results copied back), so the conformance suite runs unchanged on a GPU host.
Blocking waits are enabled (``TORCH_NCCL_BLOCKING_WAIT``) so that a deadline raises
``CommTimeoutError`` in the waiting call instead of a watchdog aborting the process.

Run on one GPU by ``benchmarks/gpu_check.py`` (the suite at world size 1, and the model's data
plane); with several devices ``benchmarks/nccl_check.py`` runs the suite and a bandwidth
comparison with gloo.
"""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch
import torch.distributed as dist
from shardline_nccl.plugin import NCCL_CAPABILITIES

from shardline.errors import BackendUnavailableError
from shardline.interfaces import CommunicatorBackend, Rendezvous
from shardline.sdk import ProcessGroupCommunicator, connect_store, local_rank


class NcclBackend(CommunicatorBackend):
    """Creates NCCL worlds, one CUDA device per rank of a host."""

    name = "nccl"
    capabilities = NCCL_CAPABILITIES

    @classmethod
    def unavailable_reason(cls) -> str | None:
        if not dist.is_available() or not dist.is_nccl_available():
            return "this torch build has no NCCL (torch.distributed.is_nccl_available() is False)"
        if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
            return "no CUDA device (torch.cuda.is_available() is False)"
        return None

    def init_world(
        self, rank: int, world_size: int, rendezvous: Rendezvous, timeout_s: float
    ) -> NcclCommunicator:
        reason = self.unavailable_reason()
        if reason is not None:
            raise BackendUnavailableError(f"nccl: {reason}")
        index = local_rank(rank)
        if index >= torch.cuda.device_count():
            raise BackendUnavailableError(
                f"nccl: rank {rank} is local rank {index} but this host has "
                f"{torch.cuda.device_count()} CUDA devices (one per rank is needed)"
            )
        os.environ.setdefault("TORCH_NCCL_BLOCKING_WAIT", "1")
        device = torch.device("cuda", index)
        torch.cuda.set_device(device)
        join_timeout_s = rendezvous.join_timeout(timeout_s)
        store = connect_store(rendezvous.with_prefix("nccl"), join_timeout_s)
        return NcclCommunicator.create(
            store, device, rank, world_size, timeout_s, "w/", join_timeout_s
        )


class NcclCommunicator(ProcessGroupCommunicator):
    """One ``ProcessGroupNCCL``; ``transport`` is the rank's CUDA device."""

    backend_name = "nccl"
    backend_capabilities = NCCL_CAPABILITIES

    @classmethod
    def new_process_group(
        cls, store: dist.Store, transport: Any, rank: int, world_size: int, timeout_s: float
    ) -> Any:
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = datetime.timedelta(seconds=timeout_s)
        return dist.ProcessGroupNCCL(store, rank, world_size, options)

    def stage(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor if tensor.device == self._transport else tensor.to(self._transport)
