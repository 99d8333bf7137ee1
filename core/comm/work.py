"""Ready-made :class:`~shardline.interfaces.Work` handles for backend authors, and the Future
an executor's ``execute_model`` returns (:func:`first_reply`)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, InvalidStateError
from typing import Any

from shardline.interfaces.work import Work


class CompletedWork(Work):
    """An operation that finished before its handle was returned."""

    def __init__(self, result: Any = None) -> None:
        self._result = result

    def wait(self, timeout: float | None = None) -> Any:
        return self._result

    def is_completed(self) -> bool:
        return True


class CompositeWork(Work):
    """Several handles waited as one; the result is the last handle's result."""

    def __init__(self, works: Sequence[Work], result: Any = None) -> None:
        self._works = list(works)
        self._result = result

    def wait(self, timeout: float | None = None) -> Any:
        for work in self._works:
            work.wait(timeout)
        return self._result

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._works)


class OnceWork(Work):
    """Idempotent wrapper around a backend's native handle.

    ``native_wait(timeout)`` blocks until the native operation is done, raising on failure;
    ``native_done()`` polls it. Buffers in ``keep_alive`` stay referenced until completion.
    The first outcome (result or error) is remembered and repeated by later waits.
    """

    def __init__(
        self,
        native_wait: Callable[[float | None], None],
        native_done: Callable[[], bool],
        result: Any = None,
        keep_alive: Sequence[Any] = (),
    ) -> None:
        self._native_wait = native_wait
        self._native_done = native_done
        self._result = result
        self._keep_alive: Sequence[Any] | None = keep_alive
        self._finished = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def wait(self, timeout: float | None = None) -> Any:
        with self._lock:
            if not self._finished:
                try:
                    self._native_wait(timeout)
                except BaseException as error:
                    self._error = error
                self._finished = True
                self._keep_alive = None
        if self._error is not None:
            raise self._error
        return self._result

    def is_completed(self) -> bool:
        return self._finished or self._native_done()


def first_reply(replies: Future[list[Any]]) -> Future[Any]:
    """A Future of the first element of ``replies``' result (or of its exception), resolved
    when ``replies`` is: what ``execute_model`` returns from a ``collective_rpc`` with one
    reply rank."""
    first: Future[Any] = Future()

    def settle(done: Future[list[Any]]) -> None:
        with contextlib.suppress(InvalidStateError):
            error = done.exception()
            if error is not None:
                first.set_exception(error)
            else:
                first.set_result(done.result()[0])

    replies.add_done_callback(settle)
    return first
