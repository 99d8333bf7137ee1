"""The collective watchdog on real gloo worlds (two ranks as threads of this process): a
planted mismatch and a missing rank end in an error that says which rank is where; the debug
mode stops a mismatch before it runs; wrapped communicators behave as the bare ones."""

import gc
import threading
import time

import pytest
import torch

from shardline.comm.delegating import DelegatingCommunicator
from shardline.comm.store import serve_store
from shardline.comm.watchdog import DIAGNOSIS_CONNECT_S, SideChannel, WatchedCommunicator
from shardline.distributed.control_plane import ControlPlane
from shardline.errors import (
    CollectiveMismatchError,
    CommTimeoutError,
    CommunicationError,
    PeerLostError,
)
from shardline.interfaces import NativeAllReduce
from shardline_gloo.communicator import GlooBackend
from support.thread_ranks import run_thread_ranks

pytestmark = pytest.mark.timeout(60)


class _WithNativeEntry(DelegatingCommunicator):
    """gloo offering a native all-reduce entry point that nobody calls (``capsule`` None):
    what the watchdog makes of the entry point and of its failure is under test."""

    def wrap_group(self, group, ranks):
        return _WithNativeEntry(group)

    def native_all_reduce(self, like, calls):
        rank = self.rank

        def failed(message, timed_out):
            kind = CommTimeoutError if timed_out else CommunicationError
            return kind(message, op="all_reduce", rank=rank)

        return NativeAllReduce(None, calls, failed)


def _run_ranks(body, timeout_s=2.0, check_every=0, native=False):
    """Run ``body(comm)`` on two watched gloo ranks (with a native entry point where
    ``native``); returns each rank's result or error."""
    _store, rendezvous = serve_store()

    def open_rank(rank):
        comm = GlooBackend().init_world(rank, 2, rendezvous.with_prefix("data"), timeout_s)
        if native:
            comm = _WithNativeEntry(comm)
        return WatchedCommunicator(
            comm, SideChannel(rendezvous.with_prefix("watchdog")), check_every
        )

    return run_thread_ranks(2, open_rank, body)


def test_wrapped_operations_behave_as_the_bare_communicator():
    def body(comm):
        total = comm.all_reduce(torch.full((3,), float(comm.rank + 1)))
        gathered = comm.all_gather(torch.tensor([comm.rank]))
        pair = comm.new_group([0, 1])
        obj = ControlPlane(pair, b"s" * 32).broadcast_object({"from": comm.rank}, src=1)
        return total.tolist(), gathered.tolist(), obj, comm.last.describe(), pair.label

    results = _run_ranks(body)
    for rank in (0, 1):
        total, gathered, obj, last, label = results[rank]
        assert total == [3.0, 3.0, 3.0] and gathered == [0, 1] and obj == {"from": 1}
        assert last == "#2 all_gather [1] int64"
        assert label == "ranks [0, 1]"


def test_a_planted_mismatch_names_each_rank_and_its_operation():
    # Rank 1 runs one collective more than rank 0, then waits for a message rank 0 never
    # sends, while rank 0 is in the next collective. (Two different collectives would make
    # gloo abort the process; the debug mode below catches those before they run.)
    def body(comm):
        comm.all_reduce(torch.zeros(2))
        if comm.rank == 0:
            comm.all_reduce(torch.zeros(8, 576))
        else:
            comm.recv(torch.zeros(8, 576), src=0)

    results = _run_ranks(body)
    rank0, rank1 = "#2 all_reduce [8, 576] float32", "#2 recv with rank 0 [8, 576] float32"
    messages = [str(results[rank]) for rank in (0, 1)]
    # The first rank whose deadline passes ends in CommTimeoutError and its gloo pair closes;
    # the other may then see its peer go away (PeerLostError) before its own deadline. Either
    # way each error carries the watchdog's diagnosis.
    assert any(isinstance(results[rank], CommTimeoutError) for rank in (0, 1)), results
    for rank in (0, 1):
        assert isinstance(results[rank], (CommTimeoutError, PeerLostError)), results[rank]
        assert "watchdog on world" in messages[rank]
        assert (rank0, rank1)[rank] in messages[rank]
    # The rank whose deadline passes last sees both; the first waits 1 s for the other, which
    # on a loaded machine may time out later than that.
    assert any(rank0 in m and rank1 in m for m in messages), messages


