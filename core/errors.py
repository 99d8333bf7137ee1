"""Typed errors. Every failure a user or a backend author must react to has its own class.

All derive from :class:`ShardlineError`, so a CLI or an engine can catch one base and print a
single clear message. Messages say what happened, where (file, field, rank, operation) and
what to do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Values echoed in an error message are cut to this many characters.
ECHO_CHARS = 120


def echo(value: Any) -> str:
    """``repr(value)`` for an error message, cut to :data:`ECHO_CHARS` characters: values
    from config files, flags and peers are untrusted, and a huge one must not flood the
    terminal."""
    try:
        text = repr(value)
    except RecursionError:
        text = f"<{type(value).__name__} nested too deeply>"
    return cut(text, ECHO_CHARS)


def cut(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and how long it was."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def first_line(error: BaseException, limit: int = 400) -> str:
    """The first line of ``error``'s message (not the C++ frames or hints some libraries put
    after it), cut to ``limit`` characters; its repr where the message is empty."""
    text = str(error).strip()
    return cut(text.splitlines()[0] if text else repr(error), limit)


class ShardlineError(Exception):
    """Base class of every error Shardline raises on purpose."""


class ConfigError(ShardlineError, ValueError):
    """A configuration value is unknown, malformed or incompatible with another one.

    ``field`` is the dotted path (``parallel.tensor_parallel_size``), ``source`` where the
    value came from (a file path, an environment variable, ``--set``); either may be empty.
    """

    def __init__(self, message: str, *, field: str = "", source: str = "") -> None:
        super().__init__(message)
        self.field = field
        self.source = source


class RequestError(ShardlineError, ValueError):
    """A request the engine cannot serve as given (e.g. a prompt longer than the context)."""


class HostsError(ShardlineError, RuntimeError):
    """Simulated hosts cannot be made here (no root, no ``ip``), making them failed, or what
    an executor brings up on hosts (``Executor.prepare_hosts``) did not start."""


class PluginError(ShardlineError):
    """A plugin could not be loaded, or two plugins claim the same component name."""


class BackendUnavailableError(ShardlineError):
    """A named component exists but cannot run here (missing library, device or capability)."""


class CommunicationError(ShardlineError):
    """A communication operation failed. ``op`` names the operation, ``rank`` the local rank."""

    def __init__(self, message: str, *, op: str = "", rank: int | None = None) -> None:
        super().__init__(message)
        self.op = op
        self.rank = rank


class CommTimeoutError(CommunicationError, TimeoutError):
    """A blocking operation passed its deadline (a peer never joined, or is too slow)."""


class CollectiveMismatchError(CommunicationError):
    """Ranks of a group entered different operations (or shapes, dtypes) at the same point."""


class ProtocolError(CommunicationError):
    """A peer sent a control-plane message that is ill-formed or fails the job-secret check;
    it was refused before anything in it was used."""


class PeerLostError(CommunicationError):
    """A peer process died or its connection closed while an operation needed it."""


class WorkerError(ShardlineError):
    """An exception raised inside a rank, carried to the caller.

    ``rank`` is the rank that raised, ``exc_type`` the original exception's class name and
    ``remote_traceback`` its formatted traceback. ``origin`` is the original exception itself
    when it is one of Shardline's typed errors (a :class:`ConfigError` in a rank's start-up,
    say), so that its type decides what the caller does, as if it had been raised here.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        exc_type: str,
        remote_traceback: str = "",
        origin: ShardlineError | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
        self.origin = origin

    def __str__(self) -> str:
        return f"rank {self.rank} raised {self.exc_type}: {self.args[0]}"


@dataclass(frozen=True)
class RemoteFailure:
    """An exception raised in a rank, as it travels to the process driving it (pickled over
    any channel: shared memory, a pipe, the rendezvous store): its type, message and
    traceback, and ``origin``, the exception itself when it is one of Shardline's typed
    errors and survives pickling. The one envelope every executor uses."""

    exc_type: str
    message: str
    traceback: str
    origin: ShardlineError | None = None

    @classmethod
    def capture(cls, error: BaseException) -> RemoteFailure:
        """The envelope of ``error``, being handled now (its traceback is the current one)."""
        import traceback

        return cls(type(error).__name__, str(error), traceback.format_exc(), _portable(error))

    def error(self, rank: int, context: str = "") -> WorkerError:
        """The :class:`WorkerError` to raise for it, naming ``rank`` (``context`` prefixes
        the message)."""
        return WorkerError(
            f"{context}{self.message}",
            rank=rank,
            exc_type=self.exc_type,
            remote_traceback=self.traceback,
            origin=self.origin,
        )


def _portable(error: BaseException) -> ShardlineError | None:
    """``error`` when it is a Shardline error that survives pickling, else None."""
    import pickle

    if not isinstance(error, ShardlineError) or isinstance(error, WorkerError):
        return None
    try:
        return pickle.loads(pickle.dumps(error))
    except Exception:
        return None
