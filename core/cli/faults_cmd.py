"""``shardline faults``: the fault-injection matrix (every scenario on every valid executor x
communicator pair), as a table and a JSON report."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from shardline.cli.flags import check_seconds
from shardline.cli.table import render
from shardline.comm.waiting import host_cores
from shardline.conformance.faults import across_hosts, matrix
from shardline.conformance.faults.scenarios import (
    HOST_SCENARIOS,
    LAYOUTS,
    SCENARIOS,
    TENSOR_PARALLEL,
    Scenario,
)
from shardline.errors import ConfigError
from shardline.registry import Registry

_CELLS = {"passed": "pass", "failed": "FAIL", "unsupported": "-"}
#: The executor ``--across-hosts`` runs when ``--executors`` is not given.
DEFAULT_HOST_EXECUTOR = "external_launcher"


def _names(raw: str | None, field: str, known: list[str]) -> list[str]:
    if raw is None:
        return known
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in known and ":" not in name]
    if unknown or not names:
        raise ConfigError(
            f"{field} = {raw!r}: {'unknown: ' + ', '.join(unknown) if unknown else 'empty'}; "
            "allowed: "
            f"{', '.join(known)} (comma-separated)",
            field=field,
        )
    return names


def run(args: argparse.Namespace) -> int:
    allow = os.environ.get("SHARDLINE_PLUGINS")
    registry = Registry.load(allow=tuple(allow.split(",")) if allow else None)
    check_seconds("--timeout", args.timeout)
    check_seconds("--startup-timeout", args.startup_timeout)
    cores = host_cores()
    if not 1 <= args.jobs <= cores:
        raise ConfigError(
            f"--jobs = {args.jobs}: allowed 1 to {cores} (this host's cores)", field="--jobs"
        )
    if args.jobs > 1 and args.across_hosts:
        raise ConfigError(
            f"--jobs = {args.jobs}: --across-hosts runs one scenario at a time (allowed: 1)",
            field="--jobs",
        )
    if args.layout not in LAYOUTS:
        raise ConfigError(
            f"--layout = {args.layout!r}: allowed: tp (the ranks tensor-parallel), pp (one "
            "pipeline stage each)",
            field="--layout",
        )
    if args.layout != TENSOR_PARALLEL and args.across_hosts:
        raise ConfigError(
            f"--layout = {args.layout!r}: --across-hosts runs tensor-parallel ranks only "
            "(allowed: tp)",
            field="--layout",
        )
    settings = matrix.Settings(
        timeout_s=args.timeout, startup_timeout_s=args.startup_timeout, layout=args.layout
    )
    if args.across_hosts:
        results, labels, scenarios = _across_hosts(args, registry, settings)
    else:
        executors = _names(args.executors, "--executors", registry.names("executor"))
        communicators = _names(
            args.communicators, "--communicators", registry.names("communicator")
        )
        names = _names(args.scenarios, "--scenarios", list(SCENARIOS))
        scenarios = [SCENARIOS[name] for name in names]
        combos = matrix.combinations(registry, executors, communicators)
        results = matrix.run_matrix(combos, scenarios, settings, _progress, args.jobs)
        labels = [combo.label for combo in combos]
    by_cell = {(r.scenario, r.combination): r for r in results}
    rows = [
        [scenario.name, *(_CELLS[by_cell[(scenario.name, label)].outcome] for label in labels)]
        for scenario in scenarios
    ]
    document = matrix.report(results, settings)
    counts = document["counts"]
    rows.append(
        [
            "passed / run",
            *(f"{counts[label].get('passed', 0)}/{_run_count(counts[label])}" for label in labels),
        ]
    )
    print(render(["scenario", *labels], rows))
    unsupported = sorted({(r.combination, r.reason) for r in results if r.outcome == "unsupported"})
    if unsupported:
        print("\n- (not run):")
        for label, reason in unsupported:
            print(f"  {label}: {reason}")
    unjudged = matrix.leak_check_unavailable()
    if unjudged:
        print(f"\nnote: {unjudged}")
    failures = [r for r in results if r.outcome == "failed"]
    for result in failures:
        print(f"\nFAIL {result.combination}: {result.scenario}\n{result.reason}")
    if args.json:
        Path(args.json).write_text(json.dumps(document, indent=1, default=str))
    return 1 if failures else 0


def _progress(result: matrix.Result) -> None:
    print(
        f"  {result.combination}: {result.scenario}: {result.outcome} ({result.seconds:g} s)",
        file=sys.stderr,
        flush=True,
    )


def _across_hosts(
    args: argparse.Namespace, registry: Registry, settings: matrix.Settings
) -> tuple[list[matrix.Result], list[str], list[Scenario]]:
    """The host scenarios on fresh simulated hosts, for each executor whose ranks can span
    hosts (default: external_launcher, under torchrun) and each communicator that needs no
    launcher of its own (default: every installed one available here)."""
    reason = across_hosts.unavailable_reason()
    if reason is not None:
        raise ConfigError(f"--across-hosts: {reason}", field="--across-hosts")
    unfit = {
        component.name: component.unavailable_reason()
        or across_hosts.executor_unfit_reason(component.name, component.load())
        for component in registry.components("executor")
    }
    executors = _names(args.executors or DEFAULT_HOST_EXECUTOR, "--executors", list(unfit))
    for name in executors:
        if unfit.get(name):
            fit = [other for other, reason in unfit.items() if reason is None]
            raise ConfigError(
                f"--executors = {args.executors!r}: {unfit[name]}; allowed with "
                f"--across-hosts: {', '.join(fit)}",
                field="--executors",
            )
    fitting = [
        component.name
        for component in registry.components("communicator")
        if component.unavailable_reason() is None
        and (component.capabilities is None or component.capabilities.launcher is None)
    ]
    communicators = _names(args.communicators, "--communicators", fitting)
    names = _names(args.scenarios, "--scenarios", list(HOST_SCENARIOS))
    scenarios = [HOST_SCENARIOS[name] for name in names]
    results = []
    for executor in executors:
        executor_class = registry.get("executor", executor).load()
        for communicator in communicators:
            for scenario in scenarios:
                result = across_hosts.run_host_scenario(
                    executor, executor_class, communicator, scenario, settings
                )
                _progress(result)
                results.append(result)
    labels = list(dict.fromkeys(result.combination for result in results))
    return results, labels, scenarios


def _run_count(row: dict[str, int]) -> int:
    return row.get("passed", 0) + row.get("failed", 0)
