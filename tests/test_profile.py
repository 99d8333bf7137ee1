"""Where a step's time goes: the span timer's accounting, and ``shardline bench decode
--profile`` end to end on the tiny Llama (TP=1 under uni, TP=2 under mp over gloo): the floor
from the bytes each rank really reads, and every part of a decode step per rank and in the
driver."""

import json
import os
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from shardline.cli.bench_decode import QUESTION, failure_line, tokens_against
from shardline.config import load_config
from shardline.launch.comm_world import ParallelSetup
from shardline.launch.local_world import LocalWorld
from shardline.layers.kernels import screens_greedy_head
from shardline.profiling import SpanTimer
from shardline.worker.worker import Worker
from support.cli import shardline
from support.tiny_llama import write_tiny_llama
from support.tiny_tokenizer import add_tiny_tokenizer

STEP_PARTS = (
    "matmul (weights)",
    "attention",
    "other per-layer ops",
    "comm all_reduce",
    "prepare inputs",
    "sampling",
)


def test_parts_are_exclusive_and_add_up_to_the_outermost_span():
    timer = SpanTimer()
    # The outermost span lies between two clocks read inside it and two read outside it (a
    # fixed tolerance failed on a loaded host: the process lost the core between a clock and
    # the span's edge).
    outside_began = time.perf_counter()
    inner_walls = 0.0  # each inner span measured from outside it: an upper bound
    with timer("step"):
        inside_began = time.perf_counter()
        time.sleep(0.01)
        for _ in range(3):
            inner_began = time.perf_counter()
            with timer("inner"):
                time.sleep(0.005)
                with timer("innermost"):
                    time.sleep(0.002)
            inner_walls += time.perf_counter() - inner_began
        inside = time.perf_counter() - inside_began
    outside = time.perf_counter() - outside_began
    report = timer.report()
    assert {part: v["entries"] for part, v in report.items()} == {
        "step": 1,
        "inner": 3,
        "innermost": 3,
    }
    assert report["innermost"]["seconds"] >= 3 * 0.002
    assert report["inner"]["seconds"] >= 3 * 0.005
    # Its nested part is not in it (bounds from clocks read around it, not from the sleeps
    # asked for: a loaded host oversleeps).
    assert report["inner"]["seconds"] + report["innermost"]["seconds"] <= inner_walls
    assert inside <= sum(v["seconds"] for v in report.values()) <= outside


