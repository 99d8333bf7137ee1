"""Whether the tokens stay right when a world crosses hosts: SmolLM2-135M greedy tokens against
HF transformers' on two simulated hosts (``shardline.launch.hosts``: own network namespace on
a private bridge, own hostname and ``/dev/shm``; needs root), in one run:

- TP=2 inside each host x PP=2 across the hosts (2 ranks per host) under torchrun
  (custom_ar), mpiexec (mpi, custom_ar_mpi) and Ray (custom_ar);
- TP=2 across the two hosts (1 rank per host) under torchrun (gloo) and Ray (gloo).

torchrun and mpiexec start the ranks as ``shardline bench decode --across-hosts`` does
(:func:`shardline.cli.bench_hosts.launch`); the Ray cases run their driver in h1 over the
Ray executor's own cluster on the hosts (``Executor.prepare_hosts``: head in h1, worker node
in h2) with ``parallel.nnodes=2``. What crossing a host costs is measured by
``shardline bench comm|decode --across-hosts 2``.

    python benchmarks/tokens_across_hosts.py [--model smollm2-135m] [--tokens 24] [--json FILE]

The same file is each world's program (``rank MODEL TOKENS OVERRIDES...``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shardline.cli.bench_hosts import Place, launch, marked
from shardline.cli.table import render
from shardline.errors import HostsError
from shardline.launch import hosts as simulated
from shardline.launch.launchers import launcher_environment

MARK = "TOKENS-ACROSS-HOSTS "
HERE = Path(__file__).resolve()
#: How long one world may take, start-up and answer.
CASE_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Case:
    """A world over the two hosts: ``per_host`` ranks on each, started by ``launcher``
    (torchrun, mpiexec, or a driver of the ``ray`` executor), ``communicator`` on both
    planes."""

    layout: str
    launcher: str
    communicator: str
    per_host: int

    @property
    def overrides(self) -> list[str]:
        parallel = ["parallel.tensor_parallel_size=2", f"parallel.communicator={self.communicator}"]
        if self.per_host == 2:
            parallel.append("parallel.pipeline_parallel_size=2")
        if self.launcher == "ray":
            parallel += ["parallel.distributed_executor_backend=ray", "parallel.nnodes=2"]
        return parallel


TP_INSIDE = "tp2 in each host x pp2 across"
TP_ACROSS = "tp2 across 2 hosts"
CASES = (
    Case(TP_INSIDE, "torchrun", "custom_ar", 2),
    Case(TP_INSIDE, "mpiexec", "mpi", 2),
    Case(TP_INSIDE, "mpiexec", "custom_ar_mpi", 2),
    Case(TP_INSIDE, "ray", "custom_ar", 2),
    Case(TP_ACROSS, "torchrun", "gloo", 1),
    Case(TP_ACROSS, "ray", "gloo", 1),
)


def run_cases(hosts: simulated.SimulatedHosts, model: str, tokens: int) -> list[dict]:
    """Every case on ``hosts``, the launched ones first, then the Ray ones on one Ray cluster
    brought up on the hosts for them (and stopped after); one row each."""
    from shardline.registry import Registry

    expected = transformers_tokens(model, tokens)
    rows = [_run(case, hosts, model, tokens, expected) for case in CASES if case.launcher != "ray"]
    ray_cases = [case for case in CASES if case.launcher == "ray"]
    ray = Registry.load().get("executor", "ray")
    try:
        if ray.unavailable_reason() is not None:
            raise HostsError(f"executor ray unavailable: {ray.unavailable_reason()}")
        with ray.load().prepare_hosts(hosts.hosts, launcher_environment()) as environ:
            return rows + [
                _run(case, hosts, model, tokens, expected, environ) for case in ray_cases
            ]
    except HostsError as error:
        return rows + [_row(case) | _failed(error) for case in ray_cases]


def _run(
    case: Case,
    hosts: simulated.SimulatedHosts,
    model: str,
    tokens: int,
    expected: list[int],
    environ: dict[str, str] | None = None,
) -> dict:
    place = Place(case.layout, hosts, 2, case.per_host)
    launcher = "driver" if case.launcher == "ray" else case.launcher
    program = [str(HERE), "rank", model, str(tokens), *case.overrides]
    row = _row(case)
    began = time.monotonic()
    try:
        found = marked(launch(place, launcher, program, CASE_TIMEOUT_S, environ), MARK)
        if not found:
            raise RuntimeError("no rank reported")
        got = found[0]["tokens"]
        row |= {"equal": got == expected, "executor": found[0]["executor"]}
        row["first_difference"] = next(
            (i for i, (a, b) in enumerate(zip(got, expected, strict=False)) if a != b), None
        )
    except RuntimeError as error:
        row |= _failed(error)
    row["seconds"] = round(time.monotonic() - began, 1)
    return row


def _row(case: Case) -> dict:
    return {"layout": case.layout, "launcher": case.launcher, "communicator": case.communicator}


def _failed(error: Exception) -> dict:
    return {"equal": False, "error": str(error)[:300], "seconds": 0.0}


def transformers_tokens(model: str, tokens: int) -> list[int]:
    """HF transformers' greedy continuation (``tokens`` of them) of the question, float32."""
    import torch

    from shardline.cli.bench_decode import QUESTION, load_transformers
    from shardline.weights import load_tokenizer, open_checkpoint

    tokenizer = load_tokenizer(open_checkpoint(model))
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}])
    )
    out = load_transformers(model, torch.float32).generate(
        torch.tensor([prompt]), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
    )
    return out[0, len(prompt) :].tolist()


def rank(model: str, tokens: int, overrides: list[str]) -> None:
    """One process of a world (a launched rank, or a Ray driver): the question's greedy
    answer; the reporting process prints the tokens and the executor."""
    from shardline.cli.bench_decode import QUESTION
    from shardline.engine import LLM, SamplingParams

    with LLM(overrides=[f"model.path={model}", *overrides]) as llm:
        (output,) = llm.chat(
            [{"role": "user", "content": QUESTION}],
            SamplingParams(max_tokens=tokens, ignore_eos=True),
        )
        if llm.reports_results:
            executor = llm.engine.config.parallel.distributed_executor_backend
            print(MARK + json.dumps({"tokens": output.token_ids, "executor": executor}), flush=True)


def print_table(rows: list[dict], tokens: int) -> None:
    table = [
        (r["layout"], r["launcher"], r["communicator"], r.get("executor", "-"),
         "yes" if r["equal"] else f"NO ({r.get('error') or r['first_difference']})",
         f"{r['seconds']:g}")
        for r in rows
    ]  # fmt: skip
    headers = ("LAYOUT", "LAUNCHER", "COMMUNICATOR", "EXECUTOR", "= TRANSFORMERS", "SECONDS")
    print(f"{tokens} greedy tokens against HF transformers, two simulated hosts")
    print(render(headers, table))


def main() -> int:
    if sys.argv[1:2] == ["rank"]:
        rank(sys.argv[2], int(sys.argv[3]), sys.argv[4:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--json")
    args = parser.parse_args()
    reason = simulated.unavailable_reason()
    if reason is not None:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    from shardline.catalog import resolve_model_path

    model = str(resolve_model_path(args.model))
    with simulated.SimulatedHosts.up(2) as hosts:
        rows = run_cases(hosts, model, args.tokens)
    print_table(rows, args.tokens)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(row["equal"] for row in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
