"""Entry point of the ``shardline`` command. Errors end as one message, never a traceback
(set ``SHARDLINE_DEBUG=1`` to see tracebacks of unexpected errors)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from shardline import __version__
from shardline.config.loader import LoadedConfig, load_config
from shardline.errors import ConfigError, ShardlineError, WorkerError
from shardline.launch.process_exit import skip_final_collection


class CommandParser(argparse.ArgumentParser):
    """A command's parser (and its actions'): an argument it does not know is its own error,
    said with its own usage. (argparse leaves such arguments to the top parser, whose usage
    names no command's options.)"""

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        if extras:
            self.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed, extras


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="shardline",
        description="Transformer inference across ranks, every part chosen by config.",
    )
    parser.add_argument("--version", action="version", version=f"shardline {__version__}")
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND", parser_class=CommandParser
    )
    _with_config(
        commands.add_parser(
            "plugins", help="list plugins, what they provide, and whether it runs here"
        )
    )
    _with_built_in_choice(
        _with_config(commands.add_parser("explain", help="which backend a config selects and why"))
    )
    _add_config_commands(commands)
    _add_conformance_command(commands)
    _add_faults_command(commands)
    _add_bench_commands(commands)
    _add_run_command(commands)
    _add_serve_command(commands)
    _add_demo_command(commands)
    _add_models_commands(commands)
    _add_hosts_commands(commands)
    return parser


