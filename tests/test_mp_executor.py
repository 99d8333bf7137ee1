"""The mp executor: transformers' greedy tokens under TP=2 and PP=2, replies from the output
rank, ordered non-blocking calls, and faults (an exception, a hang, a SIGKILL, a bad start-up)
ending in typed errors with nothing left behind."""

import os
import signal
import time

import pytest

from shardline.config import load_config
from shardline.errors import CommTimeoutError, PeerLostError, WorkerError
from shardline.registry import Registry
from support import mp_helpers
from support.greedy_driver import GREEDY_TOKENS, run_script

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


def _segments():
    return {name for name in os.listdir("/dev/shm") if name.startswith("psm_")}


def _alive(pids):
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().split()[2] != "Z":
                alive.append(pid)
    return alive


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_mp_generates_transformers_tokens(tiny_llama_dir, tiny_llama_greedy, tp, pp):
    before = _segments()
    executor = _executor(tiny_llama_dir, tp, pp)
    try:

        def execute(step):
            result = executor.execute_model(step)
            return result.result(timeout=60) if pp > 1 else result

        assert run_script(execute, GREEDY_TOKENS) == tiny_llama_greedy
        assert executor.output_rank == tp * pp - tp
        pids = [pid for _, pid in executor.collective_rpc(mp_helpers.rank_and_pid)]
    finally:
        executor.shutdown()
    assert _alive(pids) == []
    assert _segments() == before


def test_calls_replies_and_faults(tiny_llama_dir):
    before = _segments()
    executor = _executor(tiny_llama_dir, tp=2)
    try:
        assert [r for r, _ in executor.collective_rpc(mp_helpers.rank_and_pid)] == [0, 1]
        assert executor.collective_rpc(mp_helpers.echo, ("x",), unique_reply_rank=1) == ["x"]
        futures = [
            executor.collective_rpc(mp_helpers.echo, (i,), non_block=True) for i in range(20)
        ]
        assert [f.result(timeout=30) for f in futures] == [[i, i] for i in range(20)]
        big = bytes(range(256)) * 20000  # 5 MB: larger than a ring slot
        assert executor.collective_rpc(mp_helpers.echo, (big,), unique_reply_rank=0) == [big]

        with pytest.raises(WorkerError) as raised:
            executor.collective_rpc(mp_helpers.raise_on_rank, (1,))
        assert raised.value.rank == 1 and raised.value.exc_type == "KeyError"
        assert "planted failure on rank 1" in str(raised.value)
        assert "raise_on_rank" in raised.value.remote_traceback
        assert executor.collective_rpc(mp_helpers.echo, ("still fine",)) == ["still fine"] * 2
        with pytest.raises(WorkerError, match="planted failure on every rank"):
            executor.collective_rpc(mp_helpers.raise_everywhere)
        # The second rank's copy of that failure is not reported again.
        assert executor.collective_rpc(mp_helpers.echo, ("again",)) == ["again"] * 2

        start = time.monotonic()
        with pytest.raises(CommTimeoutError, match=r"ranks \[0\] did not answer"):
            executor.collective_rpc(mp_helpers.sleep_on_rank, (0, 60.0), timeout=1.5)
        assert time.monotonic() - start < 1.5 + 1.0
        with pytest.raises(CommTimeoutError):
            executor.check_health()  # a stuck worker leaves the executor unusable
        pids = [p.pid for p in executor._processes]
    finally:
        executor.shutdown()
        executor.shutdown()  # idempotent
    assert _alive(pids) == []
    assert _segments() == before
    with pytest.raises(PeerLostError, match="shut down"):
        executor.collective_rpc("load_model")


def test_sigkill_is_noticed_within_a_second(tiny_llama_dir):
    before = _segments()
    executor = _executor(tiny_llama_dir, tp=2)
    try:
        pids = [pid for _, pid in executor.collective_rpc(mp_helpers.rank_and_pid)]
        pending = executor.collective_rpc(mp_helpers.sleep_on_rank, (1, 30.0), non_block=True)
        time.sleep(0.2)
        os.kill(pids[1], signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(PeerLostError, match=r"rank 1 \(pid \d+\) died with exit code -9"):
            pending.result(timeout=10)
        assert time.monotonic() - start < 1.0
        with pytest.raises(PeerLostError, match="rank 1"):
            executor.collective_rpc(mp_helpers.echo, (1,))
    finally:
        executor.shutdown()
    assert _alive(pids) == []
    assert _segments() == before


def test_start_up_failure_names_phase_and_rank(tmp_path):
    before = _segments()
    with pytest.raises(WorkerError) as raised:
        _executor(tmp_path / "missing-model", tp=2)
    assert "start-up phase 'model load'" in str(raised.value)
    assert "not an HF model directory" in str(raised.value)
    assert _segments() == before


def _start_driver(tiny_llama_dir):
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


def _wait_gone(pids, seconds):
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _alive(pids)


def test_idle_workers_use_little_cpu_and_exit_when_the_driver_is_killed(tiny_llama_dir):
    before = _segments()
    driver, info = _start_driver(tiny_llama_dir)
    try:
        workers = info["workers"]
        time.sleep(0.5)
        start = {pid: _cpu_seconds(pid) for pid in [driver.pid, *workers]}
        time.sleep(3.0)
        used = sum(_cpu_seconds(pid) - start[pid] for pid in start)
        assert used / 3.0 < 0.05, f"idle engine used {used / 3.0:.1%} of a core"
        driver.kill()
        driver.wait(10)
        assert _wait_gone(workers, 5.0) == []
        assert _segments() == before
    finally:
        if driver.poll() is None:
            driver.kill()


def test_ctrl_c_on_the_driver_shuts_everything_down(tiny_llama_dir):
    before = _segments()
    driver, info = _start_driver(tiny_llama_dir)
    try:
        driver.send_signal(signal.SIGINT)
        out, _ = driver.communicate(timeout=30)
        assert "shut down" in out
        assert _wait_gone(info["workers"], 5.0) == []
        assert _segments() == before
    finally:
        if driver.poll() is None:
            driver.kill()
