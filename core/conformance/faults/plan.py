"""What the fault suite plants on a rank (:class:`Plan`, through ``collective_rpc`` with
:func:`arm`), apart from the runner: a scenario's driver starts its executor's head start
(``prestart``) before anything it loads imports torch."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

#: ``model.runner`` value that selects :class:`~.runner.FaultModelRunner`.
FAULT_RUNNER = "shardline.conformance.faults.runner:FaultModelRunner"
#: How long a hung rank stays hung: far past any deadline (its launcher or executor ends it).
HANG_S = 3600.0


@dataclass(frozen=True)
class Plan:
    """Fault ``fault`` (a scenario's step fault, or None) planted on rank ``victim`` (of the
    world; a fault in the tensor-parallel group takes it as a rank of that group);
    ``markers``: the folder where the victim of a host scenario marks that it is in the step."""

    fault: str | None
    victim: int
    markers: str = ""


def arm(worker: Any, plan: Plan) -> int:
    """Plant ``plan`` in the rank's runner; returns the rank's pid."""
    worker.model_runner.plan = plan
    return os.getpid()
