"""Binding the ranks started on one host to sets of its cores (``parallel.cpu_binding``).

Where ranks and a driver outnumber the cores, the scheduler's placement decides a round
trip: a driver that shares a core with the rank that replies waits for it and takes its time
slices (an empty ``mp`` step 93-112 us against 15 us beside the other rank, 2 workers on 2
cores). ``auto`` splits the cores this process may use into one contiguous set per rank on
the host, in rank order, and an ``mp`` driver joins the last rank's set (a rank that does not
reply; see the executors). An explicit value names each rank's cores. Binding is opt-in: on a
host shared with other jobs the scheduler may know better, and two jobs that both bind
``auto`` start on the same cores.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass

from shardline.errors import ConfigError

NONE, AUTO = "none", "auto"
_FIELD = "parallel.cpu_binding"
#: The largest core number an explicit binding may name (Linux's largest CPU count, 8192,
#: less one), and the most cores its sets may name together (so no value builds a huge set).
MAX_CORE = 8191
MAX_NAMED_CORES = 1 << 16
_NUMBER = re.compile(r"[0-9]{1,5}")
_ALLOWED = (
    "allowed: 'none', 'auto', or one set of cores per rank on the host, '|' between sets, "
    "each a comma-separated list of cores and ranges ('0-3|4-7', '0,2|1,3')"
)


@dataclass(frozen=True)
class CoreBinding:
    """``parallel.cpu_binding`` parsed: ``text`` as written, ``mode`` none, auto or explicit,
    and an explicit binding's core sets, one per rank on the host in local rank order."""

    text: str
    mode: str
    core_sets: tuple[frozenset[int], ...] = ()

    @classmethod
    def parse(cls, text: str) -> CoreBinding:
        """The binding ``text`` says; ValueError naming the value and what is allowed."""
        if text in (NONE, AUTO):
            return cls(text, text)
        try:
            ranges = [_core_ranges(part) for part in text.split("|")]
            named = sum(high - low + 1 for part in ranges for low, high in part)
            if named > MAX_NAMED_CORES:
                raise ValueError(f"its sets name {named} cores, more than {MAX_NAMED_CORES}")
            sets = tuple(
                frozenset(core for low, high in part for core in range(low, high + 1))
                for part in ranges
            )
        except ValueError as error:
            raise ValueError(f"cpu_binding = {text!r}: {error}; {_ALLOWED}") from None
        return cls(text, "explicit", sets)

    def core_sets_for(
        self, ranks_on_host: int, allowed: Iterable[int] | None = None
    ) -> list[frozenset[int]] | None:
        """The cores each of ``ranks_on_host`` local ranks runs on, out of ``allowed`` (None:
        the cores this process may use); None: not bound. ConfigError when an explicit binding's
        sets are not one per rank or name a core not allowed."""
        if self.mode == NONE:
            return None
        cores = sorted(os.sched_getaffinity(0) if allowed is None else allowed)
        if self.mode == AUTO:
            return auto_core_sets(cores, ranks_on_host)
        written = f"{_FIELD} = {self.text!r}"
        if len(self.core_sets) != ranks_on_host:
            raise ConfigError(
                f"{written} names {len(self.core_sets)} core sets for {ranks_on_host} ranks on "
                "this host; allowed: one set per rank, '|' between sets",
                field=_FIELD,
            )
        outside = sorted(set().union(*self.core_sets) - set(cores))
        if outside:
            raise ConfigError(
                f"{written} names cores this process may not run on ({_ranges(outside)}); "
                f"allowed: {_ranges(cores)}",
                field=_FIELD,
            )
        return list(self.core_sets)


def auto_core_sets(cores: list[int], ranks: int) -> list[frozenset[int]]:
    """``cores`` split into ``ranks`` contiguous sets in order, the first sets one core
    larger where they do not divide evenly; with fewer cores than ranks, rank i gets core
    i mod cores alone."""
    if len(cores) < ranks:
        return [frozenset({cores[rank % len(cores)]}) for rank in range(ranks)]
    share, extra = divmod(len(cores), ranks)
    sets, start = [], 0
    for rank in range(ranks):
        size = share + (1 if rank < extra else 0)
        sets.append(frozenset(cores[start : start + size]))
        start += size
    return sets


def bind_process(cores: Iterable[int]) -> frozenset[int]:
    """Bind every thread of this process to ``cores`` (threads started later inherit it);
    returns the cores this process could use before."""
    before = frozenset(os.sched_getaffinity(0))
    for thread in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(thread), set(cores))
    return before


def _core_ranges(text: str) -> list[tuple[int, int]]:
    """The ranges of cores (first, last) a set's text names."""
    ranges = []
    for item in text.split(","):
        first, dash, last = item.strip().partition("-")
        if not (_NUMBER.fullmatch(first) and (_NUMBER.fullmatch(last) if dash else not last)):
            raise ValueError(f"{item.strip()!r} is not a core or a range of cores")
        low, high = int(first), int(last or first)
        if high < low:
            raise ValueError(f"the range {item.strip()!r} ends before it starts")
        if high > MAX_CORE:
            raise ValueError(f"{item.strip()!r} names a core above {MAX_CORE}")
        ranges.append((low, high))
    return ranges


def _ranges(cores: list[int]) -> str:
    """``cores`` (sorted) written as ranges: 0-3,6."""
    runs: list[list[int]] = []
    for core in cores:
        if runs and core == runs[-1][1] + 1:
            runs[-1][1] = core
        else:
            runs.append([core, core])
    return ",".join(f"{low}-{high}" if high > low else str(low) for low, high in runs)
