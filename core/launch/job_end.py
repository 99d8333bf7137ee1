"""Ending a launched job that cannot finish cleanly.

After a missed deadline or a lost peer some rank of the job may be stuck for good. Its
launcher ends the others only when one of them exits non-zero (torchrun, mpiexec), and
``MPI_Finalize`` (which mpi4py calls at interpreter exit) waits for every rank of an MPI job.
So a process that saw such a failure ends the whole job at its exit, whatever its script
returns: with ``MPI_Abort`` where MPI is initialized, else by exiting with status
:data:`ABORT_EXIT_CODE`. A script that catches the error and returns normally therefore
still ends the job instead of leaving its launcher waiting on a stuck rank.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

from shardline.launch.launcher_env import detect_launcher

#: Exit code of every process of an aborted job.
ABORT_EXIT_CODE = 1


def abort_job_at_exit() -> bool:
    """Make this process's interpreter exit end the job it belongs to: ``MPI_Abort`` where
    mpi4py has initialized MPI; else, in a process a launcher started (its own environment
    names one, :func:`~shardline.launch.launcher_env.detect_launcher`), exit status
    :data:`ABORT_EXIT_CODE`. Either way the process ends there, after the exit handlers
    registered later than this call (atexit runs the latest first) and a flush of logging and
    the standard streams, but before those registered earlier. Nothing in a process no
    launcher started. Idempotent; returns whether the exit will end the job. Never imports
    mpi4py itself."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        ending = _abort_mpi_job
    elif detect_launcher(os.environ) is not None:
        ending = _exit_failed
    else:
        return False
    for handler in (_abort_mpi_job, _exit_failed):
        atexit.unregister(handler)
    atexit.register(ending)  # runs before the handlers registered earlier (mpi4py's finalizer)
    return True


def _abort_mpi_job() -> None:
    _flush_output()
    sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(ABORT_EXIT_CODE)


def _exit_failed() -> None:
    _flush_output()
    os._exit(ABORT_EXIT_CODE)


def _flush_output() -> None:
    """Flush what the process wrote but may not have written out: logging's handlers (whose
    own exit handler may not run) and the standard streams."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
