"""``shardline bench comm|decode --across-hosts H``: the same measurements with the ranks
inside one simulated host and spread over ``H`` simulated hosts, in one run
(:mod:`shardline.launch.hosts`: own network namespace on a private bridge, hostname and
``/dev/shm``; needs root and ``ip``).

Each simulated host of the "across" cluster runs on its own share of this machine's CPUs;
the one host of the "inside" cluster has all of them, so the ranks have the same cores
either way and the ratio shows what crossing a host costs. Ranks start with torchrun (one
agent per host, static rendezvous on the first host) or, for a communicator whose ranks
need mpiexec, OpenMPI's mpiexec with the hosts' launch agent instead of ssh; the executor
is ``external_launcher``.
"""

from __future__ import annotations

import contextlib
import json
import math
import statistics
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from shardline.cli import bench_cmd, bench_decode
from shardline.cli.bench_comm_options import BenchSettings, sizes
from shardline.cli.table import render
from shardline.errors import ConfigError
from shardline.launch import hosts as simulated
from shardline.launch.launchers import launcher_environment, private_tmpdir
from shardline.launch.process_exit import skip_final_collection

#: Marks the line a rank program prints its result on.
COMM_MARK = "BENCH-HOSTS-COMM "
INSIDE = "inside 1 host"


@dataclass(frozen=True)
class Place:
    """Where a world's ranks run: ``hosts`` hosts of ``cluster``, ``per_host`` ranks each."""

    where: str
    cluster: simulated.SimulatedHosts
    hosts: int
    per_host: int


