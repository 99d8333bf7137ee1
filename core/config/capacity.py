"""Whether a job fits the host it starts on, decided before any process starts or anything is
allocated: the model's plan (:meth:`ModelRunner.plan`) for the ranks that run on this host,
plus a process each, against the memory the host has and ``cache.memory_fraction``.

With ``parallel.device = cuda`` each rank is planned against the free memory of its own
device instead (:func:`plan_device_capacity`).

``cache.num_blocks: auto`` is sized here: the largest KV cache the budget leaves, at most
what ``scheduler.max_num_seqs`` sequences of ``max_model_len`` tokens can use.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from shardline.config.loader import LoadedConfig
from shardline.config.schema import CacheConfig, EngineConfig
from shardline.errors import ConfigError
from shardline.interfaces import Executor, ModelPlan, RankMemory

DEFAULT_MEMORY_FRACTION = CacheConfig.model_fields["memory_fraction"].default

#: A rank process before it loads anything (Python, torch, Shardline): about 230 MB resident
#: measured on Linux x86-64 with torch 2.13 (CPU build), rounded up.
PROCESS_BYTES = 256 << 20

_MEMINFO = Path("/proc/meminfo")
#: cgroup v2 and v1 limit and usage files, as seen from inside the job's cgroup.
_CGROUP_FILES = (
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
    (
        Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
        Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ),
)


@dataclass(frozen=True)
class HostMemory:
    """The memory this host can give a new job now: ``available`` bytes, and where the
    figure comes from."""

    available: int
    source: str

    @classmethod
    def read(cls) -> HostMemory:
        """``MemAvailable`` of ``/proc/meminfo``, or what the cgroup's limit leaves when
        that is less."""
        available, source = _mem_available(), "MemAvailable of /proc/meminfo"
        for limit_file, usage_file in _CGROUP_FILES:
            try:
                limit_text = limit_file.read_text().strip()
                usage = int(usage_file.read_text())
            except (OSError, ValueError):
                continue
            if limit_text.isdigit() and int(limit_text) - usage < available:
                available = max(0, int(limit_text) - usage)
                source = f"the cgroup limit ({limit_file})"
        return cls(available, source)

    @classmethod
    def of_device(cls, index: int) -> HostMemory:
        """The free memory of ``cuda:{index}`` now (``torch.cuda.mem_get_info``)."""
        import torch

        free, _total = torch.cuda.mem_get_info(index)
        return cls(free, f"free memory of cuda:{index}")


def _mem_available() -> int:
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    raise ConfigError("cannot read MemAvailable from /proc/meminfo to plan the job's memory")


def check_rank_processes(count: int, what: str, host: HostMemory | None = None) -> None:
    """Refuse to start ``count`` rank processes (for ``what``, e.g. ``--world-sizes 64``) that
    this host cannot hold: each costs :data:`PROCESS_BYTES`, all of them at most the default
    ``cache.memory_fraction`` of the memory it has. Raises ConfigError with the figures."""
    host = host or HostMemory.read()
    budget = int(host.available * DEFAULT_MEMORY_FRACTION)
    if count * PROCESS_BYTES <= budget:
        return
    raise ConfigError(
        f"{what}: {count} rank processes need {size_text(count * PROCESS_BYTES)} "
        f"({size_text(PROCESS_BYTES)} each before loading anything); this host has "
        f"{size_text(host.available)} available ({host.source}), {DEFAULT_MEMORY_FRACTION:g} of "
        f"it allows {size_text(budget)}; allowed: at most {budget // PROCESS_BYTES} ranks here"
    )


def checked_world_sizes(flag: str, raw: str) -> list[int]:
    """The world sizes of ``flag`` (``1,2,4``): positive, and as many rank processes as the
    largest fit this host (:func:`check_rank_processes`); else ConfigError naming ``flag``."""
    try:
        sizes = [int(part) for part in raw.split(",") if part.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ConfigError(
            f"{flag} = {raw!r}: allowed: comma-separated positive integers, e.g. 1,2,4",
            field=flag,
        )
    check_rank_processes(max(sizes), f"{flag} {raw}")
    return sizes


@dataclass(frozen=True)
class HostRanks:
    """The ranks of the world that run on this host, those that are new processes (each
    costs :data:`PROCESS_BYTES`), and how that was decided."""

    ranks: tuple[int, ...]
    new_processes: frozenset[int]
    why: str


def ranks_on_this_host(
    config: EngineConfig, executor: type[Executor], environ: Mapping[str, str]
) -> HostRanks:
    """Under a launcher, the launcher's ranks on this host (this process already exists):
    every rank where its local ranks are the world's, else the run of as many ranks around
    this one that its local rank gives (a launcher need not number a host's ranks in world
    order: mpiexec oversubscribing two cores with four ranks gave world rank 1 local rank 2;
    the run is then moved to fit the world, which keeps the count and this rank); otherwise
    ranks are spread evenly over ``parallel.nnodes`` hosts, this host taking the first share,
    and an executor that owns processes starts one per rank."""
    world = config.parallel.world_size
    if executor.launched:
        from shardline.launch.launcher_env import LaunchedRank

        launched = LaunchedRank.from_environ(environ)
        size = min(launched.local_world_size, world)
        lowest, highest = max(0, launched.rank - size + 1), min(launched.rank, world - size)
        first = min(max(launched.rank - launched.local_rank, lowest), highest)
        ranks = tuple(range(first, first + size))
        return HostRanks(
            ranks,
            frozenset(ranks) - {launched.rank},
            f"{len(ranks)} ranks on this host ({launched.launcher})",
        )
    per_host = max(1, world // config.parallel.nnodes)
    ranks = tuple(range(per_host))
    spawned = frozenset(ranks) if executor.owns_processes else frozenset()
    where = "this host" if config.parallel.nnodes == 1 else "each host"
    kind = "a process each" if executor.owns_processes else "in this process"
    return HostRanks(ranks, spawned, f"{per_host} of {world} ranks on {where}, {kind}")


@dataclass(frozen=True)
class RankShare:
    """What each rank of one (pipeline stage, tensor-parallel rank) position holds on this
    host; ``ranks`` are those positions' ranks here, ``new_processes`` how many of them are
    started for the job."""

    ranks: tuple[int, ...]
    pp_rank: int
    tp_rank: int
    memory: RankMemory
    kv_cache: int
    new_processes: int

    @property
    def peak(self) -> int:
        """The most one of these ranks holds, its process not included."""
        memory = self.memory
        return memory.weights + self.kv_cache + max(memory.loading, memory.activations)

    @property
    def total(self) -> int:
        return len(self.ranks) * self.peak + self.new_processes * PROCESS_BYTES


@dataclass(frozen=True)
class CapacityPlan:
    """The job's memory on this host (see the module docstring). Without a model plan,
    ``num_blocks`` is the config's and ``max_model_len`` None."""

    host: HostMemory
    memory_fraction: float
    num_blocks: int | str
    max_model_len: int | None
    shares: tuple[RankShare, ...]
    placement: HostRanks

    @property
    def budget(self) -> int:
        return int(self.host.available * self.memory_fraction)

    @property
    def total(self) -> int:
        return sum(share.total for share in self.shares)

    @property
    def headroom(self) -> int:
        return self.budget - self.total


