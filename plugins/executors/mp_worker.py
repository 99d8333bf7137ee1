"""The body of an mp worker process: start up in phases, then serve broadcast calls.

The process ignores Ctrl-C (the driver decides when workers stop). The kernel ends it when
its driver dies (it is a tethered child); as a second line, a thread watches the parent and
unlinks the driver's segments before leaving, where the kernel cannot do the first.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import pickle
import signal
import threading
import time
from typing import Any

import cloudpickle

from shardline.errors import RemoteFailure
from shardline.interfaces import Rendezvous
from shardline.sdk import EngineConfig, Polling, WorkerSetup, pickled_reply, place_rank
from shardline_executors.heartbeat import start_beating
from shardline_executors.mp_protocol import FIRST_CALL_ID, STEP, Failure, Phase, decode_step
from shardline_executors.shm_ring import RingHandle, ShmRing

_PARENT_CHECK_S = 0.5


def worker_main(
    rank: int,
    world_size: int,
    cores: frozenset[int] | None,
    config: EngineConfig,
    rendezvous: Rendezvous,
    calls: RingHandle,
    replies: RingHandle,
    heartbeats: str,
    doorbell_fd: int,
    reply_bell_fd: int,
) -> None:
    # The parent: the driver, or the fork server that ends with it (checked alive at start).
    parent_pid = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    start_beating(heartbeats, rank)
    ranks_on_host = world_size * config.parallel.worlds_side_by_side
    place_rank(cores, ranks_on_host)
    segments = [calls.name, replies.name, heartbeats]
    threading.Thread(target=_exit_with_parent, args=(parent_pid, segments), daemon=True).start()
    doorbell = multiprocessing.connection.Connection(doorbell_fd, writable=False)
    # The driver is a process too: where it and the ranks outnumber the cores, a rank waiting
    # for the next call yields at once. Its spin would hold a core that the driver or the
    # rank that replies needs (an empty call's round trip, pinned, 2 ranks and the driver on
    # 2 cores: 28 -> 23 us with both ranks on one core, 71 -> 66 with the driver beside the
    # replying rank, 13.4 -> 13.3 beside the other).
    inbox = ShmRing.attach(calls, polling=Polling.for_ranks_on_host(ranks_on_host + 1))
    outbox = ShmRing.attach(replies)
    outbox.set_doorbells([multiprocessing.connection.Connection(reply_bell_fd, readable=False)])
    context = None
    try:

        def send(message: Any) -> None:
            outbox.put(pickled_reply(message))

        phase = "spawn"
        send(Phase(phase))
        try:
            phase = "distributed init"

            def advance(done: str) -> None:
                nonlocal phase
                send(Phase(done))
                phase = "model load" if done == "distributed init" else "ready"

            context = WorkerSetup(config).build(rank, world_size, rendezvous, on_phase=advance)
            send(Phase("ready"))
        except BaseException as error:
            send(Failure(None, phase, RemoteFailure.capture(error)))
            return
        try:
            _serve(rank, context.worker, inbox, doorbell, outbox)
        except (EOFError, OSError):
            # The doorbell's other end closed: the driver is gone.
            _leave(segments)
    finally:
        if context is not None:
            context.close()
        inbox.close()
        outbox.close()
        doorbell.close()


def _serve(rank: int, worker: Any, inbox: ShmRing, doorbell: Any, outbox: ShmRing) -> None:
    call_id = FIRST_CALL_ID
    while True:
        data = inbox.get(rank, doorbell=doorbell)
        try:
            call_id, method, args, kwargs, reply_rank = pickle.loads(data)
        except Exception as error:
            # A call this worker cannot load (an argument of a class only the driver has):
            # its id follows the last call's (mp_protocol), and it fails.
            outbox.put(pickled_reply(Failure(call_id, "call", RemoteFailure.capture(error))))
            call_id += 1
            continue
        if method is None:
            return
        try:
            if method == STEP:
                value = worker.execute_model(decode_step(args))
            elif isinstance(method, str):
                value = getattr(worker, method)(*args, **kwargs)
            else:
                value = cloudpickle.loads(method)(worker, *args, **kwargs)
            reply = pickled_reply((call_id, value)) if reply_rank in (None, rank) else None
        except Exception as error:
            reply = pickled_reply(Failure(call_id, "call", RemoteFailure.capture(error)))
        if reply is not None:
            outbox.put(reply)
        call_id += 1


def _exit_with_parent(parent_pid: int, segments: list[str]) -> None:
    """Watch the parent (the driver, or the fork server that ends with it); when it is gone,
    remove the driver's segments and end this process."""
    while os.getppid() == parent_pid:
        time.sleep(_PARENT_CHECK_S)
    _leave(segments)


def _leave(segments: list[str]) -> None:
    """The driver is gone: unlink its segments (it cannot) and end this process now."""
    for name in segments:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")
    os._exit(3)
