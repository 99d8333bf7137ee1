"""The processes a test's own process started, read from /proc."""

from __future__ import annotations

from pathlib import Path


def child_commands(pid: int) -> dict[int, str]:
    """Live (not zombie) children of ``pid``: process id -> command line."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found[int(entry.name)] = command
    return found
