"""The mp executor: transformers' greedy tokens under TP=2, PP=2 and TP=2 x PP=2 (4 workers
on 2 cores); a SIGKILL mid-generation, a bad start-up, an idle engine, a killed or interrupted
driver, each with nothing left behind. The executor contract itself (replies, order,
exceptions, deadlines, deaths, shutdown) is checked by the executor conformance suite."""

import os
import signal
import subprocess
import time

import pytest

from shardline.config import load_config
from shardline.conformance.executors import probe
from shardline.conformance.executors.checks import alive
from shardline.errors import PeerLostError, WorkerError
from shardline.registry import Registry
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


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)], ids=["tp2", "pp2", "tp2xpp2"])
def test_mp_generates_transformers_tokens(tiny_llama_dir, tiny_llama_greedy, tp, pp):
    before = _segments()
    executor = _executor(tiny_llama_dir, tp, pp)
    try:

        def execute(step):
            result = executor.execute_model(step)
            return result.result(timeout=60) if pp > 1 else result

        assert run_script(execute, GREEDY_TOKENS) == tiny_llama_greedy
        assert executor.output_rank == tp * pp - tp
        pids = [pid for _, pid in executor.collective_rpc(probe.rank_and_pid)]
    finally:
        executor.shutdown()
    assert alive(pids) == []
    assert _segments() == before


def test_sigkill_mid_generation_fails_the_step_within_a_second(tiny_llama_dir):
    before = _segments()
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
    while alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive(pids)


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
        try:
            out, err = driver.communicate(timeout=30)
        except subprocess.TimeoutExpired as timeout:
            driver.kill()
            raise AssertionError(
                f"the driver did not exit within 30 s of Ctrl-C; workers alive: "
                f"{alive(info['workers'])}; output: {timeout.output!r}; errors: {timeout.stderr!r}"
            ) from None
        assert "shut down" in out, err
        assert _wait_gone(info["workers"], 5.0) == []
        assert _segments() == before
    finally:
        if driver.poll() is None:
            driver.kill()
