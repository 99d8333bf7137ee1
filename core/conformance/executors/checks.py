"""The executor contract, as checks that run unchanged in a driver process (``uni``, ``mp``,
most third-party executors) and in every process of a launched world (``external_launcher``).

A check takes a :class:`Subject` and raises ``AssertionError`` (or any error) when the
executor breaks the contract. The world's layout is ``pp = world_size`` (one rank per
pipeline stage), so the output rank is the last rank and a step crosses every rank.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from shardline.config import load_config
from shardline.config.schema import EngineConfig
from shardline.conformance.executors import probe
from shardline.engine.starting import start_all
from shardline.errors import CommTimeoutError, PeerLostError, WorkerError
from shardline.interfaces import Executor
from shardline.interfaces.step import NewRequest, SamplingParams, SchedulerOutput

#: The deadline the deadline check gives a call; the answer must come within this + slack.
CALL_DEADLINE_S = 1.5
DEADLINE_SLACK_S = 1.5
#: A dead rank must be noticed within this long.
DEATH_NOTICED_S = 1.0


def probe_config(
    executor: str, world_size: int, timeout_s: float, plugins: tuple[str, ...] | None = None
) -> EngineConfig:
    """A world of ``world_size`` pipeline stages running the probe model runner."""
    overrides = [
        f"model.runner={probe.PROBE_RUNNER}",
        f"parallel.pipeline_parallel_size={world_size}",
        f"parallel.distributed_executor_backend={executor}",
        f"parallel.timeout_s={timeout_s}",
        f"parallel.startup_timeout_s={max(timeout_s, 60.0)}",
    ]
    if plugins is not None:
        overrides.append(f"plugins.allow=[{','.join(plugins)}]")
    return load_config(overrides=overrides, environ={}).config


@dataclass
class Subject:
    """The executor under test as a check sees it.

    ``shared()`` is the session's executor for this world (checks must leave it usable);
    ``fresh()`` makes a new one, which the check shuts down. ``process_rank`` is this
    process's rank in a launched world, None in a driver process.
    """

    executor_class: type[Executor]
    world_size: int
    shared: Callable[[], Executor]
    fresh: Callable[[], Executor]
    process_rank: int | None = None

    @property
    def last_rank(self) -> int:
        return self.world_size - 1


def _step() -> SchedulerOutput:
    return SchedulerOutput(
        new_requests=[NewRequest("probe", [1, 2, 3], SamplingParams(temperature=0.0), [0])],
        num_scheduled_tokens={"probe": 3},
    )


def mapped_segments(pids: list[int]) -> set[Path]:
    """The /dev/shm files the processes ``pids`` have mapped now: the run's own segments,
    told apart from other jobs' on the same host without naming rules."""
    return {Path(path) for path in _shm_mappings(pids) if not path.endswith(_UNLINKED)}


def unlinked_segments(pids: list[int]) -> set[str]:
    """The names the /dev/shm segments that the processes ``pids`` have mapped now had
    before they were unlinked (in use, with nothing left in /dev/shm)."""
    return {
        path.removeprefix("/dev/shm/").removesuffix(_UNLINKED)
        for path in _shm_mappings(pids)
        if path.endswith(_UNLINKED)
    }


_UNLINKED = " (deleted)"  # how /proc/PID/maps marks a file whose name is gone


def _shm_mappings(pids: list[int]) -> set[str]:
    """The /dev/shm paths in the memory maps of the processes ``pids``."""
    found = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith("/dev/shm/"):
                found.add(fields[5])
    return found


def alive(pids: list[int]) -> list[int]:
    """Those of ``pids`` that are still running (zombies count as gone)."""
    running = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            running.append(pid)
    return running


def wait_gone(pids: list[int], seconds: float) -> list[int]:
    """Those of ``pids`` still running after up to ``seconds`` of waiting for them to end."""
    deadline = time.monotonic() + seconds
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


