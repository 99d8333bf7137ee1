"""A job's own shared-memory segments (Shardline names them ``shardline-<job>-...``)."""

from pathlib import Path


def job_segments(job: str) -> list[str]:
    """The names of job ``job``'s segments in /dev/shm now; other jobs' are not looked at."""
    return sorted(path.name for path in Path("/dev/shm").glob(f"shardline-{job}-*"))
