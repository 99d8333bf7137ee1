"""``shardline models``: the model catalog, what is cached, and fetching a model by name."""

from __future__ import annotations

from pathlib import Path

from shardline import catalog
from shardline.cli.table import render


def pull(name: str, cache_dir: Path | None) -> int:
    """Fetches catalog model ``name`` into ``cache_dir`` (if missing) and prints its path."""
    print(catalog.pull(name, cache_dir, catalog.ProgressBar(f"extracting {name}")))
    return 0


def list_models(cache_dir: Path | None) -> int:
    """Prints every catalog model: whether it is cached (and verified), its size and path."""
    cached = {entry.model.name: entry for entry in catalog.list_cached(cache_dir)}
    rows = []
    for name in catalog.known_names():
        entry = cached.get(name)
        if entry is None:
            state, size = "no", "-"
        else:
            state = "yes" if entry.verified else "checksum mismatch (pull again)"
            size = f"{entry.size / (1 << 20):.1f} MiB"
        rows.append((name, state, size, catalog.cached_path(name, cache_dir)))
    print(render(("MODEL", "CACHED", "SIZE", "PATH"), rows))
    return 0