def check_rank_assignment(subject: Subject) -> None:
    """Rank r's Worker has rank r; each rank is its own process where the executor runs
    processes (in a launched world, this process is rank ``process_rank``)."""
    executor = subject.shared()
    replies = executor.collective_rpc(probe.rank_and_pid)
    assert [rank for rank, _ in replies] == list(range(subject.world_size)), replies
    pids = [pid for _, pid in replies]
    if executor.owns_processes or executor.launched:
        assert len(set(pids)) == subject.world_size, f"ranks share processes: {replies}"
    if executor.owns_processes:
        assert os.getpid() not in pids, "a rank runs in the driver process"
    if subject.process_rank is not None:
        assert pids[subject.process_rank] == os.getpid(), (
            f"this process is rank {subject.process_rank} but that rank's pid is "
            f"{pids[subject.process_rank]}"
        )


def check_reply_rank(subject: Subject) -> None:
    """``unique_reply_rank`` returns exactly that rank's reply; ``execute_model`` returns a
    Future of the output rank's (the last rank here), after the step went through every stage
    in order."""
    executor = subject.shared()
    for rank in range(subject.world_size):
        replies = executor.collective_rpc(probe.rank_and_pid, unique_reply_rank=rank)
        assert len(replies) == 1 and replies[0][0] == rank, (rank, replies)
    assert executor.output_rank == subject.last_rank, executor.output_rank
    pending = executor.execute_model(_step())
    assert isinstance(pending, Future), f"execute_model returned {type(pending).__name__}"
    output = pending.result(timeout=60)
    assert output == {"visited": list(range(subject.world_size)), "rank": subject.last_rank}, output
    for wrong in (-1, subject.world_size):
        try:
            executor.collective_rpc(probe.echo, (1,), unique_reply_rank=wrong)
        except ValueError:
            continue
        raise AssertionError(f"unique_reply_rank = {wrong} was accepted")


def check_broadcast_order(subject: Subject) -> None:
    """Every rank runs the calls in the order they were made; non-blocking calls' futures
    resolve in call order; method names, callables and large payloads all travel."""
    executor = subject.shared()
    executor.collective_rpc(probe.take_journal)
    resolved: list[int] = []
    futures = []
    for index in range(20):
        future = executor.collective_rpc(probe.record, (index,), non_block=True)
        assert isinstance(future, Future), f"non_block returned {type(future).__name__}"
        future.add_done_callback(lambda _, index=index: resolved.append(index))
        futures.append(future)
    results = [future.result(timeout=60) for future in futures]
    assert results == [[index] * subject.world_size for index in range(20)], results
    assert resolved == list(range(20)), f"futures resolved in order {resolved}"
    journals = executor.collective_rpc(probe.take_journal)
    assert journals == [list(range(20))] * subject.world_size, journals
    assert (
        executor.collective_rpc("execute_model", (SchedulerOutput(),))
        == [None] * subject.world_size
    )
    payload = bytes(range(256)) * 20_000  # 5 MB
    assert executor.collective_rpc(probe.echo, (payload,), unique_reply_rank=0) == [payload]


