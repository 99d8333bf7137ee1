"""The plugin SDK: what a plugin may use of Shardline besides the contracts.

A plugin imports from four modules only (a test holds the built-in plugins and the example to
it): :mod:`shardline.interfaces` (the contracts), :mod:`shardline.errors`,
:mod:`shardline.registry` (``Component``, ``hookimpl``) and this one, the building blocks:

Communicators
    ``ProcessGroupCommunicator`` (a torch process group per group: gloo, NCCL, ...),
    ``MessagePassingCommunicator`` (a backend that can only move bytes implements two
    methods), ``DelegatingCommunicator`` (wrap another communicator, override what you do);
    ``OnceWork``, ``CompositeWork``, ``CompletedWork`` (work handles); ``check_peer``,
    ``group_ranks`` (argument checks with the contract's messages); ``Polling``,
    ``wait_until`` (deadline-bounded waits that leave the CPU to others);
    ``native_extension`` (a plugin's optional C extension, or None for its Python fallback:
    not built, or ``SHARDLINE_NATIVE=0``); ``connect_store``, ``serve_store``,
    ``announce_arrival``, ``never_arrived`` (the rendezvous store, and naming ranks that
    never arrived at a join); ``HostDirectory`` (which host each rank announced, to name it
    in errors: "rank 1 on host h2"); ``ControlPlane`` (signed objects and tensor dicts over
    any communicator); ``seal``, ``unseal`` (signed bytes for a channel of your own;
    ``verified_pickle``: the pickle, its signature checked, not yet loaded).

Executors
    ``EngineConfig``; ``first_reply`` (the Future ``execute_model`` returns, from a
    ``collective_rpc`` Future); ``check_reply_rank``, ``method_name`` (``collective_rpc``'s
    argument check and how errors name its method); ``WorkerSetup``, ``WorkerContext``,
    ``Worker`` (build a rank's Worker: join its worlds, load the model, with phase callbacks);
    ``RankProcesses`` (start a world's rank processes, tethered to this one, watch them
    die, stop them), ``missed_phase``,
    ``failed_in_phase`` (start-up errors in the common words); ``pickled_call`` (a call
    pickled, or the error to raise when it cannot be), ``pickled_reply`` (a rank's
    reply pickled, or the error to send instead when it cannot be), ``loaded_reply`` (a
    reply loaded where it arrives, or the error to fail its call with); ``Spawner``,
    ``ChildProcess``, ``ForkedChild`` (single processes that end with their parent, started
    with exec or forked from a fork server), ``ForkServers`` (fork servers a process's worlds
    share; ``ForkServers.process_wide()``); ``share_cores`` (a
    rank's share of torch threads), ``place_rank`` (a rank bound to its cores of
    ``parallel.cpu_binding``, then its threads), ``bind_process`` (a driver bound beside a
    rank);
    ``LaunchedRank``, ``detect_launcher``, ``local_rank`` (a rank's place under torchrun or
    mpiexec; its rank on its host);
    ``abort_job_at_exit`` (end a launched job at exit after a failure: no rank left stuck,
    no hang in MPI_Finalize);
    ``StartupGuard`` (end a rank no driver watches when a start-up phase hangs);
    ``WATCHDOG_REPORT_S`` (how long a rank's collective-timeout diagnosis takes after its
    deadline: a driver's call deadline adds it, so that the rank at fault is named).

Model runners
    ``CausalLMRunner`` (request state, batching, a paged KV cache, sampling and pooling for
    a decoder-only model: implement ``build_model``); ``ParallelState`` (a rank's groups).

Names load on first use, so a plugin's entry module importing ``Component`` or
``Capabilities`` stays cheap (nothing here imports torch until asked).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "ProcessGroupCommunicator": "shardline.comm.process_group",
    "MessagePassingCommunicator": "shardline.comm.message_passing",
    "DelegatingCommunicator": "shardline.comm.delegating",
    "OnceWork": "shardline.comm.work",
    "CompositeWork": "shardline.comm.work",
    "CompletedWork": "shardline.comm.work",
    "first_reply": "shardline.comm.work",
    "check_peer": "shardline.comm.arguments",
    "group_ranks": "shardline.comm.arguments",
    "check_reply_rank": "shardline.comm.arguments",
    "method_name": "shardline.comm.arguments",
    "Polling": "shardline.comm.waiting",
    "wait_until": "shardline.comm.waiting",
    "native_extension": "shardline.native",
    "connect_store": "shardline.comm.store",
    "serve_store": "shardline.comm.store",
    "announce_arrival": "shardline.comm.store",
    "never_arrived": "shardline.comm.store",
    "HostDirectory": "shardline.comm.host_directory",
    "ControlPlane": "shardline.distributed.control_plane",
    "seal": "shardline.comm.objects",
    "unseal": "shardline.comm.objects",
    "verified_pickle": "shardline.comm.objects",
    "EngineConfig": "shardline.config.schema",
    "WorkerSetup": "shardline.worker.setup",
    "WorkerContext": "shardline.worker.setup",
    "Worker": "shardline.worker.worker",
    "Spawner": "shardline.launch.tether",
    "ChildProcess": "shardline.launch.tether",
    "ForkedChild": "shardline.launch.tether",
    "ForkServers": "shardline.launch.fork_servers",
    "RankProcesses": "shardline.launch.runtime",
    "missed_phase": "shardline.launch.runtime",
    "failed_in_phase": "shardline.launch.runtime",
    "pickled_reply": "shardline.launch.runtime",
    "pickled_call": "shardline.launch.runtime",
    "loaded_reply": "shardline.launch.runtime",
    "share_cores": "shardline.launch.threads",
    "place_rank": "shardline.launch.threads",
    "bind_process": "shardline.launch.core_binding",
    "LaunchedRank": "shardline.launch.launcher_env",
    "detect_launcher": "shardline.launch.launcher_env",
    "local_rank": "shardline.launch.launcher_env",
    "abort_job_at_exit": "shardline.launch.job_end",
    "StartupGuard": "shardline.launch.startup_guard",
    "CausalLMRunner": "shardline.worker.model_runner",
    "ParallelState": "shardline.distributed.parallel_state",
    "WATCHDOG_REPORT_S": ("shardline.comm.watchdog", "REPORT_GRACE_S"),
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"shardline.sdk has no {name!r}; the SDK is: {', '.join(__all__)}")
    module, attribute = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
