"""The device is data: a rank computes on the device its runner names (``parallel.device``,
``cuda:{local_rank}`` on a GPU host), never on whatever torch's default device happens to be.
Checked on this CPU host by making ``meta`` the process's default device: a tensor made
without naming its device (a mask, an index, a generator, the KV cache) would land there and
the step would fail. The same run on a GPU: ``benchmarks/gpu_check.py``."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

DRIVER = Path(__file__).parent / "support" / "default_device_driver.py"

pytestmark = pytest.mark.timeout(300)


def _run(model_dir, *options):
    result = subprocess.run(
        [sys.executable, str(DRIVER), str(model_dir), *options],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_rank_uses_its_own_device_whatever_the_default_device(tiny_llama_dir):
    plain = _run(tiny_llama_dir)
    under_meta = _run(tiny_llama_dir, "--default-device", "meta")
    assert under_meta == plain
    assert len(plain["greedy"]) == 3 and all(len(t) == 12 for t in plain["greedy"])
    # Pooled vectors come back to the host whatever the rank's device.
    assert plain["embedding_device"] == "cpu"