def check_exception_envelope(subject: Subject) -> None:
    """An exception in a rank arrives as ``WorkerError`` with its rank, type, message and
    traceback; so does a result that cannot be pickled back or loaded where it arrives,
    and an argument a rank cannot load (where results and arguments travel); an argument that
    cannot be pickled raises TypeError naming the call before anything is sent (or its result
    fails to go back, where the call runs in the caller's process); the executor stays
    usable."""
    executor = subject.shared()
    try:
        executor.collective_rpc(probe.raise_on_rank, (subject.last_rank,))
    except WorkerError as error:
        assert error.rank == subject.last_rank, error.rank
        assert error.exc_type == "KeyError", error.exc_type
        assert f"planted failure on rank {subject.last_rank}" in str(error), str(error)
        assert "raise_on_rank" in error.remote_traceback, error.remote_traceback
    else:
        raise AssertionError("an exception in a rank did not raise WorkerError")
    future = executor.collective_rpc(probe.raise_everywhere, non_block=True)
    try:
        future.result(timeout=60)
    except WorkerError as error:
        assert error.exc_type == "RuntimeError", error.exc_type
    else:
        raise AssertionError("a failed non-blocking call's future did not raise WorkerError")
    _fails_or_stays_home(executor, probe.unpicklable_result, (), "cannot be pickled")
    _fails_or_stays_home(executor, probe.result_only_the_rank_loads, (), "loads only")
    try:
        executor.collective_rpc(probe.echo, (threading.Lock(),))
    except TypeError as error:  # refused in the caller
        assert "call 'echo' cannot be pickled" in str(error), str(error)
    except WorkerError as error:  # run in the caller's process: its result cannot go back
        assert "cannot be pickled" in str(error), str(error)
    if not executor.launched:  # there every process makes its own arguments
        _fails_or_stays_home(executor, probe.echo, (probe.LoadsOnlyWhereMade(),), "loads only")
    assert executor.collective_rpc(probe.echo, ("after",)) == ["after"] * subject.world_size


def _fails_or_stays_home(executor: Executor, method: Callable, args: tuple, cause: str) -> None:
    """``method(*args)`` either fails with a WorkerError naming ``cause`` (an executor that
    pickles the call or its results) or returns (one that runs it in the caller's process)."""
    try:
        executor.collective_rpc(method, args)
    except WorkerError as error:
        assert cause in str(error), f"{method.__name__}: {error}"


def check_call_deadline(subject: Subject) -> None:
    """A rank that does not answer makes the call raise ``CommTimeoutError`` naming it when
    the call's deadline passes; shutdown afterwards leaves nothing behind."""
    before = mapped_segments([os.getpid()])
    executor = subject.fresh()
    pids = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
    segments = mapped_segments([os.getpid(), *pids]) - before
    sleeper = subject.last_rank
    try:
        if subject.process_rank == sleeper:
            # In a launched world this process is the sleeper: it can only wake up and finish.
            with contextlib.suppress(CommTimeoutError):
                executor.collective_rpc(
                    probe.sleep_on_rank, (sleeper, CALL_DEADLINE_S + 3.0), timeout=CALL_DEADLINE_S
                )
            return
        start = time.monotonic()
        try:
            executor.collective_rpc(
                probe.sleep_on_rank, (sleeper, CALL_DEADLINE_S + 3.0), timeout=CALL_DEADLINE_S
            )
        except CommTimeoutError as error:
            assert f"[{sleeper}]" in str(error), f"the error does not name rank {sleeper}: {error}"
        else:
            raise AssertionError("a call past its deadline returned")
        elapsed = time.monotonic() - start
        assert elapsed < CALL_DEADLINE_S + DEADLINE_SLACK_S, f"raised after {elapsed:.2f} s"
    finally:
        executor.shutdown()
    _check_nothing_left(executor, pids, segments)


def check_death_detection(subject: Subject) -> None:
    """A rank killed with SIGKILL fails the pending call within a second with
    ``PeerLostError`` naming the rank and its exit code, and every later call too."""
    before = mapped_segments([os.getpid()])
    executor = subject.fresh()
    victim = subject.last_rank
    try:
        pids = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
        segments = mapped_segments([os.getpid(), *pids]) - before
        pending = executor.collective_rpc(probe.sleep_on_rank, (victim, 30.0), non_block=True)
        time.sleep(0.2)
        os.kill(pids[victim], signal.SIGKILL)
        start = time.monotonic()
        try:
            pending.result(timeout=10)
        except PeerLostError as error:
            message = str(error)
            assert f"rank {victim}" in message and "-9" in message, message
        else:
            raise AssertionError("the pending call returned although its rank was killed")
        elapsed = time.monotonic() - start
        assert elapsed < DEATH_NOTICED_S, f"the death was noticed after {elapsed:.2f} s"
        for later in (lambda: executor.collective_rpc(probe.echo, (1,)), executor.check_health):
            try:
                later()
            except PeerLostError:
                continue
            raise AssertionError("a call after a rank died did not raise PeerLostError")
    finally:
        executor.shutdown()
    _check_nothing_left(executor, pids, segments)


