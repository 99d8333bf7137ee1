"""The top-level package: vLLM-style imports without paying for torch on ``import shardline``."""

import subprocess
import sys

import pytest


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_import_shardline_does_not_import_torch():
    result = _run("import sys, shardline; print('torch' in sys.modules)")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_llm_and_sampling_params_import_from_the_top_level_package():
    result = _run(
        "from shardline import LLM, SamplingParams\n"
        "from shardline.engine import LLM as E_LLM, SamplingParams as E_SP\n"
        "assert LLM is E_LLM and SamplingParams is E_SP\n"
        "import shardline\n"
        "assert {'LLM', 'SamplingParams'} <= set(dir(shardline)) & set(shardline.__all__)\n"
    )
    assert result.returncode == 0, result.stderr


def test_an_unknown_name_is_an_attribute_error():
    import shardline

    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        shardline.Nope  # noqa: B018
