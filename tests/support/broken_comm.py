"""A deliberately wrong communicator, selected by import path, to prove the conformance
suite fails (and skips by capability) when it should."""

from dataclasses import replace

from shardline_gloo.communicator import GlooBackend, GlooCommunicator


class OffByOneGloo(GlooCommunicator):
    def all_reduce(self, tensor, op="sum"):
        return super().all_reduce(tensor, op) + 1


class BrokenGlooBackend(GlooBackend):
    """gloo whose all_reduce adds one, declaring no bfloat16 and sum only."""

    capabilities = replace(
        GlooBackend.capabilities,
        dtypes=GlooBackend.capabilities.dtypes - {"bfloat16"},
        reduce_ops=frozenset({"sum"}),
    )

    def init_world(self, rank, world_size, rendezvous, timeout_s):
        world = super().init_world(rank, world_size, rendezvous, timeout_s)
        world.__class__ = OffByOneGloo
        return world
