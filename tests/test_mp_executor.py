"""The mp executor: transformers' greedy tokens under TP=2, PP=2 and TP=2 x PP=2 (4 workers
on 2 cores); a SIGKILL mid-generation, a bad start-up, an idle engine, a killed or interrupted
driver, each with nothing left behind. The executor contract itself (replies, order,
exceptions, deadlines, deaths, shutdown) is checked by the executor conformance suite."""

import contextlib
import dataclasses
import os
import pickle
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from shardline.config import load_config
from shardline.conformance.executors import probe
from shardline.conformance.executors.checks import alive, unlinked_segments, wait_gone
from shardline.errors import ConfigError, PeerLostError, WorkerError
from shardline.interfaces import CachedRequest, NewRequest, SamplingParams, SchedulerOutput
from shardline.registry import Registry
from shardline_executors.mp_protocol import decode_step, encode_step
from support.greedy_driver import GREEDY_TOKENS, run_script
from support.segments import job_segments

pytestmark = pytest.mark.timeout(300)


def _executor(tiny_llama_dir, tp=1, pp=1, extra=()):
    config = load_config(
        overrides=[
            f"model.path={tiny_llama_dir}",
            "cache.block_size=4",
            "cache.num_blocks=40",
            f"parallel.tensor_parallel_size={tp}",
            f"parallel.pipeline_parallel_size={pp}",
            "parallel.distributed_executor_backend=mp",
            *extra,
        ],
        environ={},
    ).config
    return Registry.load().get("executor", "mp").load_available()(config)


def _segments(job):
    """The job's shared-memory segments (``shardline-<job>-...``); other jobs' are not ours."""
    return job_segments(job)


@dataclasses.dataclass(frozen=True)
class _TaggedStep(SchedulerOutput):
    tag: str = ""


def test_a_step_travels_as_builtins_and_arrives_whole():
    cached = [CachedRequest("b", [7], [3], 12), CachedRequest("c", [], [], 4)]
    step = SchedulerOutput(
        new_requests=[NewRequest("a", [1, 2], SamplingParams(temperature=0.5), [0, 1])],
        cached_requests=cached,
        num_scheduled_tokens={"a": 2, "b": 1, "c": 1},
        finished_req_ids={"z"},
    )
    # Every field is set, so a field added to the step without its encoding fails here.
    assert all(getattr(step, field.name) for field in dataclasses.fields(SchedulerOutput))
    assert decode_step(pickle.loads(pickle.dumps(encode_step(step)))) == step
    decoding = SchedulerOutput(cached_requests=cached, num_scheduled_tokens={"b": 1, "c": 1})
    wire = pickle.dumps(encode_step(decoding))
    assert b"CachedRequest" not in wire and b"SchedulerOutput" not in wire
    assert decode_step(pickle.loads(wire)) == decoding


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_mp_generates_transformers_tokens(tiny_llama_dir, tiny_llama_greedy, tp, pp):
    executor = _executor(tiny_llama_dir, tp, pp)
    # The call ring, the heartbeats and a reply ring per worker: mapped, their names gone.
    assert _segments(executor.job) == []
    mapped = {name for name in unlinked_segments([os.getpid()]) if executor.job in name}
    assert len(mapped) == 2 + tp * pp
    try:

        def execute(step):
            return executor.execute_model(step).result(timeout=60)

        assert run_script(execute, GREEDY_TOKENS) == tiny_llama_greedy
        # A subclass of the step (with a field of its own) travels whole and still runs.
        assert execute(_TaggedStep(finished_req_ids={"gone"}, tag="t")) is None
        assert executor.output_rank == tp * pp - tp
        pids = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
    finally:
        executor.shutdown()
    assert alive(pids) == []
    assert _segments(executor.job) == []


