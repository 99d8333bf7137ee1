"""Callables sent to mp workers by the executor tests (module level, so they pickle by name
as well as by value)."""

from __future__ import annotations

import os
import time


def rank_and_pid(worker):
    return worker.rank, os.getpid()


def raise_on_rank(worker, rank: int):
    if worker.rank == rank:
        raise KeyError(f"planted failure on rank {rank}")
    return worker.rank


def sleep_on_rank(worker, rank: int, seconds: float):
    if worker.rank == rank:
        time.sleep(seconds)
    return worker.rank


def echo(worker, value):
    return value


def raise_everywhere(worker):
    raise RuntimeError(f"planted failure on every rank ({worker.rank})")
