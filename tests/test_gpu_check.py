"""``benchmarks/gpu_check.py --device cpu``: the whole check end to end on the CPU (gloo, the
NCCL rows skipped with the reason), on the tiny random Llama with a chat tokenizer: one
table, the JSON report, exit code 0 with float32 tokens equal to transformers'."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.tiny_llama import write_tiny_llama
from support.tiny_tokenizer import add_tiny_tokenizer

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.mark.timeout(300)
def test_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    model = add_tiny_tokenizer(write_tiny_llama(tmp_path / "model", max_position_embeddings=1024))
    out = tmp_path / "out"
    options = ["--device", "cpu", "--model", str(model), "--tokens", "8", "--concurrent", "2"]
    options += ["--dtypes", "float32"]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out), *options],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads((out / "gpu_check.json").read_text())
    rows = {row["check"]: row for row in report["rows"]}
    assert rows["nccl suite"]["status"] == "skipped"
    assert "nccl unavailable" in rows["nccl suite"]["detail"]
    assert rows["tokens float32 tp1"]["status"] == "passed"
    assert rows["tokens float32 tp1"]["detail"] == "3/3 equal"
    for kind in ("batch-1", "2 concurrent"):
        speed = rows[f"decode float32 tp1 {kind} tok/s"]
        assert speed["status"] == "ok"
        assert float(speed["shardline"]) > 0 and float(speed["transformers"]) > 0
    assert rows["peak device memory float32 tp1"]["shardline"] == "-"
    assert set(report["parts"]) == {
        "nccl suite",
        "shardline float32 tp1",
        "transformers float32",
    }
    assert report["passed"] is True
    assert report["environment"]["device"] == "cpu"
    for check in rows:
        assert check in done.stdout