def check_shutdown(subject: Subject) -> None:
    """Shutdown is idempotent; calls after it raise ``PeerLostError``; no rank process and
    shared-memory segment the run mapped is left."""
    before = mapped_segments([os.getpid()])
    executor = subject.fresh()
    pids = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
    segments = mapped_segments([os.getpid(), *pids]) - before
    executor.shutdown()
    executor.shutdown()
    for later in (lambda: executor.collective_rpc(probe.echo, (1,)), executor.check_health):
        try:
            later()
        except PeerLostError:
            continue
        raise AssertionError("a call after shutdown did not raise PeerLostError")
    _check_nothing_left(executor, pids, segments)


def check_concurrent_start(subject: Subject) -> None:
    """Two executors constructed at once, each in a thread of its own (as the engine starts
    data-parallel replicas), both work: each rank answers from its own world (its own
    processes, where the executor owns them); shut down, neither leaves anything."""
    before = mapped_segments([os.getpid()])
    pair = start_all(lambda _: subject.fresh(), 2, True, lambda executor: executor.shutdown())
    try:
        answers = [executor.collective_rpc(probe.rank_and_pid) for executor in pair]
        for answer in answers:
            assert [rank for rank, _ in answer] == list(range(subject.world_size)), answers
        pids = [[pid for _, pid in answer] for answer in answers]
        if pair[0].owns_processes:
            assert not set(pids[0]) & set(pids[1]), f"the two worlds share processes: {pids}"
        segments = mapped_segments([os.getpid(), *pids[0], *pids[1]]) - before
    finally:
        for executor in pair:
            executor.shutdown()
    for executor, its_pids in zip(pair, pids, strict=True):
        _check_nothing_left(executor, its_pids, segments)


def _check_nothing_left(executor: Executor, pids: list[int], segments: set[Path]) -> None:
    """No rank process is left, nor any segment the run's processes mapped (judged by the
    suite for a launched world, where the other ranks may still be running)."""
    if executor.owns_processes:
        left = wait_gone(pids, 5.0)
        assert left == [], f"rank processes still running after shutdown: {left}"
    if not executor.launched:
        left_segments = sorted(str(path) for path in segments if path.exists())
        assert not left_segments, f"shared-memory segments left: {left_segments}"


#: name -> (check, the trait it needs or None, why it does not apply without that trait)
CHECKS: dict[str, tuple[Callable[[Subject], None], str | None, str]] = {
    "rank assignment": (check_rank_assignment, None, ""),
    "reply rank": (check_reply_rank, None, ""),
    "broadcast order": (check_broadcast_order, None, ""),
    "exception envelope": (check_exception_envelope, None, ""),
    "call deadline": (
        check_call_deadline,
        "enforces_deadlines",
        "runs calls in the caller's thread: a deadline cannot end a call still running",
    ),
    "death detection": (
        check_death_detection,
        "owns_processes",
        "does not own its rank processes (the caller or the launcher does)",
    ),
    "shutdown": (check_shutdown, None, ""),
    "concurrent start": (
        check_concurrent_start,
        "starts_concurrently",
        "starts one replica's executor after another (starts_concurrently is not set)",
    ),
}


def not_applicable(executor_class: type[Executor], name: str, world_size: int) -> str | None:
    """Why check ``name`` does not apply to ``executor_class`` at ``world_size``, or None."""
    limit = executor_class.max_world_size
    if limit is not None and world_size > limit:
        return f"runs at most {limit} rank(s)"
    _, trait, reason = CHECKS[name]
    if trait is not None and not getattr(executor_class, trait):
        return reason
    return None
