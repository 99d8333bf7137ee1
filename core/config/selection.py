"""Which component each config field selects, why, and why every alternative was not chosen.

Pure decisions over (config, registry, environment): used by validation, by
``shardline explain`` and by whatever starts the engine.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from shardline.config.capacity import (
    CapacityPlan,
    HostMemory,
    plan_capacity,
    plan_device_capacity,
    ranks_on_this_host,
)
from shardline.config.loader import LoadedConfig
from shardline.config.schema import EngineConfig
from shardline.errors import ConfigError, echo
from shardline.launch.launcher_env import detect_launcher
from shardline.registry import Component, Registry


@dataclass(frozen=True)
class Decision:
    """The component or setting chosen for ``field``, the reason, and a verdict for every
    alternative.

    ``problem`` is set when the choice cannot run (the message names field, value and the
    allowed alternatives); ``chosen`` is then still the name that was asked for.
    """

    field: str
    chosen: str
    reason: str
    alternatives: list[tuple[str, str]] = field(default_factory=list)
    problem: str | None = None


def executor_name(config: EngineConfig, environ: Mapping[str, str]) -> tuple[str, str]:
    """The executor ``parallel.distributed_executor_backend`` names, and why: ``auto`` picks
    ``uni`` for one rank, ``external_launcher`` under torchrun or mpiexec, else ``mp``
    (nothing is imported or checked)."""
    requested = config.parallel.distributed_executor_backend
    world_size = config.parallel.world_size
    if requested != "auto":
        return requested, "configured"
    launcher = detect_launcher(environ)
    if world_size == 1:
        return "uni", "auto: one rank runs in this process"
    if launcher is not None:
        return "external_launcher", f"auto: this process was started by {launcher}"
    return "mp", f"auto: {world_size} ranks, no launcher detected: one process per rank"


def choose_executor(
    config: EngineConfig, registry: Registry, environ: Mapping[str, str]
) -> Decision:
    """Resolve ``parallel.distributed_executor_backend``; ``auto`` picks ``uni`` for one rank,
    ``external_launcher`` under torchrun or mpiexec, else ``mp``."""
    field_name = "parallel.distributed_executor_backend"
    world_size = config.parallel.world_size
    chosen, reason = executor_name(config, environ)
    alternatives = [
        (c.name, "chosen" if c.name == chosen else "not selected")
        for c in registry.components("executor")
    ]
    problem = _load_problem(registry, "executor", chosen, field_name)
    if chosen == "uni" and world_size > 1:
        problem = (
            f"{field_name} = 'uni' runs one rank in-process, but the layout has {world_size} "
            f"ranks; allowed: mp, external_launcher, or auto"
        )
    if problem is None and config.parallel.nnodes > 1:
        problem = _single_host_problem(config, registry, chosen, field_name)
    return Decision(field_name, chosen, reason, alternatives, problem)


def _single_host_problem(
    config: EngineConfig, registry: Registry, chosen: str, field_name: str
) -> str | None:
    """Why executor ``chosen`` cannot run ``parallel.nnodes`` > 1 hosts, or None."""
    if registry.get("executor", chosen).load().spans_hosts:
        return None
    spanning = [
        component.name
        for component in registry.components("executor")
        if component.unavailable_reason() is None and component.load().spans_hosts
    ]
    return (
        f"{field_name} = {echo(chosen)} runs every rank on this host, but parallel.nnodes = "
        f"{config.parallel.nnodes}; allowed: an executor whose ranks span hosts: "
        f"{', '.join(spanning) or 'none installed'} (external_launcher: start the ranks with "
        "torchrun or mpiexec on every host)"
    )


def choose_model_runner(config: EngineConfig, registry: Registry) -> Decision:
    """Resolve ``model.runner``: a registered name or a ``package.module:Class`` path to a
    :class:`~shardline.interfaces.ModelRunner` subclass (imported, never called)."""
    field_name = "model.runner"
    requested = config.model.runner
    alternatives = [
        (c.name, "chosen" if c.name == requested else "not selected")
        for c in registry.components("model_runner")
    ]
    problem = _load_problem(registry, "model_runner", requested, field_name)
    return Decision(field_name, requested, "configured", alternatives, problem)


def choose_prefix_caching(config: EngineConfig, registry: Registry, runner: Decision) -> Decision:
    """``cache.prefix_caching``: as configured, but off with a model runner that does not
    declare it (:attr:`~shardline.interfaces.ModelRunner.prefix_caching`)."""
    field_name = "cache.prefix_caching"
    if not config.cache.prefix_caching:
        return Decision(field_name, "false", "configured", [("false", "chosen")])
    if runner.problem is not None or _runner_declares(registry, runner, "prefix_caching"):
        return Decision(field_name, "true", "configured", [("true", "chosen")])
    return Decision(
        field_name,
        "false",
        f"model runner {runner.chosen!r} does not start requests from cached blocks "
        "(ModelRunner.prefix_caching is False)",
        [("true", "not supported by the model runner"), ("false", "chosen")],
    )


def choose_speculative(config: EngineConfig, registry: Registry, runner: Decision) -> Decision:
    """``speculative.method``: as configured; a method other than ``none`` needs a model
    runner that verifies drafts (:attr:`~shardline.interfaces.ModelRunner.speculative_decoding`)."""
    field_name = "speculative.method"
    method = config.speculative.method
    if (
        method == "none"
        or runner.problem is not None
        or _runner_declares(registry, runner, "speculative_decoding")
    ):
        return Decision(field_name, method, "configured", [(method, "chosen")])
    return Decision(
        field_name,
        method,
        "configured",
        [(method, "not supported by the model runner"), ("none", "allowed")],
        problem=f"speculative.method = {method!r}: model runner {runner.chosen!r} does not "
        "verify drafts (ModelRunner.speculative_decoding is False); allowed: 'none'",
    )


def _runner_declares(registry: Registry, runner: Decision, capability: str) -> bool:
    """Whether the model runner ``runner`` chose (one that loads) sets the class attribute
    ``capability`` (e.g. ``prefix_caching``)."""
    runner_class = registry.get("model_runner", runner.chosen, "model.runner").load()
    return bool(getattr(runner_class, capability))


def _load_problem(registry: Registry, kind: str, name: str, field_name: str) -> str | None:
    """Why ``name`` cannot be used for ``field_name`` (unknown, fails to import, not the
    kind's class, or unavailable here), or None."""
    try:
        component = registry.get(kind, name, field_name)
    except ConfigError as error:
        return str(error)
    reason = component.unavailable_reason()
    if reason is None:
        return None
    return f"{field_name} = {echo(name)}: {reason}"


def choose_communicator(
    config: EngineConfig,
    registry: Registry,
    field_name: str,
    executor: Decision,
    environ: Mapping[str, str],
) -> Decision:
    """Resolve a communicator field and judge every registered communicator against the
    config (availability, device, dtype, group sizes, hosts) and the way ranks start
    (``executor``: a backend whose ranks must come from a launcher)."""
    control = field_name == "parallel.control_communicator"
    requested = config.parallel.control_communicator if control else config.parallel.communicator
    verdicts = {
        c.name: _fit(c, config, control, executor, environ)
        for c in registry.components("communicator")
    }
    alternatives = [
        (name, "chosen" if name == requested else (verdict or "fits; not selected"))
        for name, verdict in verdicts.items()
    ]
    try:
        component = registry.get("communicator", requested, field_name)
    except ConfigError as error:
        return Decision(field_name, requested, "configured", alternatives, str(error))
    verdict = verdicts.get(requested)
    if requested not in verdicts:
        verdict = _fit(component, config, control, executor, environ)
    problem = None
    if verdict is not None:
        others = [name for name, v in verdicts.items() if v is None and name != requested]
        problem = (
            f"{field_name} = {requested!r}: {verdict}; "
            f"allowed here: {', '.join(others) or 'no installed communicator fits'}"
        )
    return Decision(field_name, requested, "configured", alternatives, problem)


def _fit(
    component: Component,
    config: EngineConfig,
    control: bool,
    executor: Decision,
    environ: Mapping[str, str],
) -> str | None:
    """Why ``component`` cannot serve this config, or None when it can."""
    unavailable = component.unavailable_reason()
    if unavailable is not None:
        return f"unavailable: {unavailable}"
    capabilities = component.capabilities
    if capabilities is None and component.capabilities_of:
        return f"wraps communicator {component.capabilities_of!r}, which no loaded plugin provides"
    if capabilities is None:
        return "declares no capabilities"
    parallel = config.parallel
    group_sizes = sorted(
        {
            parallel.world_size,
            parallel.tensor_parallel_size,
            parallel.pipeline_parallel_size,
            parallel.data_parallel_size,
        }
    )
    for size in group_sizes:
        reason = capabilities.unsupported_reason(world_size=size)
        if reason is not None:
            return reason
    if control:
        reason = capabilities.unsupported_reason(device="cpu", multi_host=parallel.nnodes > 1)
    else:
        reason = capabilities.unsupported_reason(
            device=parallel.device, dtype=config.model.dtype, multi_host=parallel.nnodes > 1
        )
    return reason or _launch_problem(capabilities.launcher, executor, environ)


def _launch_problem(
    needed: str | None, executor: Decision, environ: Mapping[str, str]
) -> str | None:
    """Why a backend whose ranks must come from launcher ``needed`` (MPI: mpiexec) cannot
    run as the ranks start here, or None."""
    if needed is None:
        return None
    launcher = detect_launcher(environ) or ""
    if executor.chosen == "external_launcher" and launcher.startswith(needed):
        return None
    why = (
        f"the executor {executor.chosen!r} starts its own processes"
        if executor.chosen != "external_launcher"
        else f"this process was started by {launcher or 'no launcher'}"
    )
    return f"needs ranks started by {needed} (executor external_launcher under {needed}), but {why}"


def decide(config: EngineConfig, registry: Registry, environ: Mapping[str, str]) -> list[Decision]:
    """The device, data-parallel size, data-plane communicator, control-plane communicator,
    executor, model runner and prefix caching decisions."""
    executor = choose_executor(config, registry, environ)
    communicators = []
    for field_name in ("parallel.communicator", "parallel.control_communicator"):
        if field_name == "parallel.communicator" and config.parallel.communicator == "auto":
            communicators.append(_choose_auto_communicator(config, registry, executor, environ))
            continue
        communicators.append(choose_communicator(config, registry, field_name, executor, environ))
    return [
        choose_device(config, registry, executor, environ),
        choose_data_parallel_size(config, registry, executor),
        *communicators,
        executor,
        runner := choose_model_runner(config, registry),
        choose_prefix_caching(config, registry, runner),
        choose_speculative(config, registry, runner),
    ]


def choose_device(
    config: EngineConfig, registry: Registry, executor: Decision, environ: Mapping[str, str]
) -> Decision:
    """``parallel.device``: ``cpu`` always runs; ``cuda`` where this host has a CUDA build of
    torch and a device for each of its ranks (rank ``r`` uses ``cuda:{local rank}``; the
    ranks here as ``executor`` places them)."""
    field_name = "parallel.device"
    if config.parallel.device == "cpu":
        return Decision(
            field_name, "cpu", "configured", [("cpu", "chosen"), ("cuda", "not selected")]
        )
    problem = _cuda_problem(config, registry, executor, environ)
    if problem is None:
        return Decision(
            field_name, "cuda", "configured", [("cuda", "chosen"), ("cpu", "not selected")]
        )
    return Decision(
        field_name,
        "cuda",
        "configured",
        [("cpu", "runs; not selected"), ("cuda", "chosen")],
        f"{field_name} = 'cuda': {problem}; allowed: cpu",
    )


def _cuda_problem(
    config: EngineConfig, registry: Registry, executor: Decision, environ: Mapping[str, str]
) -> str | None:
    """Why this host cannot give each of its ranks a CUDA device, or None."""
    import torch

    if not torch.cuda.is_available():
        build = "" if torch.version.cuda else f"; torch {torch.__version__} is a CPU build"
        return f"this host has no CUDA device (torch.cuda.is_available() is False{build})"
    if executor.problem is not None:
        return None  # the executor's own problem is reported; the ranks here are unknown
    executor_class = registry.get("executor", executor.chosen, executor.field).load()
    ranks = len(ranks_on_this_host(config, executor_class, environ).ranks)
    count = torch.cuda.device_count()
    if ranks > count:
        return (
            f"{ranks} ranks on this host need a CUDA device each (one rank per device), and "
            f"this host has {count}"
        )
    return None


def choose_data_parallel_size(
    config: EngineConfig, registry: Registry, executor: Decision
) -> Decision:
    """``parallel.data_parallel_size``: N replicas of the TP x PP layout, each with ranks of
    its own started by the executor. A launched world (``external_launcher``) has one
    engine per process and cannot start replicas: there, more than 1 is refused."""
    field_name = "parallel.data_parallel_size"
    size = config.parallel.data_parallel_size
    layout = config.parallel
    what = (
        f"{size} replicas x {layout.tensor_parallel_size * layout.pipeline_parallel_size} "
        "ranks (tp x pp), each replica its own scheduler and KV cache"
    )
    if size == 1:
        return Decision(field_name, "1", "configured", [("1", "chosen: one replica")])
    launched = False
    if executor.problem is None:
        launched = registry.get("executor", executor.chosen, executor.field).load().launched
    if not launched:
        return Decision(field_name, str(size), "configured", [(str(size), f"chosen: {what}")])
    return Decision(
        field_name,
        str(size),
        "configured",
        [(str(size), "chosen"), ("1", "runs under a launcher")],
        f"{field_name} = {size}: the executor {executor.chosen!r} runs the ranks a launcher "
        "started, one engine per process, and cannot start replicas; allowed: 1 here (start "
        "one job per replica), or an executor that starts its ranks (mp, ray)",
    )


def _choose_auto_communicator(
    config: EngineConfig, registry: Registry, executor: Decision, environ: Mapping[str, str]
) -> Decision:
    """The installed communicator with the highest ``auto_preference`` (its plugin declares
    it; ties by name) that fits the config and the way ranks are started."""
    field_name = "parallel.communicator"
    ranked = sorted(registry.components("communicator"), key=lambda c: (-c.auto_preference, c.name))
    order = [component.name for component in ranked]
    alternatives = []
    chosen = None
    for name in order:
        candidate = config.model_copy(
            update={"parallel": config.parallel.model_copy(update={"communicator": name})}
        )
        verdict = choose_communicator(candidate, registry, field_name, executor, environ).problem
        if verdict is None and chosen is None:
            chosen = name
        alternatives.append((name, "chosen" if name == chosen else (verdict or "fits; later")))
    if chosen is None:
        return Decision(
            field_name,
            "auto",
            "auto",
            alternatives,
            f"{field_name} = 'auto': no installed communicator fits this config "
            f"(tried {', '.join(order) or 'none installed'})",
        )
    return Decision(field_name, chosen, "auto: the fastest that fits", alternatives)


def resolved(config: EngineConfig, decisions: list[Decision]) -> EngineConfig:
    """``config`` with ``auto`` fields replaced by the decisions' choices (what rank
    processes are given, so that every rank runs the same components), and prefix caching
    as decided."""
    chosen = {d.field: d.chosen for d in decisions}
    update = {
        "communicator": chosen.get("parallel.communicator", config.parallel.communicator),
        "distributed_executor_backend": chosen.get(
            "parallel.distributed_executor_backend", config.parallel.distributed_executor_backend
        ),
    }
    caching = chosen.get("cache.prefix_caching")
    cache = config.cache
    if caching is not None:
        cache = cache.model_copy(update={"prefix_caching": caching == "true"})
    parallel = config.parallel.model_copy(update=update)
    return config.model_copy(update={"parallel": parallel, "cache": cache})


def is_error(decision: Decision, config: EngineConfig, starts_here: bool = False) -> bool:
    """Whether a decision's problem makes the config invalid. An executor left on ``auto``
    that cannot run is reported, but the config itself is fine (``auto`` may pick another
    one elsewhere, under a launcher say), unless the world ``starts_here``."""
    if decision.problem is None:
        return False
    on_auto = config.parallel.distributed_executor_backend == "auto"
    executor = decision.field == "parallel.distributed_executor_backend"
    return not (executor and on_auto and not starts_here)


@dataclass(frozen=True)
class CheckedConfig:
    """A config every check passed. ``config`` has its ``auto`` fields resolved (what rank
    processes are given); ``decisions`` say why each component was chosen; ``capacity`` is the
    memory plan on this host."""

    config: EngineConfig
    decisions: list[Decision]
    capacity: CapacityPlan


def check_config(
    loaded: LoadedConfig,
    registry: Registry,
    environ: Mapping[str, str],
    host: HostMemory | None = None,
    starts_here: bool = False,
) -> CheckedConfig:
    """Every decision, then, when ``model.path`` names an existing file or directory, what
    the model and this host allow (the runner's :meth:`~shardline.interfaces.ModelRunner.plan`
    and the memory plan, against ``host``, read when not given). Raises one
    :class:`ConfigError` listing each problem with its source. Nothing is started;
    ``starts_here``: the world is about to start in this environment (see :func:`is_error`)."""
    config = loaded.config
    decisions = decide(config, registry, environ)
    problems = [
        f"{loaded.source_of(d.field)}: {d.problem}"
        for d in decisions
        if is_error(d, config, starts_here)
    ]
    if config.parallel.data_parallel_rank is not None:
        problems.append(
            f"{loaded.source_of('parallel.data_parallel_rank')}: parallel.data_parallel_rank = "
            f"{config.parallel.data_parallel_rank}: the engine sets it in each replica's config; "
            "allowed: leave it unset"
        )
    if config.parallel.world_size % config.parallel.nnodes:
        problems.append(
            f"{loaded.source_of('parallel.nnodes')}: parallel.nnodes = {config.parallel.nnodes}: "
            f"the world of {config.parallel.world_size} ranks does not divide evenly over the hosts"
        )
    config = resolved(config, decisions)
    capacity = None
    if not problems:
        try:
            capacity = capacity_plan(loaded, config, decisions, registry, environ, host)
        except ConfigError as error:
            problems += [_with_source(loaded, line) for line in _problem_lines(str(error))]
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    assert capacity is not None  # set whenever no problem was found
    if capacity.num_blocks != config.cache.num_blocks:
        cache = config.cache.model_copy(update={"num_blocks": capacity.num_blocks})
        config = config.model_copy(update={"cache": cache})
    return CheckedConfig(config, decisions, capacity)


def capacity_plan(
    loaded: LoadedConfig,
    config: EngineConfig,
    decisions: list[Decision],
    registry: Registry,
    environ: Mapping[str, str],
    host: HostMemory | None = None,
) -> CapacityPlan:
    """The memory plan of the ranks on this host (``config``: resolved by ``decisions``),
    with the model runner's plan when ``model.path`` exists, against ``host`` (read when not
    given) or, for ``parallel.device = cuda``, each rank's device. Raises ConfigError."""
    chosen = {d.field: d.chosen for d in decisions}
    plan = None
    path = config.model.path
    if path is not None and Path(path).exists():
        runner = registry.get("model_runner", chosen["model.runner"], "model.runner").load()
        plan = runner.plan(config)
    if plan is None and config.cache.num_blocks == "auto":
        raise ConfigError(
            f"cache.num_blocks = 'auto': sizing the KV cache needs a model.path that exists "
            f"and a model runner that plans its memory ({config.model.runner!r} with "
            f"model.path = {echo(path)}); allowed: a number of blocks"
        )
    executor = registry.get(
        "executor", chosen["parallel.distributed_executor_backend"], "executor"
    ).load()
    placement = ranks_on_this_host(config, executor, environ)
    if config.parallel.device == "cuda":
        return plan_device_capacity(loaded, plan, placement)
    return plan_capacity(loaded, plan, placement, host or HostMemory.read())


def _problem_lines(message: str) -> list[str]:
    """The problems of one ConfigError message (one, or an indented list under a header)."""
    lines = message.splitlines()
    if len(lines) > 1 and lines[0].endswith(":"):
        return [line.strip() for line in lines[1:] if line.strip()]
    return [message]


def _with_source(loaded: LoadedConfig, problem: str) -> str:
    """``problem`` prefixed with the source of the field it starts with (``field = value``),
    unless it already names a source."""
    match = re.match(r"([a-z_]+\.[a-z_]+) = ", problem)
    return f"{loaded.source_of(match.group(1))}: {problem}" if match else problem
