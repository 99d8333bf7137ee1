"""``shardline faults``: the fault-injection matrix (every scenario on every valid executor x
communicator pair), as a table and a JSON report."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from shardline.cli.table import render
from shardline.conformance.faults import matrix
from shardline.conformance.faults.scenarios import SCENARIOS
from shardline.errors import ConfigError
from shardline.registry import Registry

_CELLS = {"passed": "pass", "failed": "FAIL", "unsupported": "-"}


def _names(raw: str | None, field: str, known: list[str]) -> list[str]:
    if raw is None:
        return known
    names = [name.strip() for name in raw.split(",") if name.strip()]
    unknown = [name for name in names if name not in known and ":" not in name]
    if unknown or not names:
        raise ConfigError(
            f"{field} = {raw!r}: {', '.join(unknown) or 'nothing named'}; allowed: "
            f"{', '.join(known)} (comma-separated)",
            field=field,
        )
    return names


def run(args: argparse.Namespace) -> int:
    allow = os.environ.get("SHARDLINE_PLUGINS")
    registry = Registry.load(allow=tuple(allow.split(",")) if allow else None)
    executors = _names(args.executors, "--executors", registry.names("executor"))
    communicators = _names(args.communicators, "--communicators", registry.names("communicator"))
    scenarios = [SCENARIOS[name] for name in _names(args.scenarios, "--scenarios", list(SCENARIOS))]
    if args.timeout <= 0:
        raise ConfigError(f"--timeout = {args.timeout}: must be > 0", field="--timeout")
    settings = matrix.Settings(timeout_s=args.timeout)
    combos = matrix.combinations(registry, executors, communicators)

    def progress(result: matrix.Result) -> None:
        print(
            f"  {result.combination}: {result.scenario}: {result.outcome} ({result.seconds:g} s)",
            file=sys.stderr,
            flush=True,
        )

    results = matrix.run_matrix(combos, scenarios, settings, progress)
    by_cell = {(r.scenario, r.combination): r for r in results}
    labels = [combo.label for combo in combos]
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


def _run_count(row: dict[str, int]) -> int:
    return row.get("passed", 0) + row.get("failed", 0)
