"""The ``shardline`` command as a user runs it: tables, explanations, one-line errors."""

import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shardline.cli.main import build_parser, dispatch
from shardline.errors import ConfigError
from support.cli import ROOT, SHARDLINE, shardline
from support.fake_plugins import install_plugin
from support.tiny_gguf import write_tiny_gguf

EXAMPLE = str(ROOT / "examples" / "configs" / "tp2-pp2-gloo.yaml")


def _no_traceback(result):
    assert "Traceback" not in result.stderr + result.stdout


def test_plugins_lists_gloo_as_available():
    result = shardline("plugins")
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("gloo "))
    assert "communicator gloo" in row and "available" in row


def test_plugins_reports_a_broken_plugin_by_name_and_strict_makes_it_fatal(tmp_path):
    install_plugin(
        tmp_path, "broken-dist", "broken", "broken_plugin", "raise ImportError('libfoo.so missing')"
    )
    env = {"PYTHONPATH": str(tmp_path)}
    result = shardline("plugins", env=env)
    assert result.returncode == 1
    assert "failed to load: ImportError: libfoo.so missing" in result.stdout
    assert "communicator gloo" in result.stdout
    strict = shardline("plugins", env={**env, "SHARDLINE_STRICT_PLUGINS": "1"})
    assert strict.returncode == 2
    assert strict.stderr.startswith("error: plugin 'broken' (broken_plugin) failed to load")
    _no_traceback(strict)


def test_explain_shows_layout_choice_and_sources():
    result = shardline("explain", "--config", EXAMPLE)
    assert result.returncode == 0, result.stderr
    assert "tp groups: [[0, 1], [2, 3]]" in result.stdout
    assert "pp groups: [[0, 2], [1, 3]]" in result.stdout
    assert "output rank 2" in result.stdout
    assert f"parallel.communicator: gloo (configured; set by {EXAMPLE})" in result.stdout


def test_explain_and_config_for_run_and_serve_apply_their_built_in_config():
    """``--for run`` (``serve``) shows what that command would run: its built-in layer
    (SmolLM2, TP=2, auto backends) under the file and ``--set``."""
    explained = shardline("explain", "--for", "run", "--set", "parallel.communicator=gloo")
    assert explained.returncode == 0, explained.stderr
    assert "world size 2" in explained.stdout
    assert "set by built-in run config" in explained.stdout
    assert "parallel.communicator: gloo (configured; set by --set" in explained.stdout
    shown = shardline("config", "show", "--for", "serve")
    assert shown.returncode == 0, shown.stderr
    assert re.search(r'model\.path\s+"smollm2-135m"\s+built-in serve config', shown.stdout)
    plain = shardline("config", "show")
    assert re.search(r"parallel\.tensor_parallel_size\s+1\s+default", plain.stdout)
    valid = shardline("config", "validate", "--for", "run", "--set", "model.path=null")
    assert valid.returncode == 0, valid.stderr
    assert "(defaults, built-in run config, environment, --set): valid" in valid.stdout
    refused = shardline("explain", "--for", "demo")
    assert refused.returncode == 2 and "invalid choice: 'demo'" in refused.stderr


def test_explain_shows_which_groups_cross_hosts_and_what_carries_them():
    result = shardline(
        "explain",
        *("--set", "parallel.tensor_parallel_size=2", "--set", "parallel.pipeline_parallel_size=2"),
        *("--set", "parallel.nnodes=2", "--set", "parallel.communicator=custom_ar"),
    )
    hosts = result.stdout.split("\nhosts: ", 1)[1].split("\n\n", 1)[0].splitlines()
    assert hosts[0] == "2 (parallel.nnodes = 2, ranks numbered host by host):"
    rows = [line.split(None, 4) for line in hosts[3:]]
    assert rows == [
        ["tp", "0,1", "0", "no", "shared memory (custom_ar; gloo beyond a slot)"],
        ["tp", "2,3", "1", "no", "shared memory (custom_ar; gloo beyond a slot)"],
        ["pp", "0,2", "0,1", "yes", "gloo (custom_ar's base: the group crosses hosts)"],
        ["pp", "1,3", "0,1", "yes", "gloo (custom_ar's base: the group crosses hosts)"],
    ]
    # Here auto picks mp, which keeps every rank on this host: reported, not an error of the
    # config (under torchrun or mpiexec auto picks external_launcher).
    assert result.returncode == 0, result.stdout
    problem = "problem: parallel.distributed_executor_backend = 'mp' runs every rank on this host"
    assert f"{problem}, but parallel.nnodes = 2" in result.stdout


