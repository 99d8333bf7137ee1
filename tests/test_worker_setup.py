"""A rank's start-up (``WorkerSetup.build``): a rank of the world that never starts is named
by the others before their start-up phase's deadline."""

import time

import pytest

from shardline.comm.store import serve_store
from shardline.config import load_config
from shardline.errors import CommTimeoutError
from shardline.worker.setup import REPORT_S, WorkerSetup

STARTUP_TIMEOUT_S = 6.0


def test_a_rank_that_never_starts_is_named_before_the_start_up_deadline(tiny_llama_dir):
    store, rendezvous = serve_store()
    config = load_config(
        overrides=[
            f"model.path={tiny_llama_dir}",
            "parallel.tensor_parallel_size=2",
            f"parallel.startup_timeout_s={STARTUP_TIMEOUT_S}",
            "parallel.timeout_s=30",  # a join would wait this long for rank 1
        ],
        environ={},
    ).config
    began = time.monotonic()
    with pytest.raises(CommTimeoutError, match=r"rank 0 of 2: ranks \[1\] did not start"):
        WorkerSetup(config).build(0, 2, rendezvous)
    elapsed = time.monotonic() - began
    assert STARTUP_TIMEOUT_S - REPORT_S - 1.0 < elapsed < STARTUP_TIMEOUT_S, elapsed
    del store