@pytest.mark.timeout(240)
def test_bench_decode_profile_shows_each_part_of_a_step_against_the_floor(tmp_path):
    model = add_tiny_tokenizer(write_tiny_llama(tmp_path / "model", max_position_embeddings=256))
    out = tmp_path / "decode.json"
    done = subprocess.run(
        [sys.executable, "-m", "shardline.cli.main", "bench", "decode", "--model", str(model),
         "--layouts", "tp1,tp2", "--communicators", "gloo", "--hf-threads", "1",
         "--tokens", "8", "--concurrent", "2", "--profile", "--json", str(out)],
        capture_output=True, text=True, timeout=220,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(out.read_text())["rows"]
    rows = {row["layout"]: row for row in report if row["engine"] == "shardline"}
    (transformers,) = [row for row in report if row["engine"] == "transformers"]
    assert "floor_s" not in transformers and "step_profile" not in transformers

    # The floor: every weight read once per step - all tensors but the (untied) embedding
    # table, the LM head padded from 100 to 128 vocabulary rows - at the measured bandwidth;
    # where the C kernels screen the head, its screen's bytes instead of its own.
    tensors = load_file(model / "model.safetensors")
    read = sum(t.numel() * t.element_size() for n, t in tensors.items() if "embed" not in n)
    padding = (128 - 100) * 64 * torch.float32.itemsize
    expected = read + padding
    if screens_greedy_head("cpu", os.environ):  # Q8_0 codes and two bounds an output
        expected += 128 * 64 // 32 * 34 + 8 * 128 - 128 * 64 * torch.float32.itemsize
    assert rows["tp1"]["weight_bytes"] == [expected]
    assert sum(rows["tp2"]["weight_bytes"]) > expected  # sharded, norms on both ranks
    # Measured before each batch-1 request: "of floor" is the median of their own ratios.
    for row in rows.values():
        assert all(b > 1e8 for b in row["bandwidth"])  # bytes per second (medians per rank)
        runs = list(zip(row["batch1_runs_tok_s"], row["batch1_runs_floor_s"], strict=True))
        assert len(runs) == 3
        assert row["floor_s"] == pytest.approx(statistics.median(f for _, f in runs))
        assert row["of_floor"] == pytest.approx(statistics.median(t * f for t, f in runs))
        read_s = zip(row["weight_bytes"], row["bandwidth"], strict=True)
        slowest_read = max(w / b for w, b in read_s)
        assert min(f for _, f in runs) <= slowest_read * 1.0001
        assert slowest_read <= max(f for _, f in runs) * 1.0001

    profile = rows["tp2"]["step_profile"]
    assert set(profile) == {"batch 1", "2 concurrent"}
    for mode, run in profile.items():
        processes = run["processes"]
        assert set(processes) == {"driver", "rank 0", "rank 1"}
        assert run["output_rank"] == "rank 0"
        assert run["steps_in_flight"] == 1
        for rank in ("rank 0", "rank 1"):
            parts = processes[rank]
            for part in STEP_PARTS:
                assert parts[part]["seconds"] > 0, (mode, rank, part)
            # Decode steps only: each request already had its first token; 8 tokens each.
            assert parts["rank step, rest"]["entries"] == 7
            # Two all-reduces per layer (attention, MLP), one for the embedding and two for
            # greedy sampling (the best logit, then its token id): no logits gathered.
            assert parts["comm all_reduce"]["entries"] == 7 * (2 * 4 + 1 + 2)
            assert "comm all_gather" not in parts
        driver = processes["driver"]
        assert driver["driver step, rest"]["entries"] == 7
        for part in ("schedule", "send step", "wait for ranks", "detokenize"):
            assert driver[part]["seconds"] > 0, (mode, part)
        assert f"where a decode step goes: shardline tp2 gloo, {mode}" in done.stdout
    mebibytes = [f"rank {r} {b / 2**20:.1f}" for r, b in enumerate(rows["tp2"]["weight_bytes"])]
    assert f"weights each rank reads a step (MiB): {', '.join(mebibytes)}" in done.stdout
    assert "step_profile" in rows["tp1"]
    assert "of floor" in done.stdout.splitlines()[0]

    # Every case's greedy tokens against transformers' (one request at a time): the batch-1
    # prompt's and each concurrent one's, float32 equal in every layout.
    assert transformers["reference"] and len(transformers["token_ids"]) == 1 + 2
    assert all(0 < len(ids) <= 8 for ids in transformers["token_ids"])
    for row in rows.values():
        assert [ids[: len(expected)] for ids, expected in
                zip(row["token_ids"], transformers["token_ids"], strict=True)
                ] == transformers["token_ids"]  # fmt: skip
    header, _, *lines = done.stdout.splitlines()
    assert header.split()[-3:] == ["tokens", "=", "HF"]
    cells = [line.split()[-1] for line in lines[:3]]
    assert cells == ["3/3", "3/3", "reference"]
    assert "tokens = HF: of 3 prompts" in done.stdout


def test_tokens_against_gives_where_each_prompt_first_differs():
    reference = [[5, 6, 7], [5, 6, 2], [1, 2, 3], [9]]
    # Equal; equal up to transformers' end of sequence (2) and on past it; differing at 1;
    # stopped short of the reference.
    found = [[5, 6, 7], [5, 6, 2, 8, 8], [1, 4, 3], []]
    assert tokens_against(reference, found) == [None, None, 1, 0]


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--tokens", "1"], "--tokens = 1: allowed: 2..128 (half the 256-token context"),
        (["--tokens", "129"], "--tokens = 129: allowed: 2..128"),
        (["--concurrent", "33"], "--concurrent = 33: allowed: 2..32 (scheduler.max_num_seqs"),
        (["--concurrent", "1"], "--concurrent = 1: allowed: 2..32"),
        (["--timeout", "nan"], "--timeout = nan: allowed: more than 0, up to 86400 s"),
        (["--timeout", "0"], "--timeout = 0: allowed: more than 0"),
        (
            ["--prompt-tokens", "250"],
            "--prompt-tokens = 250: allowed: 1..192 (the model's 256-token context less --tokens",
        ),
        (["--prompt-tokens", "-1"], "--prompt-tokens = -1: allowed: 1..192"),
        (
            ["--weight-dtype", "float16"],
            "--weight-dtype: 'float16' with --dtype float32: allowed: float32, bfloat16",
        ),
        (
            ["--prompt-tokens", "10", "--tokens", "256"],
            "--tokens = 256: allowed: 2..255 (the model's 256-token context)",
        ),
    ],
)
def test_bench_decode_refuses_sizes_it_cannot_measure_before_starting(tmp_path, flags, expected):
    # The context comes from the model: 256 positions here, so at most 128 new tokens.
    model = add_tiny_tokenizer(write_tiny_llama(tmp_path / "model", max_position_embeddings=256))
    done = shardline("bench", "decode", "--model", str(model), "--hf-threads", "1", *flags)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith(f"error: {expected}"), done.stderr
    assert done.stdout == ""  # no case started


