"""Ending an MPI job that cannot finish cleanly.

``MPI_Finalize`` (which mpi4py calls at interpreter exit) waits for every rank of the job. After
a missed deadline or a lost peer some rank may be stuck for good, so a process that saw one
must end the whole job with ``MPI_Abort`` instead, or it hangs at exit.
"""

from __future__ import annotations

import atexit
import sys

#: Exit code of every process of an aborted job.
ABORT_EXIT_CODE = 1


def abort_job_at_exit() -> bool:
    """If mpi4py has initialized MPI in this process, make interpreter exit end the whole
    MPI job (``MPI_Abort``) instead of finalizing. Idempotent; returns whether MPI is in use.
    Never imports mpi4py itself."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return False
    atexit.unregister(_abort_job)
    atexit.register(_abort_job)  # runs before mpi4py's finalizer, registered at its import
    return True


def _abort_job() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    sys.modules["mpi4py.MPI"].COMM_WORLD.Abort(ABORT_EXIT_CODE)