def plan_capacity(
    loaded: LoadedConfig, plan: ModelPlan | None, placement: HostRanks, host: HostMemory
) -> CapacityPlan:
    """The plan, or one ConfigError naming the field at fault, its source, the figures and
    what would fit. Without a model plan only the rank processes are counted."""
    config = loaded.config
    cache, scheduler = config.cache, config.scheduler
    if plan is None:
        shares = _shares(config, _NoModel(), placement, 0, 0)
        result = CapacityPlan(
            host, cache.memory_fraction, cache.num_blocks, None, shares, placement
        )
        problem = _memory_problem(loaded, result, auto=False)
        if problem is not None:
            raise ConfigError(problem)
        return result
    block_size = cache.block_size
    problems = []
    requested_len = scheduler.max_model_len
    if requested_len is not None and requested_len > plan.context_length:
        problems.append(
            f"{loaded.source_of('scheduler.max_model_len')}: scheduler.max_model_len = "
            f"{requested_len}: the model's context is {plan.context_length} tokens; allowed: "
            f"1..{plan.context_length}"
        )
        requested_len = plan.context_length
    longest = requested_len or plan.context_length
    useful_blocks = math.ceil(longest / block_size) * scheduler.max_num_seqs
    budget = int(host.available * cache.memory_fraction)
    auto = cache.num_blocks == "auto"
    num_blocks = useful_blocks if auto else int(cache.num_blocks)
    max_model_len = min(longest, num_blocks * block_size)
    shares = _shares(config, plan, placement, num_blocks, max_model_len)
    if auto:
        fixed = sum(s.total - len(s.ranks) * s.kv_cache for s in shares)
        per_block = sum(len(s.ranks) * s.memory.kv_cache_block for s in shares)
        fitting = (budget - fixed) // per_block if per_block else useful_blocks
        num_blocks = max(0, min(useful_blocks, fitting))
        max_model_len = min(longest, num_blocks * block_size)
        shares = _shares(config, plan, placement, num_blocks, max_model_len)
    capacity = num_blocks * block_size
    if requested_len is not None and requested_len > capacity and num_blocks > 0:
        problems.append(
            f"{loaded.source_of('scheduler.max_model_len')}: scheduler.max_model_len = "
            f"{requested_len}: the KV cache holds {capacity} tokens (cache.num_blocks "
            f"{num_blocks} x cache.block_size {block_size}); raise cache.num_blocks or lower it"
        )
    result = CapacityPlan(host, cache.memory_fraction, num_blocks, max_model_len, shares, placement)
    memory = _memory_problem(loaded, result, auto)
    if memory is not None:
        problems.append(memory)
    if len(problems) == 1:
        raise ConfigError(problems[0])
    if problems:
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(problems))
    return result