def test_sigkill_mid_generation_fails_the_step_within_a_second(tiny_llama_dir):
    executor = _executor(tiny_llama_dir, tp=1, pp=2)
    pids = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
    steps = 0
    killed_at = None

    def execute(step):
        nonlocal steps, killed_at
        steps += 1
        pending = executor.execute_model(step)
        if steps == 5:
            os.kill(pids[1], signal.SIGKILL)
            killed_at = time.monotonic()
        return pending.result(timeout=30)

    try:
        with pytest.raises(PeerLostError, match=r"rank 1 \(pid \d+\) died with exit code -9"):
            run_script(execute, GREEDY_TOKENS)
        assert time.monotonic() - killed_at < 1.0
        assert steps <= 6
        with pytest.raises(PeerLostError, match="rank 1"):
            executor.collective_rpc(probe.echo, (1,))
    finally:
        executor.shutdown()
    assert alive(pids) == []
    assert _segments(executor.job) == []


def test_start_up_failure_names_phase_and_rank_and_keeps_its_type(tmp_path, capfd):
    with pytest.raises(WorkerError) as raised:
        _executor(tmp_path / "missing-model", tp=2)
    assert "start-up phase 'model load'" in str(raised.value)
    assert "missing-model': no such file or directory" in str(raised.value)
    assert isinstance(raised.value.origin, ConfigError)  # decides the CLI's exit code
    assert "no such file or directory" in str(raised.value.origin)
    assert "Exception ignored" not in capfd.readouterr().err  # a quiet shutdown


def test_a_worker_that_dies_in_start_up_is_named_with_its_phase(tiny_llama_dir):
    with pytest.raises(PeerLostError) as raised:
        _executor(tiny_llama_dir, tp=2, extra=["model.runner=support.dying_runner:DyingRunner"])
    message = str(raised.value)
    assert re.fullmatch(
        r"worker rank 1 \(pid \d+\) died with exit code -9 in start-up phase 'model load'",
        message,
    ), message
    assert raised.value.rank == 1


def test_shutdown_while_the_workers_still_start_kills_them_at_once(tiny_llama_dir, monkeypatch):
    """An executor abandoned in its start (a data-parallel replica beside one that failed,
    shut down by the interpreter's exit): its shutdown, from another thread while the
    constructor waits for the workers' phases, kills them at once (none reads a request to
    stop before its start ends: a grace period would only be waited out), and the
    constructor then fails."""
    import threading

    from shardline_executors.mp import MultiprocExecutor

    waiting, go_on = threading.Event(), threading.Event()
    starting: list[MultiprocExecutor] = []
    start_up = MultiprocExecutor._start_up

    def start_up_later(self, timeout_s):
        starting.append(self)
        waiting.set()
        go_on.wait(30)
        start_up(self, timeout_s)

    monkeypatch.setattr(MultiprocExecutor, "_start_up", start_up_later)
    failures: list[BaseException] = []

    def construct():
        try:
            _executor(tiny_llama_dir, tp=2)
        except BaseException as error:
            failures.append(error)

    constructor = threading.Thread(target=construct)
    constructor.start()
    try:
        assert waiting.wait(60)
        (executor,) = starting
        deadline = time.monotonic() + 60  # forked once the fork server has imported torch
        while None in (pids := [process.pid for process in executor._ranks.processes]):
            assert time.monotonic() < deadline, "the workers were never forked"
            time.sleep(0.05)
        begun = time.monotonic()
        executor.shutdown()
        assert time.monotonic() - begun < 1.5, "shutdown waited for workers that still start"
    finally:
        go_on.set()
        constructor.join(30)
    assert wait_gone(pids, 5.0) == []
    assert len(failures) == 1 and isinstance(failures[0], PeerLostError), failures
    assert "shut down while its workers started" in str(failures[0])


