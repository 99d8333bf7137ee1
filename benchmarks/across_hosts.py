"""What crossing a host costs, and whether the tokens stay right, on two simulated hosts
(``shardline.launch.hosts``: own network namespace on a private bridge, own hostname and
``/dev/shm``; needs root). In one run:

- **tokens**: SmolLM2-135M greedy tokens against HF transformers' for TP=2 inside each host x
  PP=2 across the hosts (2 ranks per host) under torchrun (custom_ar) and mpiexec (mpi and
  custom_ar_mpi), and for TP=2 across the two hosts (gloo, torchrun);
- **comm**: all-reduce and p2p latency of a TP=2 group inside one host against the same group
  across two hosts: gloo and custom_ar under torchrun, mpi under mpiexec (OpenMPI's TCP
  transport between hosts, shared memory inside one). Times run from the last rank's start
  to the last rank's end on the machine's clock, which simulated hosts share;
- **decode**: ``shardline bench decode``'s tokens/s (batch 1 and concurrent) for tp2 inside a
  host against tp2 across two hosts, under torchrun.

Each simulated host runs on its own CPUs; the host of the "inside" cases has the CPUs of both
hosts of the "across" cases, so a TP=2 pair has the same cores either way.

    python benchmarks/across_hosts.py [--model smollm2-135m] [--tokens 24]
        [--parts tokens,comm,decode] [--json FILE]

The same file is the rank program of each world (``rank-tokens`` / ``rank-comm``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from shardline.cli.bench_decode import RESULT_MARK as BENCH_MARK
from shardline.cli.table import render
from shardline.launch import hosts as simulated
from shardline.launch.launchers import launcher_environment

MARK = "ACROSS-HOSTS-RESULT "
QUESTION = "Write a short story about a lighthouse keeper and a storm."
MASTER_PORT = 29500
COMM_CASES = (("all_reduce", 4), ("all_reduce", 64 << 10), ("all_reduce", 1 << 20), ("p2p", 4))
HERE = Path(__file__).resolve()
INSIDE = "inside a host"


def places(one, two):
    """(where, hosts, how many of them, ranks per host): both ranks inside ``one``'s host,
    or one rank on each of ``two``'s."""
    return ((INSIDE, one, 1, 2), ("across 2 hosts", two, 2, 1))


# ---- launching worlds on the hosts ---------------------------------------------------------


def torchrun(made: simulated.SimulatedHosts, hosts: int, per_host: int, program: list[str]):
    """``program`` (a script and its arguments) on ``per_host`` ranks on each of the first
    ``hosts`` hosts, one torchrun agent per host (static rendezvous on h1); the outputs."""
    commands = []
    for node in range(hosts):
        options = [f"--nnodes={hosts}", f"--nproc-per-node={per_host}", f"--node-rank={node}"]
        options += [f"--master-addr={made.hosts[0].address}", f"--master-port={MASTER_PORT}"]
        options.append(f"--local-addr={made.hosts[node].address}")
        commands.append(
            made.hosts[node].command([sys.executable, "-m", "torch.distributed.run", *options])
            + program
        )
    return _run_all(commands)


def mpiexec(made: simulated.SimulatedHosts, hosts: int, per_host: int, program: list[str]):
    """``program`` on ``per_host`` ranks on each of the first ``hosts`` hosts, started by
    OpenMPI's mpiexec on h1 (the hosts' agent instead of ssh)."""
    placement = ",".join(f"{host.name}:{per_host}" for host in made.hosts[:hosts])
    command = [
        str(Path(sys.executable).with_name("mpiexec")),
        "--host", placement, "-n", str(hosts * per_host),
        *made.mpiexec_options(), sys.executable, *program,
    ]  # fmt: skip
    return _run_all([made.hosts[0].command(command)])


