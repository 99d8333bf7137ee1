"""The fault scenarios and what passing each means.

Every scenario runs in a fresh world of ``ranks`` ranks, tensor-parallel (the victim is the
last rank, so never the output rank) or, in the ``pp`` layout, one pipeline stage each (the
victim is the last stage, the output rank; only the scenarios whose fault is not in the
tensor-parallel group run there), with the communicator under test on both the data and the
control plane. Pass: every surviving process (the driver of a driver-owned executor;
every rank of a launched world but a killed or hung victim) raises a typed error (a
:class:`~shardline.errors.ShardlineError`) of an expected kind within the deadline + 1 s,
naming the victim where it can; its executor shuts down without error within
:data:`SHUTDOWN_LIMIT_S`; and no process and no ``/dev/shm`` entry is left once the run ends.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The slack allowed past a deadline.
DEADLINE_SLACK_S = 1.0
#: An executor's shutdown must return within this long to count as clean.
SHUTDOWN_LIMIT_S = 15.0
#: Entry-point name of the injection plugin (:mod:`.injection`), and the variable that
#: carries its plan to the scenario's processes.
INJECTION_ENTRY_POINT = "fault_injection"
PLAN_VARIABLE = "SHARDLINE_FAULT_PLAN"
#: The scenarios whose victim hangs in its ``shardline_rank_starting`` hook (:mod:`.injection`).
NEVER_JOINS = ("rank never joins", "rank on h2 never joins")


@dataclass(frozen=True)
class Scenario:
    """One planted fault.

    ``step_fault``: armed in every rank's runner, planted by the next step (else the fault
    acts at start-up). ``deadline``: "timeout" (``parallel.timeout_s``) or "startup"
    (``parallel.startup_timeout_s``). ``errors``: acceptable error kinds (a WorkerError
    counts by the kind it carries). ``names_victim``: the driver's or rank 0's message must
    name the victim. ``words``: texts some survivor's message must contain. ``victim_survives``:
    the victim is alive and must raise too. ``completes``: the step must succeed instead.
    ``host_action`` (host scenarios): what is done to the victim's host while its rank
    pauses in the step: "kill" its every process, "take down" the host (processes,
    namespaces, cable), cut its "link", or "stop" its processes
    past the deadline. ``in_tp_group``: the fault is an exchange in the tensor-parallel
    group (the ``pp`` layout has none to plant it in).
    """

    name: str
    summary: str
    min_ranks: int
    step_fault: bool = True
    deadline: str = "timeout"
    errors: tuple[str, ...] = ()
    names_victim: bool = False
    words: tuple[str, ...] = ()
    victim_survives: bool = False
    completes: bool = False
    overrides: tuple[str, ...] = ()
    host_action: str = ""
    in_tp_group: bool = False


#: The layouts a scenario world can have: its ranks tensor-parallel, or pipeline stages.
TENSOR_PARALLEL, PIPELINE = LAYOUTS = ("tp", "pp")
#: A process report's "shutdown" while its executor shuts down (the final report replaces it).
UNFINISHED = "unfinished"

SCENARIOS: dict[str, Scenario] = {
    scenario.name: scenario
    for scenario in (
        Scenario(
            "killed mid-step",
            "the victim SIGKILLs itself inside a step, before the all-reduce",
            min_ranks=2,
            errors=("PeerLostError", "CommTimeoutError"),
            names_victim=True,
        ),
        Scenario(
            "hangs in a collective",
            "the victim stops inside a step; the others wait in the all-reduce",
            min_ranks=2,
            errors=("CommTimeoutError",),
            names_victim=True,
        ),
        Scenario(
            "rank never joins",
            "the victim's process hangs before joining its worlds",
            min_ranks=2,
            step_fault=False,
            deadline="startup",
            errors=("CommTimeoutError",),
            names_victim=True,
        ),
        Scenario(
            "different collectives",
            "the victim calls recv where the others call all_reduce",
            min_ranks=2,
            errors=("CommTimeoutError", "PeerLostError"),
            words=("all_reduce", "recv"),
            victim_survives=True,
            in_tp_group=True,
        ),
        Scenario(
            "different shapes",
            "the victim all-reduces [8, 32] where the others all-reduce [8, 16] "
            "(watchdog debug mode, parallel.watchdog_check_every = 1)",
            min_ranks=2,
            errors=("CollectiveMismatchError", "PeerLostError"),
            words=("[8, 16]", "[8, 32]"),
            victim_survives=True,
            overrides=("parallel.watchdog_check_every=1",),
            in_tp_group=True,
        ),
        Scenario(
            "ill-formed object",
            "the victim broadcasts an object without the job secret's signature",
            min_ranks=2,
            errors=("ProtocolError", "CommTimeoutError", "PeerLostError"),
            words=("job-secret check",),
            victim_survives=True,
            in_tp_group=True,
        ),
        Scenario(
            "ill-formed tensor dict",
            "the victim sends tensor-dict metadata with an unknown dtype and a negative size",
            min_ranks=2,
            errors=("ProtocolError", "CommTimeoutError", "PeerLostError"),
            words=("unknown dtype 'float99'",),
            victim_survives=True,
            in_tp_group=True,
        ),
        Scenario(
            "plugin raises on import",
            "an installed plugin raises on import, with plugins.strict = true",
            min_ranks=1,
            step_fault=False,
            errors=("PluginError",),
            words=("fault_injection", "raises on import"),
            victim_survives=True,
            overrides=("plugins.strict=true",),
        ),
        Scenario(
            "plugin left out by allow-list",
            "the same plugin, left out of plugins.allow: no process may import it, and the "
            "step completes",
            min_ranks=1,
            step_fault=False,
            victim_survives=True,
            completes=True,
        ),
    )
}


#: Faults of a whole host, run across simulated hosts (:mod:`.across_hosts`): one rank per
#: host, the victim's host is the second. Survivors must name the rank and its host.
HOST_SCENARIOS: dict[str, Scenario] = {
    scenario.name: scenario
    for scenario in (
        Scenario(
            "host dies mid-step",
            "every process of the victim's host is SIGKILLed while the others wait in the "
            "all-reduce",
            min_ranks=2,
            errors=("PeerLostError", "CommTimeoutError"),
            names_victim=True,
            words=("host h2",),
            host_action="kill",
        ),
        Scenario(
            "host taken down mid-step",
            "the victim's host is taken down (shardline hosts down C h2): its processes "
            "killed, its network namespace and cable removed, so no goodbye reaches the others",
            min_ranks=2,
            errors=("CommTimeoutError", "PeerLostError"),
            names_victim=True,
            words=("host h2",),
            host_action="take down",
        ),
        Scenario(
            "rank on h2 never joins",
            "the rank on h2 (its process up, its host announced) hangs before joining its worlds",
            min_ranks=2,
            step_fault=False,
            deadline="startup",
            errors=("CommTimeoutError",),
            names_victim=True,
            words=("rank 1 on host h2",),
        ),
        Scenario(
            "link down mid-step",
            "the victim's host loses its link (ip link set ... down) while the others wait in "
            "the all-reduce",
            min_ranks=2,
            errors=("CommTimeoutError", "PeerLostError"),
            names_victim=True,
            words=("host h2",),
            host_action="link",
        ),
        Scenario(
            "host stopped past the deadline",
            "every process of the victim's host is SIGSTOPped until the others have raised",
            min_ranks=2,
            errors=("CommTimeoutError",),
            names_victim=True,
            words=("host h2",),
            host_action="stop",
        ),
    )
}