def _with_config(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``sub`` with ``--config FILE`` and repeatable ``--set SECTION.KEY=VALUE``."""
    sub.add_argument(
        "--config", "-c", metavar="FILE", help="config file (.yaml, .yml, .toml, .json)"
    )
    sub.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one value (repeatable), e.g. parallel.tensor_parallel_size=2",
    )
    return sub


def _with_built_in_choice(sub: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """``sub`` with ``--for run|serve``: the config that command would run, its built-in
    layer (model, TP=2, auto backends) under the file, the environment and ``--set``."""
    sub.add_argument(
        "--for",
        dest="for_command",
        choices=("run", "serve"),
        help="apply the built-in config of `shardline run` or `serve` first, as they do",
    )
    return sub


def _add_config_commands(commands: argparse._SubParsersAction) -> None:
    config = commands.add_parser("config", help="show, validate or describe configuration")
    actions = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    for name, help_text in (
        ("show", "the effective config and each value's source"),
        ("validate", "check a config against the installed plugins"),
    ):
        action = _with_built_in_choice(_with_config(actions.add_parser(name, help=help_text)))
        action.add_argument(
            "file", nargs="?", metavar="FILE", help="config file (the same as --config FILE)"
        )
    actions.add_parser("schema", help="the JSON schema of the config")


def _add_conformance_command(commands: argparse._SubParsersAction) -> None:
    conformance = commands.add_parser(
        "conformance",
        help="run the conformance suite on a communicator or an executor",
        description="Run the conformance suite on a communicator or an executor. Arguments "
        "after -- go to pytest (e.g. -- -k all_reduce -x).",
    )
    conformance.add_argument("name", help="communicator or executor: name or package.module:Class")
    conformance.add_argument(
        "--kind",
        choices=("communicator", "executor"),
        help="which suite (default: what NAME is; needed only if it names both)",
    )
    conformance.add_argument(
        "--world-sizes", help="comma-separated (default: communicators 1,2,3,4; executors 1,2,4)"
    )
    conformance.add_argument(
        "--timeout",
        type=float,
        help="deadline of every operation (communicators, default 30 s) or parallel.timeout_s "
        "(executors, default 20 s)",
    )
    conformance.add_argument(
        "--launcher",
        choices=("torchrun", "mpiexec", "mpiexec+master"),
        default="torchrun",
        help="launcher for a launched executor such as external_launcher (default torchrun)",
    )
    conformance.add_argument("--report", help="JSON report path")


def _add_faults_command(commands: argparse._SubParsersAction) -> None:
    faults = commands.add_parser(
        "faults",
        help="plant faults in real worlds: every scenario on every executor x communicator",
        description="The fault-injection suite: each scenario (a rank killed mid-step, hung "
        "in a collective, never joining; mismatched collectives; ill-formed control messages; "
        "a plugin raising on import) runs in a fresh world of each valid executor x "
        "communicator pair. Pass: every surviving process raises a typed error within the "
        "deadline + 1 s, shutdown is clean, no process or /dev/shm entry is left.",
    )
    faults.add_argument("--executors", help="comma-separated (default: every installed one)")
    faults.add_argument("--communicators", help="comma-separated (default: every installed one)")
    faults.add_argument("--scenarios", help="comma-separated scenario names (default: all)")
    faults.add_argument(
        "--timeout", type=float, default=3.0, help="parallel.timeout_s of the worlds (default 3)"
    )
    faults.add_argument(
        "--startup-timeout",
        type=float,
        default=20.0,
        help="parallel.startup_timeout_s of the worlds: each start-up phase's deadline, and "
        "how long the scenarios whose rank never joins take (default 20)",
    )
    faults.add_argument(
        "--layout",
        default="tp",
        help="the worlds' 2 ranks: tp (tensor-parallel, the default) or pp (two pipeline "
        "stages; the scenarios whose fault is in the tensor-parallel group do not run)",
    )
    faults.add_argument(
        "--across-hosts",
        action="store_true",
        help="the host scenarios instead (a host killed, cut off or stopped mid-step) on "
        "fresh simulated hosts, one rank each (needs root); --executors: those whose ranks "
        "span hosts (default external_launcher, under torchrun; ray: a Ray cluster on the "
        "hosts, the driver in the first)",
    )
    faults.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="scenarios run at once, each in its own world (default 1; at most the host's "
        "cores; not with --across-hosts)",
    )
    faults.add_argument("--json", help="write the report here")


def _add_bench_commands(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="benchmarks").add_subparsers(
        dest="bench_command", required=True
    )
    _add_bench_comm(bench)
    _add_bench_decode(bench)
    _add_bench_serve(bench)


def _add_bench_comm(bench: argparse._SubParsersAction) -> None:
    comm = bench.add_parser(
        "comm",
        help="time collectives and p2p of several communicators side by side",
        description="OSU / nccl-tests style: sizes -b..-e by factor -f, warm-up and timed "
        "iterations with a barrier before each (or back to back), median over ranks, algorithm "
        "and bus bandwidth.",
    )
    comm.add_argument(
        "--communicators", "-c", default="gloo", help="comma-separated names (default gloo)"
    )
    comm.add_argument("-n", "--ranks", type=int, default=2, help="ranks (default 2)")
    comm.add_argument("-b", "--begin", default="4", help="smallest size (default 4)")
    comm.add_argument("-e", "--end", default="16M", help="largest size (default 16M)")
    comm.add_argument("-f", "--factor", type=int, default=4, help="size factor (default 4)")
    comm.add_argument(
        "--ops",
        default="all_reduce,all_gather,reduce_scatter,broadcast,p2p",
        help="comma-separated operations (default: all five)",
    )
    comm.add_argument("-w", "--warmup", type=int, default=5, help="untimed iterations (5)")
    comm.add_argument("-i", "--iters", type=int, default=20, help="timed iterations (20)")
    comm.add_argument("--dtype", default="float32", help="float32 (default), float16, ...")
    comm.add_argument("--timeout", type=float, default=60.0, help="per-operation deadline (s)")
    comm.add_argument(
        "--back-to-back",
        action="store_true",
        help="no barrier between iterations: each is timed from the last rank's end of the "
        "previous one (how a model calls them)",
    )
    comm.add_argument(
        "--python-fallback",
        default="",
        help="comma-separated communicators to run again with SHARDLINE_NATIVE=0 (their "
        "pure-Python paths), shown as NAME/py",
    )
    _add_across_hosts(comm)
    comm.add_argument("--json", help="write the results here")


def _add_across_hosts(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--across-hosts",
        type=int,
        metavar="H",
        help="measure with the ranks inside one simulated host and spread over H simulated "
        "hosts, side by side (needs root and ip; started with torchrun, or mpiexec where the "
        "communicator needs it)",
    )


def _add_bench_decode(bench: argparse._SubParsersAction) -> None:
    decode = bench.add_parser(
        "decode",
        help="tokens/s of greedy decode per layout x communicator, beside HF transformers",
        description="Batch-1 and concurrent greedy decode tokens/s for each layout x "
        "communicator, and HF transformers on the same model file, each case in fresh "
        "processes (MPI cases under mpiexec).",
    )
    decode.add_argument("--model", default="smollm2-135m", help="catalog name, GGUF or HF dir")
    decode.add_argument("--tokens", type=int, default=64, help="tokens per request (64)")
    decode.add_argument("--concurrent", type=int, default=16, help="concurrent requests (16)")
    decode.add_argument(
        "--prompt-tokens",
        type=int,
        default=0,
        help="tokens of each request's prompt, for decode over a long context (0: a short chat "
        "question)",
    )
    decode.add_argument(
        "--layouts", default="tp1,tp2,pp2", help="of tp1, tp2, pp2, dp2 (2 replicas of tp1), tp2pp2"
    )
    decode.add_argument(
        "--communicators", default="gloo,mpi,custom_ar", help="for tp2/pp2 (gloo,mpi,custom_ar)"
    )
    decode.add_argument(
        "--hf-threads", default="1,2", help="transformers thread counts ('' to skip; 1,2)"
    )
    decode.add_argument("--timeout", type=float, default=600.0, help="per case (s)")
    decode.add_argument(
        "--dtype", default="float32", help="the weights' dtype in both engines (float32, bfloat16)"
    )
    decode.add_argument(
        "--weight-dtype",
        help="Shardline's model.weight_dtype (bfloat16 with --dtype float32: linear weights "
        "rounded to bfloat16, computed in float32; gguf: held in the file's quantization "
        "blocks, the float32 results); transformers keeps --dtype",
    )
    decode.add_argument(
        "--profile",
        action="store_true",
        help="also show where a batch-1 and a concurrent decode step's time goes, per rank "
        "and in the driver, each part as a fraction of the floor",
    )
    decode.add_argument(
        "--activation-dtype",
        help="Shardline's model.activation_dtype (int8 with --weight-dtype gguf: weights of "
        "4-bit types and Q8_0 multiply inputs quantized to int8; transformers stays float32)",
    )
    decode.add_argument(
        "--cpu-binding",
        action="append",
        help="parallel.cpu_binding of Shardline's cases (none, auto, or core sets: '0|1'); "
        "repeat it to run each case once per value (none)",
    )
    _add_across_hosts(decode)
    decode.add_argument("--json", help="write the results here")


def _add_bench_serve(bench: argparse._SubParsersAction) -> None:
    serve = bench.add_parser(
        "serve",
        help="load a running OpenAI-compatible server: TTFT, TPOT, ITL, E2E and throughput",
        description="Send streamed requests to a running OpenAI-compatible server (shardline "
        "serve, vLLM, ...) over HTTP, arriving as a Poisson process, and report request and "
        "token throughput and the mean and p50/p90/p99 of time to first token, time per "
        "output token, inter-token latency and end-to-end latency. Exit code 1 when a "
        "request failed.",
    )
    serve.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="the server (default http://127.0.0.1:8000; a trailing /v1 is fine)",
    )
    serve.add_argument(
        "--model", metavar="NAME", help="model to ask for (default: the first of GET /v1/models)"
    )
    serve.add_argument(
        "--api-key", metavar="KEY", help="sent as a bearer token (default: $OPENAI_API_KEY)"
    )
    serve.add_argument(
        "-n", "--num-requests", type=int, metavar="N", default=64, help="requests (64)"
    )
    serve.add_argument(
        "--dataset",
        default="random",
        metavar="random|chat",
        help="random (default): --input-len random token ids as a /v1/completions prompt; "
        "chat: 20 built-in questions to /v1/chat/completions",
    )
    serve.add_argument(
        "--input-len",
        type=int,
        default=128,
        metavar="TOKENS",
        help="prompt tokens of the random dataset (128)",
    )
    serve.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        metavar="V",
        help="random token ids are below this; at most the model's vocabulary (32000)",
    )
    serve.add_argument(
        "--output-len",
        type=int,
        default=64,
        metavar="TOKENS",
        help="max_tokens of every request (64), sent with ignore_eos: exactly this many where "
        "the server honours it (shardline serve, vLLM)",
    )
    serve.add_argument(
        "--request-rate",
        default="inf",
        metavar="R",
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    serve.add_argument(
        "--max-concurrency",
        type=int,
        metavar="C",
        help="at most C requests open at once (default: no limit)",
    )
    serve.add_argument(
        "--seed", type=int, default=0, metavar="S", help="seed of prompts and arrivals (0)"
    )
    serve.add_argument(
        "--timeout-s",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds one request may take (600)",
    )
    serve.add_argument(
        "--json", metavar="FILE", help="write the summary and every request's record here"
    )


def _add_run_command(commands: argparse._SubParsersAction) -> None:
    run = _with_config(
        commands.add_parser(
            "run",
            help="ask the model (default: SmolLM2-135M-Instruct on 2 ranks) and print the answer",
            description="Answer a question with the model the config names. --config and --set "
            "apply over the built-in run config (model smollm2-135m, pulled on first use; "
            "tensor_parallel_size 2; executor auto: mp, or external_launcher under torchrun or "
            "mpiexec; communicator auto).",
        )
    )
    run.add_argument("question", nargs="?", help="what to ask (default: a sample question)")
    run.add_argument(
        "--interactive", "-i", action="store_true", help="chat: read questions until Ctrl-D"
    )


def _add_serve_command(commands: argparse._SubParsersAction) -> None:
    serve = _with_config(
        commands.add_parser(
            "serve",
            help="serve the model over an OpenAI-compatible HTTP API (default: SmolLM2 on 2 ranks)",
            description="Serve the configured model over HTTP: /v1/models, /v1/completions, "
            "/v1/chat/completions, /v1/embeddings (streaming with server-sent events), /health "
            "and /metrics. --config and --set apply over the built-in config of `shardline run`.",
        )
    )
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    serve.add_argument(
        "--port", type=int, default=8000, help="port to listen on (default 8000; 0: a free one)"
    )
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on every endpoint but /health (default: "
        "$SHARDLINE_API_KEY where set, which keeps the key out of the process list)",
    )


def _add_demo_command(commands: argparse._SubParsersAction) -> None:
    demo = _with_config(
        commands.add_parser(
            "demo", help="start a world on this host and run checked, timed collectives"
        )
    )
    demo.add_argument("--rounds", type=int, default=200, help="timed all-reduces per rank")
    demo.add_argument("--hidden", type=int, default=576, help="elements per all-reduce")


def _add_models_commands(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser("models", help="known models: list them, fetch one by name")
    actions = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    pull = actions.add_parser(
        "pull", help="download a known model into the cache and print its path"
    )
    pull.add_argument("name", help="model name, as `shardline models list` shows it")
    listing = actions.add_parser(
        "list", help="known models, whether each is cached, its size and path"
    )
    for sub in (pull, listing):
        sub.add_argument(
            "--cache-dir",
            type=Path,
            metavar="DIR",
            help="model cache (default: $SHARDLINE_MODELS, else ~/.cache/shardline/models)",
        )


def _add_hosts_commands(commands: argparse._SubParsersAction) -> None:
    hosts = commands.add_parser(
        "hosts",
        help="simulated hosts on this machine (own network, hostname, /dev/shm; needs root)",
    )
    actions = hosts.add_subparsers(dest="hosts_command", required=True, metavar="ACTION")
    up = actions.add_parser("up", help="make N hosts h1..hN on a private bridge")
    up.add_argument("count", type=int, metavar="N")
    up.add_argument("--name", metavar="CLUSTER", help="cluster name (default: random)")
    up.add_argument(
        "--share-cpus",
        action="store_true",
        help="every host runs on all CPUs (default: each its own share, as real hosts)",
    )
    actions.add_parser("list", help="the clusters that are up, their hosts and addresses")
    down = actions.add_parser(
        "down",
        help="kill everything in the hosts and remove them: down CLUSTER [HOST ...] or --all",
    )
    down.add_argument("names", nargs="*", metavar="CLUSTER [HOST]")
    down.add_argument("--all", action="store_true", help="every cluster `hosts up` made")
    run_in = actions.add_parser("exec", help="run CMD inside a host: exec CLUSTER HOST -- CMD")
    run_in.add_argument("cluster", metavar="CLUSTER")
    run_in.add_argument("host", metavar="HOST")
    rsh = actions.add_parser(
        "agent",
        help="ssh stand-in for launchers (OpenMPI plm_rsh_agent): agent CLUSTER HOST COMMAND...",
    )
    rsh.add_argument("cluster", metavar="CLUSTER")
    rsh.add_argument("words", nargs=argparse.REMAINDER, metavar="HOST COMMAND")


def _load(args: argparse.Namespace, path: str | None = None) -> LoadedConfig:
    """The config ``args`` name (``path``, else ``--config``, and ``--set``), over the
    built-in layer of the command ``--for`` names where given."""
    path = path if path is not None else args.config
    command = getattr(args, "for_command", None)
    if command == "run":
        from shardline.cli.run_cmd import load_run_config

        return _warned(load_run_config(path, args.overrides))
    if command == "serve":
        from shardline.cli.serve_cmd import load_serve_config

        return _warned(load_serve_config(path, args.overrides))
    return _warned(load_config(path, args.overrides))


def _config_file_argument(args: argparse.Namespace) -> str | None:
    """The config file of ``config show|validate``: positional ``FILE`` or ``--config``."""
    if args.file is not None and args.config is not None:
        raise ConfigError(
            f"config file given twice ({args.file!r} and --config {args.config!r}): "
            "give FILE or --config FILE, not both"
        )
    return args.file if args.file is not None else args.config


def _warned(loaded: LoadedConfig) -> LoadedConfig:
    """``loaded``, after printing its warnings (e.g. a mistyped variable) to stderr."""
    for warning in loaded.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return loaded


def dispatch(args: argparse.Namespace, passthrough: list[str]) -> int:
    """Run the command ``args`` names. Each command's module is imported in its branch: a
    command that needs no torch (config, models, hosts) does not pay its import."""
    from shardline.cli import (
        config_cmd,
        conformance_cmd,
        explain_cmd,
        faults_cmd,
        hosts_cmd,
        models_cmd,
        plugins_cmd,
        run_cmd,
        serve_cmd,
    )
    from shardline.cli.flags import check_output_file

    for flag in ("json", "report"):  # results written when the command ends
        if path := getattr(args, flag, None):
            check_output_file(f"--{flag}", path)
    if args.command == "plugins":
        return plugins_cmd.run(_load(args).config)
    if args.command == "explain":
        return explain_cmd.run(_load(args))
    if args.command == "config":
        if args.config_command == "schema":
            return config_cmd.schema()
        loaded = _load(args, _config_file_argument(args))
        return (
            config_cmd.show(loaded)
            if args.config_command == "show"
            else config_cmd.validate(loaded)
        )
    if args.command == "conformance":
        return conformance_cmd.run(args, passthrough)
    if args.command == "faults":
        return faults_cmd.run(args)
    if args.command == "bench" and args.bench_command == "decode":
        return _bench_decode(args)
    if args.command == "bench" and args.bench_command == "serve":
        from shardline.cli import bench_serve

        return bench_serve.run(bench_serve.settings_from(args), args.json)
    if args.command == "bench":
        from shardline.cli.bench_comm_options import settings_from

        settings = settings_from(args)
        from shardline.cli import bench_cmd

        if args.across_hosts is not None:
            from shardline.cli import bench_hosts

            return bench_hosts.run_comm(settings, args.across_hosts, args.json)
        return bench_cmd.run(settings, args.json)
    if args.command == "run":
        if args.interactive and args.question:
            raise ConfigError("give a question or --interactive, not both")
        loaded = _warned(run_cmd.load_run_config(args.config, args.overrides))
        return run_cmd.run(loaded, args.question, args.interactive)
    if args.command == "serve":
        loaded = _warned(serve_cmd.load_serve_config(args.config, args.overrides))
        api_key = serve_cmd.api_key_of(args.api_key, os.environ)
        return serve_cmd.run(loaded, args.host, args.port, api_key)
    if args.command == "demo":
        from shardline.cli import demo_cmd

        return demo_cmd.run(_load(args), args.rounds, args.hidden)
    if args.command == "models":
        if args.models_command == "pull":
            return models_cmd.pull(args.name, args.cache_dir)
        return models_cmd.list_models(args.cache_dir)
    if args.command == "hosts":
        if args.hosts_command == "up":
            return hosts_cmd.up(args.count, args.name, args.share_cpus)
        if args.hosts_command == "down":
            return hosts_cmd.down(args.names, args.all)
        if args.hosts_command == "agent":
            return hosts_cmd.agent(args.cluster, args.words)
        if args.hosts_command == "exec":
            return hosts_cmd.exec_in(args.cluster, args.host, passthrough)
        return hosts_cmd.list_clusters()
    raise AssertionError(f"unhandled command {args.command}")


def _bench_decode(args: argparse.Namespace) -> int:
    from shardline import catalog
    from shardline.cli import bench_decode
    from shardline.comm.waiting import host_cores

    cores = host_cores()
    try:
        threads = [int(t) for t in args.hf_threads.split(",") if t.strip()]
    except ValueError:
        threads = [0]
    if not all(1 <= t <= cores for t in threads):
        raise ConfigError(
            f"--hf-threads = {args.hf_threads!r}: allowed: comma-separated thread counts, each "
            f"1..{cores} (this host's cores), or '' for no transformers rows"
        )
    model = catalog.resolve_model_path(args.model)
    bench_decode.check_sizes(model, args.tokens, args.concurrent, args.timeout, args.prompt_tokens)
    layouts = [n.strip() for n in args.layouts.split(",") if n.strip()]
    cpu_bindings = tuple(args.cpu_binding or ("none",))
    # The options first: the communicators' plugins (and torch) load only for a run.
    bench_decode.check_options(
        layouts, args.dtype, args.weight_dtype, args.activation_dtype, cpu_bindings
    )
    names = [n.strip() for n in args.communicators.split(",") if n.strip()]
    usable, skipped = bench_decode.available_communicators(names)
    cases = bench_decode.plan(
        model,
        args.tokens,
        args.concurrent,
        layouts,
        usable,
        threads,
        args.timeout,
        profile=args.profile,
        dtype=args.dtype,
        prompt_tokens=args.prompt_tokens,
        weight_dtype=args.weight_dtype,
        cpu_bindings=cpu_bindings,
        activation_dtype=args.activation_dtype,
    )
    if args.across_hosts is not None:
        from shardline.cli import bench_hosts

        if args.profile:
            raise ConfigError("--profile with --across-hosts: allowed: one of them per run")

        return bench_hosts.run_decode(cases, skipped, args.across_hosts, args.json)
    return bench_decode.run(cases, skipped, args.json)


class Terminated(BaseException):
    """SIGTERM arrived (``timeout``, a service manager): unwind like Ctrl-C, shutting every
    rank down on the way out (see :class:`StopOnSigterm`)."""


#: A SIGTERM this soon after the first asks for the same stop: ``timeout`` signals the
#: command, then its whole process group, the command included.
SIGTERM_REPEAT_S = 1.0


class StopOnSigterm:
    """A SIGTERM handler: the first SIGTERM raises ``error`` in the main thread (the command
    unwinds, shutting its ranks down); a repeat within :data:`SIGTERM_REPEAT_S` is the same
    request and is ignored; a later one ends the process at once."""

    def __init__(self, error: type[BaseException] = Terminated) -> None:
        self.error = error
        self.first: float | None = None

    def __call__(self, signum: int, frame: object) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            raise self.error
        if now - self.first >= SIGTERM_REPEAT_S:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)


class RememberInterrupt:
    """A SIGINT handler that raises KeyboardInterrupt as Python's own does and remembers that
    it came: an interrupt that a library swallowed (torch's C++ import of numpy clears any
    error it meets, leaving numpy half-imported) still ends the command as interrupted, not
    as the error that follows from it."""

    def __init__(self) -> None:
        self.came = False

    def __call__(self, signum: int, frame: object) -> None:
        self.came = True
        raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    skip_final_collection()
    argv = list(sys.argv[1:] if argv is None else argv)
    interrupt = RememberInterrupt()
    on_main_thread = threading.current_thread() is threading.main_thread()
    if on_main_thread:
        signal.signal(signal.SIGTERM, StopOnSigterm())
    # Only in place of Python's own handler: an ignored SIGINT (a background job) stays so.
    if not on_main_thread or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return _main(argv, interrupt)
    signal.signal(signal.SIGINT, interrupt)
    try:
        return _main(argv, interrupt)
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _main(argv: list[str], interrupt: RememberInterrupt) -> int:
    passthrough: list[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, passthrough = argv[:split], argv[split + 1 :]
    args = build_parser().parse_args(argv)
    takes_passthrough = args.command == "conformance" or (
        args.command == "hosts" and args.hosts_command == "exec"
    )
    if passthrough and not takes_passthrough:
        print(
            "error: arguments after -- are only for `shardline conformance` and "
            f"`shardline hosts exec`: {passthrough}",
            file=sys.stderr,
        )
        return 2
    try:
        return dispatch(args, passthrough)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Terminated:
        print("error: terminated (SIGTERM)", file=sys.stderr)
        return 143
    except BrokenPipeError:
        # The reader of the output went away (`shardline explain | head`): end quietly.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except WorkerError as error:
        # A rank's own typed error (a ConfigError in its start-up, say) ends the command as
        # it would have here; anything else a rank raised is a failure of the run.
        print(f"error: {error}", file=sys.stderr)
        if os.environ.get("SHARDLINE_DEBUG"):
            print(error.remote_traceback, file=sys.stderr)
        return 2 if error.origin is not None else 1
    except ShardlineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except Exception as error:
        if interrupt.came:
            print("interrupted", file=sys.stderr)
            return 130
        if os.environ.get("SHARDLINE_DEBUG"):
            raise
        print(
            f"internal error: {type(error).__name__}: {error}\n"
            "(a Shardline bug: rerun with SHARDLINE_DEBUG=1 for the traceback and report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
