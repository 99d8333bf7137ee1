"""Plugins use the published surface only: the built-in plugins and the example third-party
plugin import nothing of Shardline but ``shardline.interfaces``, ``shardline.errors``,
``shardline.registry`` and ``shardline.sdk``; every SDK name resolves; and the core names no
built-in plugin package."""

import ast
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

import shardline.sdk

ROOT = Path(__file__).resolve().parents[1]
PUBLISHED = {"shardline.interfaces", "shardline.errors", "shardline.registry", "shardline.sdk"}
PLUGIN_SOURCES = sorted(
    path
    for path in [*ROOT.joinpath("plugins").rglob("*.py"), *ROOT.joinpath("examples").rglob("*.py")]
    if "build" not in path.relative_to(ROOT).parts  # a pip build's copy is not a source
)
BUILT_IN_PACKAGES = (
    "shardline_gloo",
    "shardline_nccl",
    "shardline_mpi",
    "shardline_executors",
    "shardline_ray",
)


def _shardline_imports(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import of a ``shardline`` module in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        else:
            continue
        found += [
            (node.lineno, module)
            for module in modules
            if module == "shardline" or module.startswith("shardline.")
        ]
    return found


@pytest.mark.parametrize("path", PLUGIN_SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_plugins_import_only_the_published_surface(path):
    outside = [f"line {line}: {module}" for line, module in _shardline_imports(path)]
    outside = [entry for entry in outside if entry.split(": ")[1] not in PUBLISHED]
    assert not outside, f"{path.relative_to(ROOT)} imports beyond the plugin SDK: {outside}"


def test_the_check_sees_an_import_beyond_the_sdk(tmp_path):
    plugin = tmp_path / "plugin.py"
    plugin.write_text("from shardline.comm.watchdog import REPORT_GRACE_S\nimport shardline.sdk\n")
    assert _shardline_imports(plugin) == [(1, "shardline.comm.watchdog"), (2, "shardline.sdk")]


@pytest.mark.parametrize("name", shardline.sdk.__all__)
def test_every_sdk_name_resolves(name):
    assert getattr(shardline.sdk, name) is not None


def test_importing_the_sdk_for_registration_and_loading_a_config_stay_cheap():
    program = (
        "import sys\n"
        "from shardline.interfaces import Capabilities\n"
        "from shardline.registry import Component, hookimpl\n"
        "import shardline.sdk\n"
        "from shardline.config import load_config\n"
        "load_config(overrides=['parallel.tensor_parallel_size=2'], environ={})\n"
        "print('torch' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True)
    assert done.stdout.strip() == "False", done.stderr


def test_the_core_imports_no_built_in_plugin():
    for path in ROOT.joinpath("core").rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            names = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [alias.name for alias in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                assert not name.startswith((*BUILT_IN_PACKAGES, "shardline_custom")), (
                    f"{path.relative_to(ROOT)} imports {name}"
                )


def test_loaded_reply_raises_or_returns_the_executors_envelope_for_a_reply_that_does_not_load():
    reply = pickle.dumps(("ok", 7))
    assert shardline.sdk.loaded_reply(reply) == ("ok", 7)
    assert shardline.sdk.loaded_reply(reply, failed=lambda failure: "unused") == ("ok", 7)
    broken = b"not a pickle"
    with pytest.raises(TypeError, match="the reply cannot be loaded where it arrived: "):
        shardline.sdk.loaded_reply(broken)
    kind, failure = shardline.sdk.loaded_reply(broken, failed=lambda failure: ("error", failure))
    assert kind == "error"
    assert failure.exc_type == "TypeError"
    assert failure.message.startswith("the reply cannot be loaded where it arrived: ")
    assert "UnpicklingError" in failure.traceback  # the cause travels with it
