"""Where this machine has the C compiler Python builds with, pip built every C extension.

The extensions are optional in pyproject.toml (a machine without a compiler runs the pure-Python
paths), so pip leaves out one that does not compile without a word, and the tests of its C
path then skip as if there were no compiler. Here a compile error fails instead."""

import importlib
import shutil
import sysconfig
import tomllib

import pytest

from support.cli import ROOT

#: The extensions pyproject.toml declares.
EXTENSIONS = [
    module["name"]
    for module in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "ext-modules"
    ]
]
COMPILER = (sysconfig.get_config_var("CC") or "").split()[:1]


@pytest.mark.skipif(
    not COMPILER or shutil.which(COMPILER[0]) is None,
    reason=f"no C compiler ({COMPILER or 'CC unset'}) here: the extensions are optional",
)
@pytest.mark.parametrize("name", EXTENSIONS)
def test_every_c_extension_is_built_where_a_compiler_is(name):
    try:
        importlib.import_module(name)
    except ImportError as error:
        pytest.fail(
            f"{name} is not built though {COMPILER[0]} is here: pip leaves out an optional "
            f"extension that does not compile; build it by hand to see why ({error})"
        )


def test_pyproject_declares_the_extensions_the_c_paths_load():
    assert set(EXTENSIONS) == {
        "shardline_custom_allreduce._native",
        "shardline_mpi._native",
        "shardline_executors._ring_native",
        "shardline.layers._kernels",
        "shardline.weights._dequantize",
    }
