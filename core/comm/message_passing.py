"""A base class for backends that can only move bytes: implement two methods, get every
Communicator operation.

A subclass provides ``_post(channel, dst, seq, data)`` (deliver a message without waiting for
the receiver) and ``_fetch(channel, src, seq, timeout_s)`` (block until that message is there
and return it, raising :class:`~shardline.errors.CommTimeoutError` at the deadline), plus the
identity properties, ``new_group`` and ``close``. Messages are numbered per (channel, peer,
direction), so a transport may use ``seq`` as a key (a key-value store) or ignore it (a FIFO
stream). Collectives and point-to-point use separate channels and never mix.

Collectives here are the simple all-to-all algorithms: correct and deterministic (reductions
run in rank order, so every rank gets bit-identical results), not fast.
"""

from __future__ import annotations

import abc
from collections import defaultdict

import torch

from shardline.comm.work import CompletedWork, OnceWork
from shardline.interfaces import Communicator, ReduceOp, Work

P2P = "p2p"
COLLECTIVE = "coll"


class MessagePassingCommunicator(Communicator):
    """Every operation of the contract, built on :meth:`_post` and :meth:`_fetch`."""

    def __init__(self) -> None:
        super().__init__()
        self._sent: defaultdict[tuple[str, int], int] = defaultdict(int)
        self._received: defaultdict[tuple[str, int], int] = defaultdict(int)

    # ---- the transport a subclass provides -----------------------------------------------------

    @abc.abstractmethod
    def _post(self, channel: str, dst: int, seq: int, data: bytes) -> None:
        """Deliver message number ``seq`` of ``channel`` to rank ``dst``; must not wait for
        ``dst`` to receive it."""

    @abc.abstractmethod
    def _fetch(self, channel: str, src: int, seq: int, timeout_s: float) -> bytes:
        """Message number ``seq`` of ``channel`` from rank ``src``, waiting at most
        ``timeout_s``; raises CommTimeoutError after that."""

    # ---- numbering -----------------------------------------------------------------------------

    def _send_bytes(self, channel: str, dst: int, data: bytes) -> None:
        seq = self._sent[channel, dst]
        self._sent[channel, dst] = seq + 1
        self._post(channel, dst, seq, data)

    def _next_receive(self, channel: str, src: int) -> int:
        seq = self._received[channel, src]
        self._received[channel, src] = seq + 1
        return seq

    def _exchange(self, outgoing: dict[int, torch.Tensor], sources: list[int]) -> dict[int, bytes]:
        for dst, tensor in outgoing.items():
            self._send_bytes(COLLECTIVE, dst, _to_bytes(tensor))
        seqs = {src: self._next_receive(COLLECTIVE, src) for src in sources}
        return {src: self._fetch(COLLECTIVE, src, seq, self.timeout_s) for src, seq in seqs.items()}

    def _others(self) -> list[int]:
        return [r for r in range(self.world_size) if r != self.rank]

    # ---- collectives ---------------------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM) -> torch.Tensor:
        mine = tensor.contiguous()
        received = self._exchange({r: mine for r in self._others()}, self._others())
        parts = [
            mine if r == self.rank else _from_bytes(received[r], mine)
            for r in range(self.world_size)
        ]
        return _reduce(parts, ReduceOp(op))

    def all_gather(self, tensor: torch.Tensor, dim: int = 0) -> torch.Tensor:
        mine = tensor.contiguous()
        received = self._exchange({r: mine for r in self._others()}, self._others())
        parts = [
            mine if r == self.rank else _from_bytes(received[r], mine)
            for r in range(self.world_size)
        ]
        return torch.cat(parts, dim=dim)

    def reduce_scatter(
        self, tensor: torch.Tensor, dim: int = 0, op: ReduceOp = ReduceOp.SUM
    ) -> torch.Tensor:
        if tensor.dim() == 0 or tensor.shape[dim] % self.world_size:
            raise ValueError(
                f"reduce_scatter: size {tuple(tensor.shape)} along dim {dim} is not divisible "
                f"by the group size {self.world_size}"
            )
        chunks = [c.contiguous() for c in tensor.chunk(self.world_size, dim=dim)]
        received = self._exchange({r: chunks[r] for r in self._others()}, self._others())
        mine = chunks[self.rank]
        parts = [
            mine if r == self.rank else _from_bytes(received[r], mine)
            for r in range(self.world_size)
        ]
        return _reduce(parts, ReduceOp(op))

    def gather(self, tensor: torch.Tensor, dst: int = 0, dim: int = 0) -> torch.Tensor | None:
        mine = tensor.contiguous()
        if self.rank != dst:
            self._exchange({dst: mine}, [])
            return None
        received = self._exchange({}, self._others())
        parts = [
            mine if r == dst else _from_bytes(received[r], mine) for r in range(self.world_size)
        ]
        return torch.cat(parts, dim=dim)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.rank == src:
            self._exchange({r: tensor.contiguous() for r in self._others()}, [])
        else:
            tensor.copy_(_from_bytes(self._exchange({}, [src])[src], tensor))
        return tensor

    def barrier(self) -> None:
        token = torch.zeros(1, dtype=torch.uint8)
        self._exchange({r: token for r in self._others()}, self._others())

    # ---- point to point --------------------------------------------------------------------------

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        self._send_bytes(P2P, dst, _to_bytes(tensor.contiguous()))

    def recv(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        return self.irecv(tensor, src).wait()

    def isend(self, tensor: torch.Tensor, dst: int) -> Work:
        self.send(tensor, dst)
        return CompletedWork()

    def irecv(self, tensor: torch.Tensor, src: int) -> Work:
        seq = self._next_receive(P2P, src)

        def fetch(timeout: float | None) -> None:
            data = self._fetch(P2P, src, seq, self.timeout_s if timeout is None else timeout)
            tensor.copy_(_from_bytes(data, tensor))

        return OnceWork(fetch, lambda: False, result=tensor, keep_alive=[tensor])


def _to_bytes(tensor: torch.Tensor) -> bytes:
    if tensor.numel() == 0:
        return b""
    return tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def _from_bytes(data: bytes, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and typed like ``like`` from ``data``; ValueError if sizes differ."""
    expected = like.numel() * like.element_size()
    if len(data) != expected:
        raise ValueError(
            f"message of {len(data)} bytes does not fit a {like.dtype} tensor of shape "
            f"{tuple(like.shape)} ({expected} bytes)"
        )
    if expected == 0:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return flat.view(like.dtype).reshape(like.shape)


def _reduce(parts: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    result = parts[0].clone()
    for part in parts[1:]:
        if op is ReduceOp.SUM:
            result += part
        elif op is ReduceOp.MAX:
            torch.maximum(result, part, out=result)
        else:
            torch.minimum(result, part, out=result)
    return result
