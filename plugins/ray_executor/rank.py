"""The body of a rank's process, started by its actor: start up in phases, then serve calls.

The process ignores Ctrl-C (the driver decides when ranks stop) and ends with its actor: it
is a tethered child (``Spawner``), and it leaves when the actor closes the pipe between them.
"""

from __future__ import annotations

import multiprocessing.connection
import pickle
import signal
from typing import Any

import cloudpickle

from shardline.errors import RemoteFailure
from shardline.interfaces import Rendezvous
from shardline.sdk import EngineConfig, pickled_reply
from shardline_ray.placement import RankPlace
from shardline_ray.protocol import Call, Done, Failure, Phase, Reply

_NEXT_PHASE = {"distributed init": "model load", "model load": "ready"}


def rank_main(
    place: RankPlace,
    world_size: int,
    config: EngineConfig,
    rendezvous: Rendezvous,
    pipe_fd: int,
) -> None:
    """Run the rank at ``place``, talking to its actor over the pipe ``pipe_fd``."""
    # Imported here, in the rank: the actor imports this module only to name rank_main, and
    # must not pay for torch (the worker's imports) in a process that never computes.
    from shardline.sdk import WorkerSetup, share_cores

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    share_cores(place.ranks_on_node)
    rank = place.rank
    pipe = multiprocessing.connection.Connection(pipe_fd)

    def send(message: Any) -> None:
        pipe.send_bytes(pickled_reply(message))

    send(Phase("spawn"))
    phase = "distributed init"

    def advance(done: str) -> None:
        nonlocal phase
        send(Phase(done))
        phase = _NEXT_PHASE[done]

    try:
        context = WorkerSetup(config).build(rank, world_size, rendezvous, on_phase=advance)
    except BaseException as error:
        send(Failure(phase, RemoteFailure.capture(error)))
        return
    try:
        send(Phase("ready"))
        _serve(rank, context.worker, pipe)
    finally:
        context.close()
        pipe.close()


def _serve(rank: int, worker: Any, pipe: multiprocessing.connection.Connection) -> None:
    """Run calls in the order they arrive until the actor closes the pipe. A call this rank
    cannot load, or whose result cannot be pickled, fails (the rank goes on)."""
    while True:
        try:
            data = pipe.recv_bytes()
        except EOFError:
            return
        try:
            call: Call = pickle.loads(data)
            if isinstance(call.method, str):
                value = getattr(worker, call.method)(*call.args, **call.kwargs)
            else:
                value = cloudpickle.loads(call.method)(worker, *call.args, **call.kwargs)
            reply = pickled_reply(Reply(value) if call.reply_rank in (None, rank) else Done())
        except Exception as error:
            reply = pickled_reply(Failure("call", RemoteFailure.capture(error)))
        pipe.send_bytes(reply)