def _run_all(commands: list[list[str]], timeout_s: float = 600) -> list[dict]:
    """Run the commands at once; every result line (``MARK`` + JSON) any of them printed, or
    one ``{"error": ...}``."""
    started = [
        subprocess.Popen(
            command,
            env=launcher_environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        for command in commands
    ]
    results, errors = [], []
    for process in started:
        try:
            out, err = process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            out, err = process.communicate()
            errors.append(f"did not end within {timeout_s:g} s")
        results += [json.loads(line[len(MARK) :]) for line in out.splitlines() if MARK in line]
        results += [
            json.loads(line.split(BENCH_MARK, 1)[1])
            for line in out.splitlines()
            if BENCH_MARK in line
        ]
        if process.returncode:
            errors.append(f"exit code {process.returncode}: {err.strip()[-600:]}")
    return results or [{"error": "; ".join(errors) or "no result"}]


# ---- the parts -----------------------------------------------------------------------------


def tokens_part(made: simulated.SimulatedHosts, model: str, tokens: int) -> list[dict]:
    expected = transformers_tokens(model, tokens)
    program = [str(HERE), "rank-tokens", model, str(tokens)]
    tp2_pp2 = ["parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2"]
    cases = [
        ("tp2 in each host x pp2 across", "torchrun", "custom_ar", 2, 2, tp2_pp2),
        ("tp2 in each host x pp2 across", "mpiexec", "mpi", 2, 2, tp2_pp2),
        ("tp2 in each host x pp2 across", "mpiexec", "custom_ar_mpi", 2, 2, tp2_pp2),
        ("tp2 across 2 hosts", "torchrun", "gloo", 2, 1, ["parallel.tensor_parallel_size=2"]),
    ]
    rows = []
    for layout, launcher, communicator, hosts, per_host, overrides in cases:
        start = torchrun if launcher == "torchrun" else mpiexec
        began = time.monotonic()
        (result,) = start(
            made, hosts, per_host, [*program, f"parallel.communicator={communicator}", *overrides]
        )[:1]
        row = {"layout": layout, "launcher": launcher, "communicator": communicator}
        row["seconds"] = round(time.monotonic() - began, 1)
        if "error" in result:
            row |= {"equal": False, "error": result["error"]}
        else:
            row |= {"equal": result["tokens"] == expected, "executor": result["executor"]}
            row["first_difference"] = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(result["tokens"], expected, strict=False))
                    if a != b
                ),
                None,
            )
        rows.append(row)
    return rows


def comm_part(one: simulated.SimulatedHosts, two: simulated.SimulatedHosts) -> list[dict]:
    rows = []
    for launcher, communicator in (
        ("torchrun", "gloo"),
        ("torchrun", "custom_ar"),
        ("mpiexec", "mpi"),
    ):
        start = torchrun if launcher == "torchrun" else mpiexec
        program = [str(HERE), "rank-comm", communicator]
        for where, made, hosts, per_host in places(one, two):
            (result,) = start(made, hosts, per_host, program)[:1]
            base = {"communicator": communicator, "launcher": launcher, "where": where}
            if "error" in result:
                rows.append(base | {"error": result["error"]})
                continue
            rows += [base | case for case in result["cases"]]
    return rows


def decode_part(
    one: simulated.SimulatedHosts, two: simulated.SimulatedHosts, model: str, tokens: int
) -> list[dict]:
    from shardline.cli.bench_decode import Case

    rows = []
    for communicator in ("gloo", "custom_ar"):
        case = Case("shardline", model, tokens, 8, "tp2", communicator, launcher="torchrun")
        program = ["-m", "shardline.cli.bench_decode", json.dumps(asdict(case))]
        for where, made, hosts, per_host in places(one, two):
            command = ["--no-python", sys.executable, *program]
            (result,) = torchrun(made, hosts, per_host, command)[:1]
            rows.append({"communicator": communicator, "where": where} | result)
    return rows


def transformers_tokens(model: str, tokens: int) -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    from shardline.catalog import resolve_model_path
    from shardline.weights import load_tokenizer, open_checkpoint

    path = Path(resolve_model_path(model))
    tokenizer = load_tokenizer(open_checkpoint(str(path)))
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    )
    if path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    else:
        hf = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        )
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


# ---- rank programs -------------------------------------------------------------------------


def rank_tokens(model: str, tokens: int, overrides: list[str]) -> None:
    from shardline.catalog import resolve_model_path
    from shardline.engine import LLM, SamplingParams

    path = resolve_model_path(model, pull_missing=False)
    with LLM(overrides=[f"model.path={path}", *overrides]) as llm:
        (output,) = llm.chat(
            [{"role": "user", "content": QUESTION}],
            SamplingParams(max_tokens=tokens, ignore_eos=True),
        )
        if llm.reports_results:
            executor = llm.engine.config.parallel.distributed_executor_backend
            print(MARK + json.dumps({"tokens": output.token_ids, "executor": executor}), flush=True)