def test_a_rank_that_never_arrives_is_named():
    def body(comm):
        if comm.rank == 1:
            time.sleep(8)  # well past rank 0's deadline (2 s) and its 1 s wait for reports
            return "slept"
        comm.all_reduce(torch.zeros(4))

    results = _run_ranks(body)
    message = str(results[0])
    assert "rank 0 is at #1 all_reduce [4] float32" in message
    assert "rank 1 did not report" in message


def test_debug_mode_stops_a_shape_mismatch_before_it_runs():
    def body(comm):
        return comm.all_reduce(torch.zeros(4 if comm.rank == 0 else 8))

    started = time.monotonic()
    results = _run_ranks(body, timeout_s=10.0, check_every=1)
    for rank in (0, 1):
        assert isinstance(results[rank], CollectiveMismatchError), results[rank]
        message = str(results[rank])
        assert "#1 all_reduce [4] float32" in message and "#1 all_reduce [8] float32" in message
    assert time.monotonic() - started < 5, "the mismatch waited for the deadline"


def test_a_native_run_is_one_fingerprint_and_its_failure_is_diagnosed():
    """A run of all-reduces made from C (Communicator.native_all_reduce) is one operation to
    the watchdog; a failure the C code reports gets every rank's position; the debug mode,
    which compares every operation, keeps the all-reduces in Python (no entry point)."""

    def body(comm):
        comm.all_reduce(torch.zeros(2))
        native = comm.native_all_reduce(torch.zeros(2, 576), 60)
        timed_out = native.failed("the C run timed out", True)
        other = native.failed("the C run was called too often", False)
        return native.calls, str(timed_out), type(other).__name__, str(other)

    results = _run_ranks(body, native=True)
    for rank in (0, 1):
        calls, message, other_kind, other = results[rank]
        assert calls == 60 and message.startswith("the C run timed out [watchdog on world")
        assert "at #2 all_reduce x60 (native) [2, 576] float32" in message
        # Only a timeout gets the ranks' positions: another failure is the backend's alone.
        assert (other_kind, other) == ("CommunicationError", "the C run was called too often")
    results = _run_ranks(lambda comm: comm.native_all_reduce(torch.zeros(2), 4), check_every=1,
                         native=True)  # fmt: skip
    assert results == {0: None, 1: None}


def test_a_rank_whose_store_is_gone_raises_without_waiting_long_for_it():
    """The diagnosis reaches the store on first use; with the store's host gone (here: the
    store ended once the world had formed) it gives up within DIAGNOSIS_CONNECT_S, not the
    channel's 10 s, and the error says the side channel failed."""
    holder = list(serve_store())
    rendezvous = holder[1]
    formed = threading.Barrier(2, timeout=20)

    def open_rank(rank):
        comm = GlooBackend().init_world(rank, 2, rendezvous.with_prefix("data"), 2.0)
        return WatchedCommunicator(comm, SideChannel(rendezvous.with_prefix("watchdog")))

    def body(comm):
        # Both ranks have formed the world: one that returned first may leave the other still
        # reading the store (ProcessGroupGloo's set-up), which its end would break.
        formed.wait()
        if comm.rank == 1:
            holder.clear()  # the last reference to the store: it stops serving
            gc.collect()
            time.sleep(8)
            return "slept"
        time.sleep(0.5)
        started = time.monotonic()
        with pytest.raises(CommTimeoutError) as raised:
            comm.all_reduce(torch.zeros(4))
        return time.monotonic() - started, str(raised.value)

    elapsed, message = run_thread_ranks(2, open_rank, body)[0]
    assert "the side channel failed" in message and "frame #" not in message, message
    # torch's TCPStore tries to connect twice, each up to its timeout (3.6-4.7 s here for
    # 2 s); with the channel's own 10 s this would take over 20 s.
    assert elapsed < 2.0 + 2 * DIAGNOSIS_CONNECT_S + 1.5, elapsed
