"""A job's own shared-memory segments (Shardline names them ``shardline-<job>-...``)."""

from pathlib import Path


def job_segments(job: str) -> list[str]:
    """The names of job ``job``'s segments in /dev/shm now; other jobs' are not looked at."""
    return sorted(path.name for path in Path("/dev/shm").glob(f"shardline-{job}-*"))


def unnamed_segments(pids: list[int]) -> set[str]:
    """The names /dev/shm segments mapped by the processes ``pids`` had before they were
    unlinked (in use, but nothing left in /dev/shm)."""
    found = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            fields = line.split(maxsplit=5)
            path = fields[5] if len(fields) == 6 else ""
            if path.startswith("/dev/shm/") and path.endswith(" (deleted)"):
                found.add(path.removeprefix("/dev/shm/").removesuffix(" (deleted)"))
    return found
