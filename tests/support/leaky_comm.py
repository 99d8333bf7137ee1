"""A careless communicator, selected by import path, to prove the fault suite catches a
backend that leaves a shared-memory segment behind (with a name that carries nothing of the
job, as a third party's might)."""

import os

from shardline_gloo.communicator import GlooBackend


class LeakyGlooBackend(GlooBackend):
    """gloo that creates a /dev/shm segment in every rank and never removes it."""

    def init_world(self, rank, world_size, rendezvous, timeout_s):
        fd = os.open(f"/dev/shm/leaky-{os.getpid()}", os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        os.close(fd)
        return super().init_world(rank, world_size, rendezvous, timeout_s)