def plan_device_capacity(
    loaded: LoadedConfig,
    plan: ModelPlan | None,
    placement: HostRanks,
    memory_of: Callable[[int], HostMemory] = HostMemory.of_device,
) -> CapacityPlan:
    """The plan of ranks that each hold their weights, KV cache and activations on a device of
    their own (``parallel.device = cuda``: the ``i``-th rank on this host on ``cuda:i``, whose
    memory is ``memory_of(i)``). Each rank is planned against its device alone (its process
    stays on the host, checked by :func:`check_rank_processes`); the tightest plan is
    returned: the fewest KV blocks (``auto`` gives every rank that many), then the least
    headroom. A rank that does not fit raises ConfigError, as :func:`plan_capacity` does."""
    check_rank_processes(len(placement.new_processes), "the ranks on this host")
    plans = [
        plan_capacity(
            loaded,
            plan,
            HostRanks((rank,), frozenset(), f"rank {rank} on cuda:{index}, a device of its own"),
            memory_of(index),
        )
        for index, rank in enumerate(placement.ranks)
    ]
    return min(plans, key=lambda p: (int(p.num_blocks), p.headroom))


class _NoModel(ModelPlan):
    """The plan of a job without a model plan: nothing but the rank processes."""

    context_length = 0

    def rank_memory(
        self, pp_rank: int, tp_rank: int, max_model_len: int, cache_tokens: int
    ) -> RankMemory:
        return RankMemory(0, 0, 0, 0)