def _start_driver(tiny_llama_dir, own_group=False):
    import json
    import subprocess
    import sys
    from pathlib import Path

    tests = Path(__file__).parent
    driver = subprocess.Popen(
        [sys.executable, str(tests / "support" / "mp_driver.py"), str(tiny_llama_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(tests)},
        start_new_session=own_group,
    )
    line = driver.stdout.readline()
    if not line:
        driver.kill()
        raise AssertionError(driver.stderr.read())
    return driver, json.loads(line)


def _cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_gone_segments(job, seconds):
    """A killed driver's segments are gone (their names were removed once the workers had
    mapped them; before that, Python's resource tracker removes them)."""
    deadline = time.monotonic() + seconds
    while _segments(job) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _segments(job)


def test_idle_workers_use_little_cpu_and_exit_when_the_driver_is_killed(tiny_llama_dir):
    driver, info = _start_driver(tiny_llama_dir)
    try:
        workers = info["workers"]
        time.sleep(1.5)  # past start-up's tail, which a loaded host stretches
        start = {pid: _cpu_seconds(pid) for pid in [driver.pid, *workers]}
        time.sleep(3.0)
        used = sum(_cpu_seconds(pid) - start[pid] for pid in start)
        # Idle, the three processes' backed-off polls take 2.0-2.7% of a core on a quiet host
        # and took 5.3% once beside the rest of the suite (each wake-up costs more there); a
        # process that spins, even yielding, takes a third of a core or more.
        assert used / 3.0 < 0.08, f"idle engine used {used / 3.0:.1%} of a core"
        driver.kill()
        driver.wait(10)
        assert wait_gone(workers, 5.0) == []
        assert _wait_gone_segments(info["job"], 5.0) == []
    finally:
        if driver.poll() is None:
            driver.kill()


def test_killing_the_whole_process_group_leaves_no_segment(tiny_llama_dir):
    """SIGKILL to every process of the job at once (``timeout -s KILL``, a batch system)
    also kills Python's resource tracker: the segments' names were already gone."""
    driver, info = _start_driver(tiny_llama_dir, own_group=True)
    try:
        assert _segments(info["job"]) == []
        os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(10)
        assert wait_gone(info["workers"], 5.0) == []
        assert _segments(info["job"]) == []
    finally:
        if driver.poll() is None:
            driver.kill()


def test_ctrl_c_on_the_driver_shuts_everything_down(tiny_llama_dir):
    driver, info = _start_driver(tiny_llama_dir)
    try:
        driver.send_signal(signal.SIGINT)
        try:
            out, err = driver.communicate(timeout=30)
        except subprocess.TimeoutExpired as timeout:
            driver.kill()
            raise AssertionError(
                f"the driver did not exit within 30 s of Ctrl-C; workers alive: "
                f"{alive(info['workers'])}; output: {timeout.output!r}; errors: {timeout.stderr!r}"
            ) from None
        assert "shut down" in out, err
        assert wait_gone(info["workers"], 5.0) == []
        assert _segments(info["job"]) == []
    finally:
        if driver.poll() is None:
            driver.kill()


def _listening_addresses(port):
    """The local addresses of the sockets listening on TCP ``port`` (from /proc/net)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                found.append(address)
    return found


def test_the_store_listens_on_loopback_and_drops_junk_quietly(tiny_llama_dir):
    """Every rank of an mp world is local: its store is reachable from this host only. A
    connection sending junk, a huge length or another protocol is dropped, nothing reaches
    the user's terminal, and the store keeps serving."""
    import socket
    import struct

    from shardline.comm.store import connect_store
    from shardline.interfaces import Rendezvous

    driver, info = _start_driver(tiny_llama_dir)
    try:
        host, port = info["store"]
        assert host == "127.0.0.1"
        assert _listening_addresses(port) == ["0100007F"]  # 127.0.0.1, nothing else
        validate = b"\x00" + struct.pack("<I", 0x3C85F7CE)  # what a store client sends first
        for junk in (
            b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            b"\xff" * 4096,
            validate + b"\x01" + struct.pack("<Q", 1 << 40),
            validate + b"\x01" + struct.pack("<Q", 1) + b"k" + struct.pack("<Q", 1 << 33),
        ):
            with socket.create_connection((host, port), timeout=5) as connection:
                connection.sendall(junk)
                connection.settimeout(2)
                with contextlib.suppress(OSError):
                    connection.recv(1)
        store = connect_store(Rendezvous(host, port, "probe/"), 10.0)
        store.set("alive", "yes")
        assert store.get("alive") == b"yes"
        driver.send_signal(signal.SIGINT)
        out, err = driver.communicate(timeout=30)
        assert "shut down" in out
        assert err == "", err
    finally:
        if driver.poll() is None:
            driver.kill()
