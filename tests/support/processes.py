"""The processes a test's own process started, read from /proc."""

from __future__ import annotations

from pathlib import Path


def descendant_commands(pid: int) -> dict[int, str]:
    """Live (not zombie) descendants of ``pid`` (its children, theirs, and so on: ranks are
    forked by a fork server the driver started): process id -> command line."""
    parents, commands = {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        if fields[0] != "Z":
            parents[int(entry.name)] = int(fields[1])
            commands[int(entry.name)] = command
    found, frontier = {}, {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found |= {child: commands[child] for child in frontier}
    return found
