"""The control plane's objects on a real gloo world (three ranks as threads of this process):
one object sent to several ranks is serialized once and each receives it, in order with the
messages around it."""

from unittest import mock

import pytest

from shardline.comm import objects
from shardline.comm.store import serve_store
from shardline.distributed.control_plane import ControlPlane
from shardline_gloo.communicator import GlooBackend
from support.thread_ranks import run_thread_ranks

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32


def _run_ranks(body, world_size=3):
    """``body(control_plane)`` on every rank of a gloo world; each rank's result or error."""
    _store, rendezvous = serve_store()

    def open_rank(rank):
        return GlooBackend().init_world(rank, world_size, rendezvous, 10.0)

    return run_thread_ranks(world_size, open_rank, lambda comm: body(ControlPlane(comm, SECRET)))


def test_one_object_sent_to_each_rank_is_serialized_once_and_received_by_each():
    serialized = mock.Mock(wraps=objects.to_tensor)

    def body(plane):
        if plane.comm.rank == 0:
            with mock.patch.object(objects, "to_tensor", serialized):
                work = plane.isend_object_to_each({"step": 7}, [1, 2])
                plane.isend_object("after", 2).wait()
                work.wait()
            return None
        received = [plane.recv_object(0)]
        if plane.comm.rank == 2:
            received.append(plane.recv_object(0))
        return received

    results = _run_ranks(body)
    assert results == {0: None, 1: [{"step": 7}], 2: [{"step": 7}, "after"]}
    assert serialized.call_count == 2  # the shared object once, "after" once