def test_a_single_host_executor_is_refused_for_several_hosts():
    validated = shardline(
        "config", "validate",
        *("--set", "parallel.tensor_parallel_size=2", "--set", "parallel.nnodes=2"),
        *("--set", "parallel.distributed_executor_backend=mp"),
    )  # fmt: skip
    # The ray executor spans hosts too where its plugin's requirement is installed.
    spanning = "external_launcher, ray" if importlib.util.find_spec("ray") else "external_launcher"
    assert validated.returncode == 2
    assert validated.stderr == (
        "error: --set parallel.distributed_executor_backend=mp: "
        "parallel.distributed_executor_backend = 'mp' runs every rank on this host, but "
        f"parallel.nnodes = 2; allowed: an executor whose ranks span hosts: {spanning} "
        "(external_launcher: start the ranks with torchrun or mpiexec on every host)\n"
    )


def test_explain_names_the_rejected_combination():
    result = shardline("explain", "--set", "parallel.device=cuda")
    assert result.returncode == 2
    assert "device cuda not supported (supported: cpu)" in result.stdout


def test_explain_shows_data_parallel_replicas():
    explained = shardline("explain", "--set", "parallel.data_parallel_size=2")
    assert explained.returncode == 0, explained.stdout
    assert "parallel.data_parallel_size: 2 (configured" in explained.stdout
    assert "chosen: 2 replicas x 1 ranks (tp x pp)" in explained.stdout


def test_config_show_on_a_typo_is_one_clear_message(tmp_path):
    path = tmp_path / "typo.yaml"
    path.write_text("parallel:\n  tensor_paralel_size: 2\n")
    result = shardline("config", "show", "--config", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert f"{path}: parallel.tensor_paralel_size = 2: unknown key" in result.stderr
    assert "Did you mean 'parallel.tensor_parallel_size'?" in result.stderr
    _no_traceback(result)


def test_config_show_lists_values_with_sources():
    result = shardline("config", "show", "--config", EXAMPLE, "--set", "parallel.timeout_s=12")
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines()[2:]}
    assert rows["parallel.tensor_parallel_size"][1:] == ["2", EXAMPLE]
    assert rows["parallel.timeout_s"][1] == "12.0"
    assert rows["parallel.timeout_s"][2:] == ["--set", "parallel.timeout_s=12"]
    assert rows["model.dtype"][1:] == ['"float32"', "default"]


def test_config_validate_and_schema():
    valid = shardline("config", "validate", "--config", EXAMPLE)
    assert valid.returncode == 0 and "valid (world size 4)" in valid.stdout
    unknown = shardline("config", "validate", "--set", "parallel.communicator=glo")
    assert unknown.returncode == 2
    assert (
        "parallel.communicator = 'glo'" in unknown.stderr
        and "did you mean 'gloo'?" in unknown.stderr
    )
    _no_traceback(unknown)
    schema = shardline("config", "schema")
    assert json.loads(schema.stdout)["title"] == "EngineConfig"


def test_config_validate_and_show_take_the_file_positionally():
    valid = shardline("config", "validate", EXAMPLE)
    assert valid.returncode == 0, valid.stderr
    assert f"{EXAMPLE}: valid (world size 4)" in valid.stdout
    shown = shardline("config", "show", EXAMPLE)
    assert shown.returncode == 0, shown.stderr
    rows = {line.split()[0]: line.split() for line in shown.stdout.splitlines()[2:]}
    assert rows["parallel.tensor_parallel_size"][1:] == ["2", EXAMPLE]


def test_config_file_given_positionally_and_by_option_is_one_error():
    result = shardline("config", "validate", EXAMPLE, "--config", EXAMPLE)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "give FILE or --config FILE, not both" in result.stderr
    _no_traceback(result)


def test_malformed_set_is_a_clear_error():
    result = shardline("config", "show", "--set", "parallel.tensor_parallel_size")
    assert result.returncode == 2
    assert "expected section.key=value" in result.stderr
    _no_traceback(result)


def test_demo_runs_a_checked_tp2_pp2_world():
    result = shardline("demo", "--config", EXAMPLE, "--rounds", "20", timeout=180)
    assert result.returncode == 0, result.stderr
    rows = [line for line in result.stdout.splitlines() if line[:1].isdigit()]
    assert len(rows) == 4
    assert all(row.rstrip().endswith("ok") for row in rows)
    assert "got from rank 0" in result.stdout and "sent to rank 3" in result.stdout