def test_bench_decode_states_the_transformers_target_in_the_floors_terms():
    """With transformers at 30 tok/s and a TP=2 floor of 20 ms a token, 2.5x transformers (75
    tok/s) is 1.5 of the floor: the summary says so beside the ratios."""
    from shardline.cli.bench_decode import _targets

    rows = [
        {"engine": "transformers", "threads": 2, "batch1_tok_s": 30.0},
        {
            "engine": "shardline", "layout": "tp2", "communicator": "custom_ar",
            "batch1_tok_s": 45.0, "floor_s": 0.02, "of_floor": 0.9, "concurrent": 16,
            "concurrent_tok_s": 390.0,
        },
    ]  # fmt: skip
    assert _targets(rows) == [
        "tp2 custom_ar / transformers 2 threads, batch 1: 1.50 (target >= 2.5)",
        "tp2 custom_ar batch 1, of its floor: 0.90 (target >= 0.7)",
        "2.5x transformers 2 threads, batch 1, is 1.50 of tp2 custom_ar's floor",
        "tp2 custom_ar 16 concurrent / transformers 2 threads batch 1: 13.00 (target >= 12)",
    ]
    rows[1]["concurrent"] = 4  # the target is for 16: not stated beside 4
    four = "tp2 custom_ar 4 concurrent / transformers 2 threads batch 1: 13.00"
    assert _targets(rows)[-1] == four


class _ReadsThePreviousStage:
    """A last stage's runner that only reads the tensors the previous stage sent."""

    def execute_model(self, scheduler_output, intermediate):
        return sorted(intermediate.tensors)


def _profile_a_step_behind_a_slow_first_stage(ctx) -> dict:
    if ctx.state.pp.is_first_rank:
        time.sleep(0.5)
        ctx.state.pp.send_tensor_dict({"hidden_states": torch.ones(2, 8)})
        return {}
    worker = Worker(ctx.state, _ReadsThePreviousStage())
    worker.start_profile()
    output = worker.execute_model(SimpleNamespace(total_num_scheduled_tokens=2))
    return {"output": output, "profile": worker.stop_profile()}


@pytest.mark.timeout(120)
def test_a_later_stage_waiting_for_the_previous_one_is_profiled_as_that_wait():
    """The first stage sends 0.5 s late: the last stage's profile puts that time under "comm
    wait for the previous stage" (its metadata's receive included), not in the step's rest."""
    config = load_config(overrides=["parallel.pipeline_parallel_size=2"], environ={}).config
    with LocalWorld(2, ParallelSetup(config), call_timeout_s=60) as world:
        _, last = world.run(_profile_a_step_behind_a_slow_first_stage)
    assert last["output"] == ["hidden_states"]
    parts = last["profile"]
    assert parts["comm wait for the previous stage"]["seconds"] > 0.4, parts
    assert parts["rank step, rest"]["seconds"] < 0.1, parts


