"""The handle an asynchronous operation returns."""

from __future__ import annotations

import abc
from typing import Any


class Work(abc.ABC):
    """A pending asynchronous operation (``isend``, ``irecv``).

    Contract:

    - ``wait(timeout)`` blocks until the operation completes and returns its result: the
      filled buffer for ``irecv``, ``None`` for sends.
      ``timeout`` is in seconds; ``None`` means the communicator's own deadline. Passing the
      deadline raises :class:`~shardline.errors.CommTimeoutError`; a dead peer raises
      :class:`~shardline.errors.PeerLostError`.
    - ``wait`` is idempotent: after success, later calls return the same result at once. After
      a failure, later calls raise the same error.
    - The handle keeps every buffer it reads or writes alive until it completes, so a caller
      may drop its own references right after starting the operation.
    - ``is_completed()`` never blocks. It is True once the operation has finished
      (successfully or not); then ``wait`` does not block.
    """

    @abc.abstractmethod
    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete; return the result (see class docstring)."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True when the operation has finished; never blocks."""
