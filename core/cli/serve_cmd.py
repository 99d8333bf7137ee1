"""``shardline serve``: the configured model behind an OpenAI-compatible HTTP server (FastAPI
on uvicorn), its engine in a thread of its own (:mod:`shardline.serve`)."""

from __future__ import annotations

import errno
import logging
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence

from shardline.cli.run_cmd import BUILTIN_CONFIG
from shardline.config.loader import LoadedConfig, load_config
from shardline.errors import ConfigError, echo

BUILTIN_SOURCE = "built-in serve config"
#: Seconds open requests get to finish once the server is told to stop; then the engine ends
#: them with an error (a stream: an error event and ``[DONE]``). Also what the engine gets to
#: end the step it runs when it is stopped.
STOP_GRACE_S = 5.0
#: Seconds beyond that grace for the engine's last step and the responses' last bytes, before
#: uvicorn would cancel a response still open.
STOP_MARGIN_S = 3.0
#: Where the API key comes from when ``--api-key`` is not given: in the environment it stays
#: out of the process list, where every user of the host can read a command's flags.
API_KEY_VARIABLE = "SHARDLINE_API_KEY"


def load_serve_config(path: str | None, overrides: Sequence[str]) -> LoadedConfig:
    """The built-in config of ``shardline run`` (SmolLM2-135M-Instruct, TP=2), then the file,
    the environment and ``--set`` over it."""
    return load_config(path, overrides, base=(BUILTIN_SOURCE, BUILTIN_CONFIG))


def api_key_of(flag: str | None, environ: Mapping[str, str]) -> str | None:
    """The key clients must send: ``--api-key`` where given, else ``$SHARDLINE_API_KEY``
    where set, else None (no key required). ConfigError naming its source when it is blank."""
    if flag is not None:
        source, key = "--api-key", flag
    elif API_KEY_VARIABLE in environ:
        source, key = API_KEY_VARIABLE, environ[API_KEY_VARIABLE]
    else:
        return None
    if not key.strip():
        raise ConfigError(f"{source} is empty: give the key clients must send, or leave it out")
    return key


def run(loaded: LoadedConfig, host: str, port: int, api_key: str | None) -> int:
    """Listen on ``host:port`` (0: a free port), start the engine, serve until interrupted;
    ``api_key``: what clients must send (:func:`api_key_of`), None for none."""
    listener = listen(host, port)
    try:
        return _serve(loaded, listener, api_key)
    finally:
        listener.close()


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port``; ConfigError naming the flag when that is not possible
    (the port in use, the address not of this host)."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port = {port}: allowed: 0..65535 (0: any free port)")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as error:
        raise ConfigError(
            f"--host = {echo(host)}: {error.strerror}; give an address of this host "
            "(127.0.0.1, or 0.0.0.0 for every interface)"
        ) from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        if error.errno == errno.EADDRINUSE:
            raise ConfigError(
                f"--port = {port}: {host}:{port} is already in use; stop what listens there "
                "or give another --port"
            ) from None
        if error.errno == errno.EACCES:
            raise ConfigError(
                f"--port = {port}: ports below 1024 need root; give a port of 1024 or more"
            ) from None
        raise ConfigError(
            f"--host = {echo(host)} --port = {port}: cannot listen there: {error.strerror}"
        ) from None
    return listener


def _serve(loaded: LoadedConfig, listener: socket.socket, api_key: str | None) -> int:
    import uvicorn

    from shardline.engine import LLM
    from shardline.serve import DrainingServer, EngineLoop, ServedModel, ServeMetrics, build_app

    _log_to_stderr()
    metrics = ServeMetrics()
    engine = EngineLoop(
        lambda: LLM(loaded).engine, metrics, loaded.config.serve.max_waiting_requests
    )
    try:
        if engine.engine.executor.launched:
            raise ConfigError(
                "parallel.distributed_executor_backend: shardline serve drives its ranks from "
                "one process; under a launcher (torchrun, mpiexec) every process would serve. "
                "Start it without a launcher (executor mp or uni)"
            )
        first = engine.engine
        served = ServedModel(
            name=loaded.config.model.path or "",
            tokenizer=first.tokenizer,
            max_model_len=first.max_model_len,
            vocab_size=first.vocab_size,
            defaults=first.config.sampling,
            pooling=first.config.model.pooling,
            created=int(time.time()),
        )
        app = build_app(engine, served, metrics, api_key)
        engine.start()
        server = DrainingServer(
            engine,
            STOP_GRACE_S,
            uvicorn.Config(
                app,
                log_level="warning",
                access_log=False,
                lifespan="off",
                timeout_graceful_shutdown=int(STOP_GRACE_S + STOP_MARGIN_S),
            ),
        )
        print(_banner(served.name, listener, first.config, api_key), file=sys.stderr, flush=True)
        # uvicorn stops on Ctrl-C and raises the signal again once stopped: Python's handler
        # makes that a KeyboardInterrupt (exit 130), also where a shell started this process
        # with SIGINT ignored (a background job), which uvicorn overrides while it serves.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        server.run(sockets=[listener])
    finally:
        engine.stop(STOP_GRACE_S)
    return 0


def _banner(name: str, listener: socket.socket, config, api_key: str | None) -> str:
    host, port = listener.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    parallel = config.parallel
    return (
        f"serving {name} at http://{shown}:{port}/v1 (tp={parallel.tensor_parallel_size} "
        f"pp={parallel.pipeline_parallel_size}, {parallel.distributed_executor_backend}, "
        f"{parallel.communicator}; API key {'required' if api_key else 'not required'}); "
        "Ctrl-C stops it"
    )


def _log_to_stderr() -> None:
    """The server's own log lines (engine failures and restarts) on stderr."""
    logger = logging.getLogger("shardline.serve")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