DAY = "allowed: more than 0, up to 86400 s"


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["bench", "comm", "-i", "1000001"], "-i = 1000001: allowed: 1..1000000"),
        (["bench", "comm", "-w", "1000001"], "-w = 1000001: allowed: 0..1000000"),
        (["bench", "comm", "--timeout", "nan"], f"--timeout = nan: {DAY}"),
        (["bench", "serve", "--timeout-s", "1e12"], f"--timeout-s = 1e+12: {DAY}"),
        (
            ["bench", "serve", "--input-len", "16777217"],
            "--input-len = 16777217: allowed: 1..16777216",
        ),
        (["bench", "serve", "-n", "0"], "--num-requests = 0: allowed: 1..1000000"),
        (["faults", "--timeout", "1e9"], f"--timeout = 1e+09: {DAY}"),
        (["faults", "--startup-timeout", "0"], f"--startup-timeout = 0: {DAY}"),
        (["conformance", "gloo", "--timeout", "inf"], f"--timeout = inf: {DAY}"),
        (["conformance", "gloo", "--world-sizes", "2,0"], "--world-sizes = '2,0': allowed: "),
        (["conformance", "uni", "--world-sizes", "-1"], "--world-sizes = '-1': allowed: "),
        (["conformance", "gloo", "--world-sizes", ""], "--world-sizes = '': allowed: "),
        (["conformance", "gloo", "--world-sizes", "abc"], "--world-sizes = 'abc': allowed: "),
        (["demo", "--rounds", "0"], "--rounds = 0: allowed: 1..1000000"),
        (["bench", "comm", "-n", "0"], "-n = 0: allowed: 1 or more ranks"),
        (
            ["bench", "comm", "--json", "/nonexistent/c.json"],
            "--json = '/nonexistent/c.json': its folder '/nonexistent' does not exist; allowed: ",
        ),
        (["bench", "decode", "--json", "/tmp"], "--json = '/tmp': a folder; allowed: "),
        (
            ["bench", "decode", "--communicators", "gloo,foo"],
            "--communicators = 'foo': no installed plugin provides this communicator",
        ),
        (["bench", "serve", "--json", "/nonexistent/s.json"], "--json = '/nonexistent/s.json': "),
        (["faults", "--json", "/nonexistent/f.json"], "--json = '/nonexistent/f.json': "),
        (["conformance", "gloo", "--report", "/nonexistent/r.json"], "--report = '/nonexi"),
        (["bench", "comm", "-f", "1"], "-f = 1: allowed: 2 or more"),
        (["faults", "--executors", "mp,foo"], "--executors = 'mp,foo': unknown: foo; allowed: "),
        (
            ["bench", "decode", "--hf-threads", "1,0"],
            "--hf-threads = '1,0': allowed: comma-separated thread counts, each 1..",
        ),
        (["demo", "--hidden", "16777217"], "--hidden = 16777217: allowed: 1..16777216"),
    ],
)
def test_numbers_on_the_command_line_are_bounded_before_anything_starts(argv, expected):
    with pytest.raises(ConfigError) as error:
        dispatch(build_parser().parse_args(argv), [])
    assert str(error.value).startswith(expected)


def test_random_prompts_that_would_not_fit_in_memory_are_refused():
    argv = ["bench", "serve", "-n", "1000000", "--input-len", "16777216"]
    with pytest.raises(ConfigError) as error:
        dispatch(build_parser().parse_args(argv), [])
    assert str(error.value).startswith(
        "--num-requests 1000000 x --input-len 16777216: needs 610.4 TiB"
    )
    assert str(error.value).endswith("allowed: fewer requests or shorter prompts")


