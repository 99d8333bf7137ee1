"""The options of ``shardline bench comm`` (:mod:`.bench_cmd`), checked before anything
starts: every refusal names the option and comes without importing torch (only a dtype that
passes the other checks is looked up in torch)."""

from __future__ import annotations

from dataclasses import dataclass

from shardline.cli.flags import MAX_REPEATS, check_count, check_host_memory, check_seconds
from shardline.config.capacity import check_rank_processes
from shardline.errors import ConfigError
from shardline.registry import Registry

OPERATIONS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")


@dataclass(frozen=True)
class BenchSettings:
    communicators: tuple[str, ...]
    ranks: int
    begin: int
    end: int
    factor: int
    operations: tuple[str, ...]
    warmup: int
    iterations: int
    dtype: str
    timeout_s: float
    back_to_back: bool = False
    python_fallback: tuple[str, ...] = ()

    @property
    def columns(self) -> tuple[str, ...]:
        """The table's communicator columns: each communicator, then each fallback run."""
        return self.communicators + tuple(f"{name}/py" for name in self.python_fallback)


def parse_size(text: str, field: str) -> int:
    """``4``, ``64K``, ``16M``, ``1G`` (powers of 1024) -> bytes; ConfigError otherwise."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    raw = text.strip().upper().removesuffix("B")
    number, unit = (raw[:-1], raw[-1]) if raw and raw[-1] in units else (raw, "")
    try:
        value = int(number) * units[unit]
    except ValueError:
        value = 0
    if value <= 0:
        raise ConfigError(f"{field} = {text!r}: expected a positive size such as 4, 64K or 16M")
    return value


def settings_from(args) -> BenchSettings:
    """Validated settings from the command line; ConfigError names the bad option."""
    operations = tuple(op.strip() for op in args.ops.split(",") if op.strip())
    unknown = [op for op in operations if op not in OPERATIONS]
    if unknown or not operations:
        raise ConfigError(f"--ops = {args.ops!r}: allowed: {', '.join(OPERATIONS)}")
    if args.ranks < 1:
        raise ConfigError(f"-n = {args.ranks}: allowed: 1 or more ranks")
    if args.factor < 2:
        raise ConfigError(f"-f = {args.factor}: allowed: 2 or more")
    check_count("-i", args.iters, 1, MAX_REPEATS)
    check_count("-w", args.warmup, 0, MAX_REPEATS)
    check_seconds("--timeout", args.timeout)
    begin, end = parse_size(args.begin, "-b"), parse_size(args.end, "-e")
    if end < begin:
        raise ConfigError(f"-e {args.end} is below -b {args.begin}")
    check_rank_processes(args.ranks, f"-n {args.ranks}")
    # Each rank holds its input, an output and, for all_gather, every rank's part.
    check_host_memory(
        f"-e {args.end} with -n {args.ranks}: the tensors",
        args.ranks * end * (args.ranks + 2),
        "a smaller -e or -n",
    )
    communicators = tuple(c.strip() for c in args.communicators.split(",") if c.strip())
    registry = Registry.load()
    for name in communicators:  # known names; whether each runs here is the run's to say
        registry.get("communicator", name, "--communicators")
    fallback = tuple(c.strip() for c in args.python_fallback.split(",") if c.strip())
    if set(fallback) - set(communicators):
        raise ConfigError(
            f"--python-fallback = {args.python_fallback!r}: allowed: names given to -c "
            f"({', '.join(communicators)})"
        )
    import torch  # the last check: the run needs it anyway

    if not isinstance(getattr(torch, args.dtype, None), torch.dtype):
        raise ConfigError(f"--dtype = {args.dtype!r}: allowed: float32, float16, bfloat16, ...")
    return BenchSettings(
        communicators=communicators,
        ranks=args.ranks,
        begin=begin,
        end=end,
        factor=args.factor,
        operations=operations,
        warmup=args.warmup,
        iterations=args.iters,
        dtype=args.dtype,
        timeout_s=args.timeout,
        back_to_back=args.back_to_back,
        python_fallback=fallback,
    )


def sizes(settings: BenchSettings) -> list[int]:
    result, size = [], settings.begin
    while size <= settings.end:
        result.append(size)
        size *= settings.factor
    return result
