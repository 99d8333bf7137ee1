"""Installs throw-away plugin distributions on sys.path: a dist-info folder with an
``entry_points.txt`` and a plugin module, exactly what pip would leave behind."""

from __future__ import annotations

import textwrap
from pathlib import Path


def install_plugin(root: Path, dist: str, entry_name: str, module: str, source: str) -> None:
    """Write module ``module`` with ``source`` and a distribution ``dist`` whose
    ``shardline.plugins`` entry point ``entry_name`` points at it."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[shardline.plugins]\n{entry_name} = {module}\n")


COMMUNICATOR_PLUGIN = """
from shardline.interfaces import Capabilities
from shardline.registry import Component, hookimpl

@hookimpl
def shardline_communicators():
    return [Component(name={name!r}, target="shardline_gloo.communicator:GlooBackend",
                      summary="test double of gloo", capabilities=Capabilities())]
"""
