"""The fault suite's injection plugin. It is registered only by the temporary distribution
the suite puts on the scenario's ``PYTHONPATH`` (entry point ``fault_injection``), and acts
on the plan in ``SHARDLINE_FAULT_PLAN`` (JSON, set by the suite for that run only):

- every import leaves a marker file ``imported-by-PID`` in ``markers`` (so the suite sees
  which processes loaded it, e.g. despite an allow-list), and every rank's start a file
  ``joining-RANK`` holding the wall-clock time it began joining;
- scenario "plugin raises on import" / "plugin left out by allow-list": importing raises;
- scenarios "rank never joins" and "rank on h2 never joins": rank ``victim`` hangs in
  ``shardline_rank_starting``.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from shardline.conformance.faults.plan import HANG_S
from shardline.conformance.faults.scenarios import NEVER_JOINS, PLAN_VARIABLE
from shardline.registry import hookimpl

RAISES_ON_IMPORT = ("plugin raises on import", "plugin left out by allow-list")

_plan = json.loads(os.environ.get(PLAN_VARIABLE) or "{}")
if _plan.get("markers"):
    Path(_plan["markers"], f"imported-by-{os.getpid()}").touch()
if _plan.get("scenario") in RAISES_ON_IMPORT:
    raise RuntimeError("planted by the fault suite: this plugin raises on import")


@hookimpl
def shardline_rank_starting(rank: int, world_size: int) -> None:
    if _plan.get("markers"):  # when this rank began joining (same host: comparable clocks)
        Path(_plan["markers"], f"joining-{rank}").write_text(repr(time.time()))
    if _plan.get("scenario") in NEVER_JOINS and rank == _plan.get("victim"):
        time.sleep(HANG_S)