def _shares(
    config: EngineConfig,
    plan: ModelPlan,
    placement: HostRanks,
    num_blocks: int,
    max_model_len: int,
) -> tuple[RankShare, ...]:
    layout = config.parallel.layout
    cache_tokens = num_blocks * config.cache.block_size
    by_position: dict[tuple[int, int], list[int]] = {}
    for rank in placement.ranks:
        where = layout.coordinates(rank)
        by_position.setdefault((where.pp, where.tp), []).append(rank)
    shares = []
    for (pp_rank, tp_rank), ranks in sorted(by_position.items()):
        memory = plan.rank_memory(pp_rank, tp_rank, max_model_len, cache_tokens)
        shares.append(
            RankShare(
                tuple(ranks),
                pp_rank,
                tp_rank,
                memory,
                num_blocks * memory.kv_cache_block,
                sum(1 for rank in ranks if rank in placement.new_processes),
            )
        )
    return tuple(shares)


def _memory_problem(loaded: LoadedConfig, plan: CapacityPlan, auto: bool) -> str | None:
    """Why the plan does not fit the budget (or leaves no KV cache), naming the field to
    change, or None."""
    fixed = plan.total - sum(len(s.ranks) * s.kv_cache for s in plan.shares)
    figures = (
        f"{_describe_need(plan)}; this host has {size_text(plan.host.available)} available "
        f"({plan.host.source}) and cache.memory_fraction = {plan.memory_fraction:g} allows "
        f"{size_text(plan.budget)}"
    )
    ranks = len(plan.placement.ranks)
    if fixed > plan.budget or (auto and plan.num_blocks == 0):
        if plan.max_model_len is None:
            return (
                f"{_layout_source(loaded)}: the ranks do not fit this host: {figures}; "
                f"allowed: fewer ranks on this host ({ranks} now), more hosts "
                "(parallel.nnodes), or a higher cache.memory_fraction"
            )
        return (
            f"{_layout_source(loaded)}: the model does not fit this host: {figures}, before "
            f"any KV cache; allowed: fewer ranks on this host ({ranks} now), more hosts "
            "(parallel.nnodes), a smaller model.dtype, or a higher cache.memory_fraction"
        )
    if plan.total <= plan.budget:
        return None
    per_block = sum(len(s.ranks) * s.memory.kv_cache_block for s in plan.shares)
    fitting = (plan.budget - fixed) // per_block
    return (
        f"{loaded.source_of('cache.num_blocks')}: cache.num_blocks = {plan.num_blocks}: the "
        f"job does not fit this host: {figures}; allowed: cache.num_blocks <= {fitting} here, "
        "or cache.num_blocks: auto (sized to fit)"
    )


def _layout_source(loaded: LoadedConfig) -> str:
    """The sources of the layout sizes that were set (``default`` when none was)."""
    fields = ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes")
    sources = {loaded.sources[f"parallel.{f}"] for f in fields if f"parallel.{f}" in loaded.sources}
    return ", ".join(sorted(sources)) or "default"


def _describe_need(plan: CapacityPlan) -> str:
    share = max(plan.shares, key=lambda s: s.peak)
    memory = share.memory
    if plan.max_model_len is None:
        return (
            f"{_count(len(plan.placement.new_processes), 'rank process', 'rank processes')} "
            f"{size_text(plan.total)} "
            f"({size_text(PROCESS_BYTES)} each before loading anything)"
        )
    ranks = _count(len(plan.placement.ranks), "rank", "ranks")
    return (
        f"{ranks} {size_text(plan.total)} (the largest rank: weights "
        f"{size_text(memory.weights)}, KV cache {size_text(share.kv_cache)} = "
        f"{plan.num_blocks} blocks x {size_text(memory.kv_cache_block)}, the larger of "
        f"loading {size_text(memory.loading)} and activations "
        f"{size_text(memory.activations)}, process {size_text(PROCESS_BYTES)})"
    )


def _count(number: int, singular: str, plural: str) -> str:
    """``"1 rank needs"`` / ``"2 ranks need"``."""
    return f"{number} {singular} needs" if number == 1 else f"{number} {plural} need"


def size_text(size: int) -> str:
    """Bytes in the largest binary unit that keeps the figure at least 1 (``1.5 GiB``)."""
    value, unit = float(size), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(value) < 1024:
            break
        value, unit = value / 1024, larger
    return f"{value:,.1f} {unit}" if unit != "B" else f"{size} B"
