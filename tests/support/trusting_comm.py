"""A careless communicator, selected by import path: its own ``broadcast_object`` unpickles
whatever arrives. Objects are Shardline's control plane, built on tensor operations, so this
method is never called (what the fault suite's test shows)."""

import pickle

import torch

from shardline_gloo.communicator import GlooBackend, GlooCommunicator


class TrustingGloo(GlooCommunicator):
    def broadcast_object(self, obj, src=0):
        size = torch.zeros(1, dtype=torch.int64)
        payload = None
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
            size[0] = payload.numel()
        self.broadcast(size, src)
        if payload is None:
            payload = torch.empty(int(size[0]), dtype=torch.uint8)
        self.broadcast(payload, src)
        return obj if self.rank == src else pickle.loads(payload.numpy().tobytes())


class TrustingGlooBackend(GlooBackend):
    """gloo whose broadcast_object unpickles whatever arrives."""

    def init_world(self, rank, world_size, rendezvous, timeout_s):
        world = super().init_world(rank, world_size, rendezvous, timeout_s)
        world.__class__ = TrustingGloo
        return world