@contextlib.contextmanager
def places(ranks: int, hosts: int) -> Iterator[tuple[Place, Place]]:
    """A one-host cluster holding ``ranks`` ranks and a ``hosts``-host cluster with
    ``ranks / hosts`` on each, both taken down on leaving. Raises ConfigError when they
    cannot be made here or ``hosts`` does not divide ``ranks``."""
    if hosts < 2 or ranks % hosts:
        raise ConfigError(
            f"--across-hosts = {hosts} ({ranks} ranks): allowed: 2 or more hosts that divide "
            "the ranks evenly"
        )
    reason = simulated.unavailable_reason()
    if reason is not None:
        raise ConfigError(f"--across-hosts: {reason}")
    with simulated.SimulatedHosts.up(1) as one, simulated.SimulatedHosts.up(hosts) as many:
        yield (
            Place(INSIDE, one, 1, ranks),
            Place(f"across {hosts} hosts", many, hosts, ranks // hosts),
        )


def launch(
    place: Place,
    launcher: str | None,
    program: Sequence[str],
    timeout_s: float,
    environ: Mapping[str, str] | None = None,
) -> str:
    """Run ``program`` (``-m module`` or a script, and its arguments) on every rank of
    ``place`` under ``launcher`` ("mpiexec", or torchrun for anything else), or, with
    "driver", once in the place's first host (a driver whose executor places the ranks);
    every launch command's standard output joined. ``environ``: the commands' environment
    (default :func:`~shardline.launch.launchers.launcher_environment`), with a temporary
    folder of their own. Raises RuntimeError naming the exit codes and the last error lines
    when a command fails or outlives ``timeout_s``."""
    made = place.cluster
    if launcher == "mpiexec":
        commands = [made.mpiexec(place.hosts, place.per_host, [sys.executable, *program])]
    elif launcher == "driver":
        commands = [made.hosts[0].command([sys.executable, *program])]
    else:
        commands = made.torchrun(place.hosts, place.per_host, program)
    outputs, errors = [], []
    with private_tmpdir(launcher_environment() if environ is None else environ) as private:
        started = [
            subprocess.Popen(
                command,
                env=private,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            for command in commands
        ]
        for process in started:
            try:
                out, err = process.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                for late in started:
                    late.kill()
                out, err = process.communicate()
                errors.append(f"did not end within {timeout_s:g} s")
            outputs.append(out)
            if process.returncode:
                last = (err.strip().splitlines() or ["no output"])[-1]
                errors.append(f"exit code {process.returncode}: {last}")
    if errors:
        raise RuntimeError("; ".join(errors))
    return "\n".join(outputs)


def marked(output: str, mark: str) -> list[dict]:
    """The JSON objects printed after ``mark`` in ``output``."""
    return [json.loads(line.split(mark, 1)[1]) for line in output.splitlines() if mark in line]


# ---- bench comm ----------------------------------------------------------------------------


def run_comm(settings: BenchSettings, hosts: int, json_path: str | None) -> int:
    """``bench comm --across-hosts``: each communicator's operations and sizes inside one
    host and across ``hosts``; a table with the ratio, and JSON. Exit code 1 when a case
    failed (reported in its row)."""
    launchers = bench_cmd.communicator_launchers(settings)
    rows: list[dict] = []
    with places(settings.ranks, hosts) as both:
        for name, launcher in launchers.items():
            for place in both:
                program = ["-m", "shardline.cli.bench_hosts", "comm-rank", name]
                program.append(json.dumps(asdict(settings)))
                base = {"communicator": name, "where": place.where, "launcher": launcher}
                limit = 120 + len(sizes(settings)) * len(settings.operations) * 30
                try:
                    output = launch(place, launcher or "torchrun", program, limit)
                    results = marked(output, COMM_MARK)
                    if not results:
                        raise RuntimeError("no rank reported")
                    rows += [base | row for row in results[0]["rows"]]
                except RuntimeError as error:
                    rows.append(base | {"error": str(error)[:300]})
    print(_comm_table(rows, settings, hosts))
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump({"settings": asdict(settings), "hosts": hosts, "results": rows}, handle)
    return 1 if any("error" in row for row in rows) else 0


def _world_samples(worker, operation: str, nbytes: int, settings: dict) -> list | None:
    """On a rank: :func:`~shardline.cli.bench_cmd.measure_on` the world (its TP group)."""
    return bench_cmd.measure_on(
        worker.state.tp.data,
        operation,
        nbytes,
        settings["dtype"],
        settings["warmup"],
        settings["iterations"],
    )


def comm_rank(communicator: str, settings_json: str) -> None:
    """A launched rank of ``run_comm``: the world is one TP group of a model-less runner
    (nothing to load), driven through ``external_launcher``; the reporting rank prints the
    rows."""
    from shardline.config import load_config
    from shardline.registry import Registry

    settings = json.loads(settings_json)
    config = load_config(
        overrides=[
            "model.runner=shardline.conformance.faults.runner:FaultModelRunner",
            f"parallel.tensor_parallel_size={settings['ranks']}",
            "parallel.distributed_executor_backend=external_launcher",
            f"parallel.communicator={communicator}",
            "parallel.watchdog=false",
            f"parallel.timeout_s={settings['timeout_s']}",
        ],
        environ={},
    ).config
    executor = Registry.load().get("executor", "external_launcher").load_available()(config)
    try:
        rows = []
        for operation in settings["operations"]:
            size = settings["begin"]
            while size <= settings["end"]:
                per_rank = executor.collective_rpc(_world_samples, (operation, size, settings))
                times = bench_cmd.collective_times(
                    [samples for samples in per_rank if samples is not None], operation
                )
                median = statistics.median(times)
                rows.append(
                    {
                        "operation": operation,
                        "bytes": size,
                        "median_us": median * 1e6,
                        "min_us": min(times) * 1e6,
                        "max_us": max(times) * 1e6,
                        "busbw_GBps": size
                        / median
                        / 1e9
                        * bench_cmd.bus_factor(operation, settings["ranks"]),
                    }
                )
                size *= settings["factor"]
        if executor.reports_results:
            print(COMM_MARK + json.dumps({"rows": rows}), flush=True)
    finally:
        executor.shutdown()


def _comm_table(rows: list[dict], settings: BenchSettings, hosts: int) -> str:
    inside = {
        (r["communicator"], r["operation"], r["bytes"]): r["median_us"]
        for r in rows
        if r["where"] == INSIDE and "error" not in r
    }
    lines = []
    for r in rows:
        if "error" in r:
            lines.append((r["communicator"], r["where"], "-", "-", "-", "-", r["error"]))
            continue
        before = inside.get((r["communicator"], r["operation"], r["bytes"]))
        lines.append(
            (
                r["communicator"],
                r["where"],
                r["operation"],
                bench_cmd.human_size(r["bytes"]),
                f"{r['median_us']:.1f}",
                f"{r['busbw_GBps']:.3f}",
                "-" if r["where"] == INSIDE or not before else f"{r['median_us'] / before:.2f}x",
            )
        )
    title = (
        f"{settings.ranks} ranks inside 1 host and over {hosts} simulated hosts, "
        f"{settings.dtype}, {settings.warmup} warm-up + {settings.iterations} timed iterations; "
        "median time from the last rank's start to the last rank's end"
    )
    header = ("COMMUNICATOR", "WHERE", "OPERATION", "SIZE", "MEDIAN µs", "BUSBW GB/s", "/ INSIDE")
    return title + "\n" + render(header, lines)


# ---- bench decode --------------------------------------------------------------------------


def run_decode(
    cases: list[bench_decode.Case],
    skipped: list[tuple[str, str]],
    hosts: int,
    json_path: str | None,
) -> int:
    """``bench decode --across-hosts``: each multi-rank case inside one host and across
    ``hosts`` (transformers and single-rank cases have no hosts to cross and are not run);
    a table with the ratio, and JSON. Exit code 1 when a case failed."""
    runs = [c for c in cases if c.engine == "shardline" and _ranks(c) > 1]
    if not runs:
        raise ConfigError("--across-hosts: no layout with more than one rank (tp2, pp2)")
    rows: list[dict] = []
    for ranks in sorted({_ranks(case) for case in runs}):
        with places(ranks, hosts) as both:
            for case in (c for c in runs if _ranks(c) == ranks):
                launched = replace(case, launcher=case.launcher or "torchrun")
                program = ["-m", "shardline.cli.bench_decode", json.dumps(asdict(launched))]
                for place in both:
                    row = asdict(launched) | {"where": place.where}
                    try:
                        output = launch(place, launched.launcher, program, case.timeout_s)
                        found = marked(output, bench_decode.RESULT_MARK)
                        row |= found[0] if found else {"error": "no rank reported"}
                    except RuntimeError as error:
                        row["error"] = str(error)[:300]
                    rows.append(row)
    print(_decode_table(rows, hosts))
    for name, reason in skipped:
        print(f"communicator {name} skipped: {reason}")
    if json_path:
        with open(json_path, "w", encoding="utf-8") as handle:
            json.dump({"hosts": hosts, "rows": rows}, handle, indent=2)
    return 1 if any("error" in row for row in rows) else 0


def _ranks(case: bench_decode.Case) -> int:
    return math.prod(bench_decode.LAYOUTS[case.layout])


def _decode_table(rows: list[dict], hosts: int) -> str:
    inside = {
        (r["layout"], r["communicator"]): r
        for r in rows
        if r["where"] == INSIDE and "error" not in r
    }
    lines = []
    for r in rows:
        if "error" in r:
            lines.append((r["layout"], r["communicator"], r["where"], "-", "-", "-", r["error"]))
            continue
        before = inside.get((r["layout"], r["communicator"]))
        ratio = (
            "-"
            if r["where"] == INSIDE or before is None
            else f"{r['batch1_tok_s'] / before['batch1_tok_s']:.2f}x / "
            f"{r['concurrent_tok_s'] / before['concurrent_tok_s']:.2f}x"
        )
        lines.append(
            (
                r["layout"],
                r["communicator"],
                r["where"],
                f"{r['batch1_tok_s']:.1f}",
                f"{r['concurrent_tok_s']:.1f}",
                ratio,
                "",
            )
        )
    header = ("LAYOUT", "COMMUNICATOR", "WHERE", "BATCH1 TOK/S", "CONCURRENT TOK/S",
              "/ INSIDE (B1 / CONC)", "ERROR")  # fmt: skip
    return f"greedy decode inside 1 host and over {hosts} simulated hosts\n" + render(header, lines)


if __name__ == "__main__":
    skip_final_collection()
    if sys.argv[1:2] == ["comm-rank"]:
        comm_rank(sys.argv[2], sys.argv[3])
    else:
        raise SystemExit("usage: python -m shardline.cli.bench_hosts comm-rank NAME SETTINGS")