def _processes_with(variable: str) -> list[int]:
    """Live processes whose environment holds ``variable`` (``NAME=value``)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            alive = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            continue
        if entry.name.isdigit() and variable.encode() in environ and alive:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(120)
def test_sigterm_stops_the_fault_matrix_mid_scenario_and_ends_its_ranks(tmp_path):
    # The scenario runs in a session of its own; its processes inherit this variable.
    mark = f"SHARDLINE_TEST_MARK={tmp_path}"
    faults = subprocess.Popen(
        [SHARDLINE, "faults", "--executors", "mp", "--communicators", "gloo", "--scenarios",
         "hangs in a collective", "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "SHARDLINE_TEST_MARK": str(tmp_path)},
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while len(_processes_with(mark)) < 4:  # faults, the scenario's driver, 2 workers
            assert faults.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        stopped = time.monotonic()
        faults.send_signal(signal.SIGTERM)
        output = faults.communicate(timeout=30)[0]
        took = time.monotonic() - stopped
    finally:
        if faults.poll() is None:
            faults.kill()
            faults.wait()
    assert faults.returncode == 143, output
    assert took < 10, f"{took:.1f} s from SIGTERM to exit; the scenario had a 60 s deadline"
    assert output.rstrip().endswith("error: terminated (SIGTERM)")
    assert "hangs in a collective: " not in output  # stopped, not judged
    assert _processes_with(mark) == []


@pytest.mark.parametrize(
    ("argv", "usage"),
    [
        (["run", "Hi", "--sett"], "usage: shardline run "),
        (["bench", "comm", "--foo"], "usage: shardline bench comm "),
        (["config", "show", "--x"], "usage: shardline config show "),
    ],
)
def test_an_unknown_argument_is_refused_with_its_commands_usage(argv, usage, capsys):
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(argv)
    assert refused.value.code == 2
    errors = capsys.readouterr().err
    assert errors.startswith(usage), errors
    assert errors.rstrip().endswith(f"error: unrecognized arguments: {argv[-1]}"), errors


#: Refused for their own arguments: answered without importing torch (~3 s of a 2-core host's
#: CPU), so a typo costs a fraction of a second. MODEL / GGUF stand for a tiny model's path.
REFUSED_WITHOUT_TORCH = [
    ["bench", "comm", "-e", "lots"],
    ["bench", "comm", "-c", "gloo,nccl2"],
    ["bench", "comm", "--python-fallback", "mpi"],
    ["bench", "decode", "--model", "MODEL", "--hf-threads", "1", "--tokens", "1"],
    ["bench", "decode", "--model", "GGUF", "--hf-threads", "1", "--tokens", "1"],
    ["bench", "decode", "--model", "MODEL", "--hf-threads", "1", "--communicators", "gloo,x"],
    ["bench", "decode", "--model", "MODEL", "--hf-threads", "1", "--weight-dtype", "float16"],
    ["run", " "],
    ["run", "--set", "notakey=1"],
]


def test_a_command_line_refused_for_its_arguments_does_not_import_torch(tmp_path, tiny_llama_dir):
    """One fresh interpreter runs each refused command line in turn; after each, torch is
    still not imported (a later refusal would see it loaded by an earlier one)."""
    gguf_file = write_tiny_gguf(
        tmp_path / "tiny.gguf", {"token_embd.weight": (np.zeros((32, 64), np.float32), None)}
    )
    paths = {"MODEL": str(tiny_llama_dir), "GGUF": str(gguf_file)}
    commands = [[paths.get(word, word) for word in argv] for argv in REFUSED_WITHOUT_TORCH]
    script = (
        "import contextlib, io, json, sys\n"
        "from shardline.cli.main import main\n"
        "for argv in json.loads(sys.argv[1]):\n"
        "    with contextlib.redirect_stderr(io.StringIO()) as errors:\n"
        "        code = main(argv)\n"
        "    print(json.dumps([code, errors.getvalue(), 'torch' in sys.modules]))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, json.dumps(commands)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    answers = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(answers) == len(commands)
    for argv, (code, errors, torch_loaded) in zip(REFUSED_WITHOUT_TORCH, answers, strict=True):
        assert code == 2 and errors.startswith("error: "), (argv, code, errors)
        assert not torch_loaded, f"{argv} imported torch before refusing: {errors}"


def test_an_interrupt_a_library_swallowed_still_ends_the_command_as_interrupted():
    """torch's C++ import of numpy clears any error it meets, a Ctrl-C included, and the
    command then fails on the half-imported numpy: that ends as interrupted (130), while the
    same failure without a Ctrl-C is an internal error (1); Python's SIGINT handler is
    restored. Where SIGINT is ignored (a background job), it stays ignored."""
    script = (
        "import contextlib, io, json, signal, sys\n"
        "from shardline.cli import main as cli\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal\n"
        "def swallowing(args, passthrough):\n"
        "    if sys.argv[1] == 'interrupt':\n"
        "        with contextlib.suppress(BaseException):\n"
        "            signal.raise_signal(signal.SIGINT)\n"
        "    raise AttributeError(\"module 'numpy' has no attribute 'multiply'\")\n"
        "cli.dispatch = swallowing\n"
        "with contextlib.redirect_stderr(io.StringIO()) as errors:\n"
        "    code = cli.main(['plugins'])\n"
        "restored = signal.getsignal(signal.SIGINT) is signal.default_int_handler\n"
        "print(json.dumps([code, errors.getvalue(), restored]))\n"
    )
    answers = {}
    for case in ("interrupt", "no interrupt"):
        done = subprocess.run(
            [sys.executable, "-c", script, case], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        answers[case] = json.loads(done.stdout)
    assert answers["interrupt"] == [130, "interrupted\n", True]
    code, errors, restored = answers["no interrupt"]
    assert code == 1 and errors.startswith("internal error: AttributeError") and restored
    ignored = (
        "import signal\n"
        "from shardline.cli import main as cli\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "ignored = lambda: print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)\n"
        "cli.dispatch = lambda args, passthrough: ignored()\n"
        "cli.main(['plugins'])\n"
        "ignored()\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", ignored], capture_output=True, text=True, timeout=60
    )
    assert done.stdout.splitlines() == ["True", "True"], done.stdout + done.stderr
