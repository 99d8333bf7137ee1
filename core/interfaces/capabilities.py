"""What a communicator backend declares it supports.

Capabilities are data, checked before anything runs: config validation refuses an
unsupported combination with a message naming it, and the conformance suite skips exactly
the combinations a backend does not declare, with the same message as the skip reason.
The defaults are the safe minimum: a backend that declares nothing claims CPU float32 sums
within one host, with blocking point-to-point.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REDUCE_OP_NAMES: tuple[str, ...] = ("sum", "max", "min")


@dataclass(frozen=True)
class Capabilities:
    """Declared support of a communicator backend.

    - ``devices``: tensor device types accepted (``"cpu"``, ``"cuda"``).
    - ``dtypes``: dtype names accepted by tensor operations, of ``float32``, ``float16``,
      ``bfloat16``, ``int32``, ``int64``, ``uint8``. The control plane (objects, tensor
      dicts) sends uint8 and int64 tensors on any backend.
    - ``reduce_ops``: subset of ``"sum"``, ``"max"``, ``"min"``.
    - ``min_world_size`` / ``max_world_size``: group sizes the backend can form
      (``None``: no upper bound).
    - ``same_host_only``: every rank of a group must run on one host.
    - ``async_p2p``: ``isend``/``irecv`` return before the peer posts the matching call, so
      two ranks may ``isend`` to each other and then ``irecv``. When False they may block.
    - ``progresses_alone``: a started operation completes without further calls from its
      rank. False (MPI over TCP): it advances only while its rank waits on or polls it, so a
      rank must not leave a send pending while it waits for something else.
    - ``launcher``: the launcher that must start the ranks (``"mpiexec"`` for MPI); None:
      any process can join through the rendezvous store.
    """

    devices: frozenset[str] = field(default_factory=lambda: frozenset({"cpu"}))
    dtypes: frozenset[str] = field(default_factory=lambda: frozenset({"float32"}))
    reduce_ops: frozenset[str] = field(default_factory=lambda: frozenset({"sum"}))
    min_world_size: int = 1
    max_world_size: int | None = None
    same_host_only: bool = True
    async_p2p: bool = False
    progresses_alone: bool = True
    launcher: str | None = None

    def unsupported_reason(
        self,
        *,
        device: str | None = None,
        dtype: str | None = None,
        reduce_op: str | None = None,
        world_size: int | None = None,
        multi_host: bool = False,
        needs_async_p2p: bool = False,
    ) -> str | None:
        """Why the given combination is unsupported, or None when it is supported.

        The reason names the capability and what is supported instead, e.g.
        ``"dtype bfloat16 not supported (supported: float16, float32)"``.
        """
        if device is not None and device not in self.devices:
            return f"device {device} not supported (supported: {_listed(self.devices)})"
        if dtype is not None and dtype not in self.dtypes:
            return f"dtype {dtype} not supported (supported: {_listed(self.dtypes)})"
        if reduce_op is not None and reduce_op not in self.reduce_ops:
            return f"reduce op {reduce_op} not supported (supported: {_listed(self.reduce_ops)})"
        if world_size is not None:
            if world_size < self.min_world_size:
                return f"world size {world_size} below the minimum {self.min_world_size}"
            if self.max_world_size is not None and world_size > self.max_world_size:
                return f"world size {world_size} above the maximum {self.max_world_size}"
        if multi_host and self.same_host_only:
            return "ranks on several hosts not supported (same-host only)"
        if needs_async_p2p and not self.async_p2p:
            return "asynchronous point-to-point not supported (isend/irecv may block)"
        return None


def _listed(values: frozenset[str]) -> str:
    return ", ".join(sorted(values)) or "none"
