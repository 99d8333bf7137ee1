"""This process's connection to Ray, shared by the Ray executors in it.

Ray keeps one connection per process (``ray.init``), so the executors of a process share it,
and this module counts them (:func:`connect`, :meth:`Connection.release`). The first one
connects: to the cluster ``RAY_ADDRESS`` names (``auto``: the one ``ray start`` began on this
host), or, without it, to a Ray instance it starts on this host, in a folder of its own under
the system's temporary directory (``/tmp`` where that path is too long for Ray's sockets:
:func:`ray_temp_folder`; a janitor process removes it, and ends what of the instance still
runs, if this process dies first: :mod:`shardline_ray.janitor`), with a small object store
and no dashboard (its ports take Ray's token authentication, on by default for such
instances; Ray keeps the token in ``~/.ray/auth_token``). The last one to leave ends what was
begun: it disconnects, or stops that instance and removes its folder. A connection someone
else made before (``ray.init`` called by the application) is used and left alone.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import ray

from shardline.errors import CommunicationError, first_line
from shardline_ray import janitor
from shardline_ray.temp_folder import ray_temp_folder

#: The local instance's object store (Ray's minimum is 75 MiB): calls' arguments and replies
#: larger than 100 KiB pass through it.
OBJECT_STORE_BYTES = 128 * 1024 * 1024

_lock = threading.Lock()
_shared: _Shared | None = None


@dataclass
class _Shared:
    users: int
    #: Made here (disconnect or stop it at the end), or by the application.
    owned: bool
    #: What it is: "the Ray cluster at ADDRESS", "a Ray instance on this host", ...
    description: str
    #: The local instance's folder, removed once it stops.
    folder: str | None
    #: The local instance's janitor (it cleans up if this process dies first).
    watcher: subprocess.Popen | None = None


@dataclass
class Connection:
    """One executor's use of the process's Ray connection. ``description`` says what it is
    connected to."""

    description: str
    _released: bool = False

    def release(self) -> None:
        """Stop using the connection; the last user ends it (idempotent)."""
        global _shared
        with _lock:
            if self._released or _shared is None:
                return
            self._released = True
            _shared.users -= 1
            if _shared.users > 0:
                return
            ending, _shared = _shared, None
        if ending.owned:
            ray.shutdown(wait_for_processes=True)
        if ending.folder is not None:
            shutil.rmtree(ending.folder, ignore_errors=True)
        if ending.watcher is not None:
            janitor.dismiss(ending.watcher)


def connect(environ: Mapping[str, str], cpus: int) -> Connection:
    """Use the process's Ray connection, making it if there is none (see the module
    docstring); a local instance declares at least ``cpus`` CPUs. Raises CommunicationError
    when the cluster ``RAY_ADDRESS`` names cannot be reached."""
    global _shared
    with _lock:
        if _shared is not None and not ray.is_initialized():
            _shared = None  # someone called ray.shutdown(): what was counted is gone
        if _shared is None:
            _shared = _open(environ, cpus)
        _shared.users += 1
        return Connection(_shared.description)


def _open(environ: Mapping[str, str], cpus: int) -> _Shared:
    if ray.is_initialized():
        return _Shared(0, False, "the Ray connection this process made", None)
    address = environ.get("RAY_ADDRESS", "").strip()
    folder = None if address else ray_temp_folder("shardline-ray-")
    watcher = None if folder is None else janitor.watch_over(folder)
    options = {
        "log_to_driver": False,
        "logging_level": logging.ERROR,
        "configure_logging": True,
    }
    if not address:
        options |= {
            "num_cpus": max(cpus, os.cpu_count() or 1),
            "object_store_memory": OBJECT_STORE_BYTES,
            "include_dashboard": False,
            "_temp_dir": folder,
        }
    sigterm = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=address or "local", **options)
    except ConnectionError as error:
        raise CommunicationError(
            f"cannot connect to the Ray cluster at {address} (RAY_ADDRESS): "
            f"{_root_cause(error)}. Check the address; a cluster with token authentication "
            "needs RAY_AUTH_MODE=token and its token here (RAY_AUTH_TOKEN or ~/.ray/auth_token)",
            op="connect",
        ) from error
    finally:
        _restore_sigterm(sigterm)
        if folder is not None and not ray.is_initialized():
            shutil.rmtree(folder, ignore_errors=True)
            janitor.dismiss(watcher)
    if address:
        return _Shared(0, True, f"the Ray cluster at {address} (RAY_ADDRESS)", None)
    description = f"a Ray instance started on this host (in {folder})"
    return _Shared(0, True, description, folder, watcher=watcher)


def _root_cause(error: BaseException) -> str:
    """The first line of the innermost exception behind ``error``."""
    while error.__cause__ is not None or error.__context__ is not None:
        error = error.__cause__ or error.__context__
    return first_line(error)


def _restore_sigterm(handler) -> None:
    """Undo ``ray.init``'s SIGTERM handler (it exits at once): the application's own, such as
    ``shardline``'s clean shutdown, stays in charge."""
    if threading.current_thread() is threading.main_thread() and handler is not None:
        signal.signal(signal.SIGTERM, handler)
