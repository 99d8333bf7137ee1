"""Soak: many engine steps under ``mp`` (TP=2 by default) with requests joining and leaving all
the time; reports resident memory of every process, open file descriptors and shared-memory
segments after warm-up and at the end. Growth beyond warm-up must be nil.

    python benchmarks/soak.py --model smollm2-135m --steps 10000 [--tp 2] [--json soak.json]

Exit code 1 when file descriptors or /dev/shm entries grew at all, or a process's resident
memory grew by more than ``--rss-slack-mib`` (allocator noise).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from shardline.engine import LLM, SamplingParams


def process_figures(_worker=None) -> dict:
    """This process's pid, resident memory (MiB) and open file descriptors."""
    with open("/proc/self/status", encoding="ascii") as status:
        rss_kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return {"pid": os.getpid(), "rss_mib": rss_kib / 1024, "fds": len(os.listdir("/proc/self/fd"))}


def snapshot(llm: LLM) -> dict:
    """Driver and worker figures, and the job's /dev/shm segments (other jobs' are not
    looked at: the host is shared)."""
    executor = llm.engine.executor
    workers = executor.collective_rpc(process_figures)
    segments = Path("/dev/shm").glob(f"shardline-{executor.job}-*")
    return {
        "driver": process_figures(),
        "workers": workers,
        "dev_shm": sorted(path.name for path in segments),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="catalog name, GGUF or HF dir")
    parser.add_argument("--steps", type=int, default=10_000, help="engine steps (10000)")
    parser.add_argument("--warmup", type=int, default=200, help="steps before the baseline")
    parser.add_argument("--tp", type=int, default=2, help="tensor-parallel size (2)")
    parser.add_argument("--concurrent", type=int, default=8, help="requests kept in flight")
    parser.add_argument("--rss-slack-mib", type=float, default=4.0)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    overrides = [
        f"model.path={args.model}",
        f"parallel.tensor_parallel_size={args.tp}",
        "parallel.distributed_executor_backend=mp",
    ]
    generator = random.Random(0)
    with LLM(overrides=overrides) as llm:
        engine = llm.engine

        def top_up() -> None:
            while len(engine.scheduler.requests) < args.concurrent:
                # Token ids below 100 exist in any vocabulary worth soaking.
                prompt = [generator.randrange(1, 100) for _ in range(generator.randint(4, 40))]
                engine.add_request(
                    prompt, SamplingParams(max_tokens=generator.randint(1, 48), ignore_eos=True)
                )

        baseline, started, finished = None, time.perf_counter(), 0
        for step in range(args.steps):
            if step == args.warmup:
                baseline, started = snapshot(llm), time.perf_counter()
            top_up()
            finished += sum(output.finished for output, _ in engine.step())
            if (step + 1) % 1000 == 0:
                print(f"step {step + 1}/{args.steps}", file=sys.stderr, flush=True)
        end = snapshot(llm)
        elapsed = time.perf_counter() - started

    report = _compare(baseline, end, args.rss_slack_mib)
    report |= {
        "steps": args.steps,
        "warmup": args.warmup,
        "requests_finished": finished,
        "seconds_after_warmup": elapsed,
        "preemptions": engine.scheduler.num_preemptions,
    }
    print(_table(report))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(report, handle, indent=2)
    return 0 if report["ok"] else 1


def _compare(start: dict, end: dict, slack_mib: float) -> dict:
    rows = []
    pairs = [("driver", start["driver"], end["driver"])]
    pairs += [
        (f"worker {rank}", s, e)
        for rank, (s, e) in enumerate(zip(start["workers"], end["workers"], strict=True))
    ]
    ok = start["dev_shm"] == end["dev_shm"]
    for name, before, after in pairs:
        rss_growth = after["rss_mib"] - before["rss_mib"]
        fd_growth = after["fds"] - before["fds"]
        ok &= fd_growth == 0 and rss_growth <= slack_mib
        rows.append(
            {
                "process": name,
                "pid": after["pid"],
                "rss_start_mib": before["rss_mib"],
                "rss_end_mib": after["rss_mib"],
                "fds_start": before["fds"],
                "fds_end": after["fds"],
            }
        )
    return {
        "processes": rows,
        "dev_shm_start": start["dev_shm"],
        "dev_shm_end": end["dev_shm"],
        "ok": ok,
    }


def _table(report: dict) -> str:
    lines = [
        f"{report['steps']} steps ({report['warmup']} warm-up), "
        f"{report['requests_finished']} requests finished, {report['preemptions']} preemptions, "
        f"{report['seconds_after_warmup']:.0f} s after warm-up",
        f"{'process':<10} {'pid':>7} {'RSS start':>10} {'RSS end':>10} {'growth':>8} {'fds':>9}",
    ]
    for row in report["processes"]:
        growth = row["rss_end_mib"] - row["rss_start_mib"]
        lines.append(
            f"{row['process']:<10} {row['pid']:>7} {row['rss_start_mib']:>9.1f}M "
            f"{row['rss_end_mib']:>9.1f}M {growth:>+7.1f}M "
            f"{row['fds_start']:>4}->{row['fds_end']:<4}"
        )
    lines.append(
        f"/dev/shm entries: {len(report['dev_shm_start'])} -> {len(report['dev_shm_end'])}"
        f"{'' if report['dev_shm_start'] == report['dev_shm_end'] else ' (CHANGED)'}"
    )
    lines.append("no growth beyond warm-up" if report["ok"] else "GROWTH beyond warm-up")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