def test_the_executor_round_trip_is_given_only_when_steps_do_not_overlap():
    """One step in flight: the driver's send and wait beyond the output rank's step (0.5 +
    4.0 - 3.0 = 1.5 ms). Two in flight (PP=2): the output stage's 6 ms step overlaps the other
    stage's and the driver's, so no difference is printed (0.5 + 4.0 - 6.0 came out negative)."""
    from shardline.cli.bench_decode import profile_table

    row = {"engine": "shardline", "layout": "pp2", "communicator": "gloo", "executor": "mp",
           "floor_s": 0.01, "weight_bytes": [2**20], "bandwidth": [1e9]}  # fmt: skip

    def step(seconds: dict) -> dict:
        return {part: {"seconds": s * 10, "entries": 10} for part, s in seconds.items()}

    def round_trip(output_step_s: float, in_flight: int) -> str:
        processes = {
            "driver": step({"send step": 5e-4, "wait for ranks": 4e-3, "driver step, rest": 1e-4}),
            "rank 0": step({"matmul (weights)": 2e-3, "rank step, rest": 1e-3}),
            "rank 1": step({"matmul (weights)": output_step_s - 1e-3, "rank step, rest": 1e-3}),
        }
        profile = {"processes": processes, "output_rank": "rank 1", "steps_in_flight": in_flight}
        (line,) = [
            line for line in profile_table(row, "batch 1", profile).splitlines()
            if line.startswith("executor round trip")
        ]  # fmt: skip
        return line.split("  ")[-1].strip()

    assert round_trip(3e-3, in_flight=1) == "1.50 (0.15)"
    assert round_trip(6e-3, in_flight=2) == "- (2 steps in flight)"


@pytest.mark.timeout(240)
def test_bench_decode_over_a_long_prompt_gives_both_engines_the_same_ids(tmp_path):
    """``--prompt-tokens``: the chat question's ids repeated to that many, the same for both
    engines, every concurrent request's from its own question; the bench's engine holds all
    the concurrent requests at once; no target lines at this length."""
    from shardline.cli.bench_decode import Case, cache_blocks, prompt_ids
    from shardline.weights import load_tokenizer, open_checkpoint

    model = add_tiny_tokenizer(write_tiny_llama(tmp_path / "model", max_position_embeddings=256))
    tokenizer = load_tokenizer(open_checkpoint(str(model)))
    question = prompt_ids(tokenizer, 0)
    assert question == tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    )
    long = prompt_ids(tokenizer, 3 * len(question) + 5)
    assert long == (question * 4)[: 3 * len(question) + 5]
    assert prompt_ids(tokenizer, 200, 1) != prompt_ids(tokenizer, 200, 2)
    assert len(prompt_ids(tokenizer, 200, 1)) == 200
    case = Case("shardline", str(model), tokens=64, concurrent=16, prompt_tokens=5000)
    assert cache_blocks(case) == 16 * 317  # 5064 tokens in blocks of 16, for each request
    assert cache_blocks(Case("shardline", str(model), 8, 2, prompt_tokens=100)) == 512
    assert cache_blocks(Case("shardline", str(model), 8, 2)) is None

    out = tmp_path / "decode.json"
    done = shardline(
        "bench", "decode", "--model", str(model), "--layouts", "tp1", "--hf-threads", "1",
        "--tokens", "4", "--concurrent", "2", "--prompt-tokens", "60", "--json", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(row["engine"], row["prompt_tokens"]) for row in rows] == [
        ("shardline", 60),
        ("transformers", 60),
    ]
    assert all(row["batch1_tok_s"] > 0 for row in rows)
    assert "prompts of 60 tokens (no targets at this length)" in done.stdout
    assert "target" not in done.stdout.replace("no targets", "")


def test_a_failed_case_is_reported_by_its_exception_not_the_launchers_banner():
    stderr = (
        'Traceback (most recent call last):\n  File "x.py", line 1\n'
        "ValueError: rank -1 outside a world of 4\n" + "-" * 74 + "\n"
        "prterun detected that one or more processes exited with non-zero status,\n"
        "   Exit code:    1\n" + "-" * 74 + "\n"
    )
    assert failure_line(stderr) == "ValueError: rank -1 outside a world of 4"
    assert failure_line("starting\nkilled by the deadline\n") == "killed by the deadline"
    assert failure_line("") == "no output"