def _samples_on_tp(worker, operation: str, nbytes: int) -> list | None:
    from shardline.cli.bench_cmd import measure_on

    return measure_on(worker.state.tp.data, operation, nbytes, "float32", 10, 50)


def rank_comm(communicator: str) -> None:
    from shardline.cli.bench_cmd import collective_times
    from shardline.config import load_config
    from shardline.registry import Registry

    config = load_config(
        overrides=[
            "model.runner=shardline.conformance.faults.runner:FaultModelRunner",
            "parallel.tensor_parallel_size=2",
            "parallel.distributed_executor_backend=external_launcher",
            f"parallel.communicator={communicator}",
            "parallel.watchdog=false",
            "parallel.timeout_s=60",
        ],
        environ={},
    ).config
    executor = Registry.load().get("executor", "external_launcher").load_available()(config)
    try:
        cases = []
        for operation, nbytes in COMM_CASES:
            per_rank = executor.collective_rpc(_samples_on_tp, (operation, nbytes))
            times = collective_times([s for s in per_rank if s is not None], operation)
            cases.append(
                {
                    "operation": operation,
                    "bytes": nbytes,
                    "median_us": statistics.median(times) * 1e6,
                }
            )
        if executor.reports_results:
            print(MARK + json.dumps({"cases": cases}), flush=True)
    finally:
        executor.shutdown()


# ---- output --------------------------------------------------------------------------------


def print_tables(report: dict) -> None:
    if "tokens" in report:
        rows = [
            (r["layout"], r["launcher"], r["communicator"], r.get("executor", "-"),
             "yes" if r["equal"] else f"NO ({r.get('error') or r['first_difference']})",
             f"{r['seconds']:g}")
            for r in report["tokens"]
        ]  # fmt: skip
        headers = ("LAYOUT", "LAUNCHER", "COMMUNICATOR", "EXECUTOR", "= TRANSFORMERS", "SECONDS")
        print("greedy tokens against HF transformers\n" + render(headers, rows) + "\n")
    if "comm" in report:
        inside = {
            (r["communicator"], r["operation"], r["bytes"]): r["median_us"]
            for r in report["comm"]
            if r["where"] == INSIDE and "error" not in r
        }
        rows = []
        for r in report["comm"]:
            if "error" in r:
                rows.append((r["communicator"], r["where"], "-", "-", r["error"][:80], "-"))
                continue
            key = (r["communicator"], r["operation"], r["bytes"])
            ratio = r["median_us"] / inside[key] if key in inside else None
            rows.append(
                (r["communicator"], r["where"], r["operation"], r["bytes"],
                 f"{r['median_us']:.0f}", f"{ratio:.2f}x" if ratio else "-")
            )  # fmt: skip
        headers = ("COMMUNICATOR", "WHERE", "OP", "BYTES", "MEDIAN US", "/ INSIDE")
        print("TP=2 group latency, inside one host and across two\n" + render(headers, rows) + "\n")
    if "decode" in report:
        rows = [
            (r["communicator"], r["where"],
             f"{r['batch1_tok_s']:.1f}" if "batch1_tok_s" in r else r.get("error", "-")[:80],
             f"{r['concurrent_tok_s']:.1f}" if "concurrent_tok_s" in r else "-")
            for r in report["decode"]
        ]  # fmt: skip
        headers = ("COMMUNICATOR", "TP2", "BATCH 1 TOK/S", "CONCURRENT TOK/S")
        print("decode, tp2 inside a host and across two\n" + render(headers, rows))


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "rank-tokens":
        rank_tokens(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
        return 0
    if len(sys.argv) > 1 and sys.argv[1] == "rank-comm":
        rank_comm(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--parts", default="tokens,comm,decode")
    parser.add_argument("--json")
    args = parser.parse_args()
    reason = simulated.unavailable_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    from shardline.catalog import resolve_model_path

    model = resolve_model_path(args.model)
    parts = [part.strip() for part in args.parts.split(",")]
    report: dict = {}
    # Two hosts with a CPU each, and one host with both: a TP=2 pair has the same cores
    # inside one host as across two.
    with simulated.SimulatedHosts.up(2) as two, simulated.SimulatedHosts.up(1) as one:
        if "tokens" in parts:
            report["tokens"] = tokens_part(two, model, args.tokens)
        if "comm" in parts:
            report["comm"] = comm_part(one, two)
        if "decode" in parts:
            report["decode"] = decode_part(one, two, model, max(args.tokens, 16))
    print_tables(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
