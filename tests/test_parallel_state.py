"""GroupCoordinator and ParallelState on real gloo worlds."""

import threading

import pytest
import torch

from shardline.comm.store import serve_store
from shardline.config import load_config
from shardline.conformance.executors.probe import LoadsOnlyWhereMade
from shardline.distributed import GroupCoordinator, ParallelLayout, ParallelState
from shardline.errors import WorkerError
from shardline.launch.comm_world import ParallelSetup
from shardline.launch.local_world import LocalWorld
from shardline_gloo.communicator import GlooBackend

pytestmark = pytest.mark.timeout(120)


def test_two_ranks_state_in_one_process():
    """No globals: two ranks' worlds and states live side by side in one process."""
    _store, rendezvous = serve_store()
    states: dict[int, ParallelState] = {}
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            backend = GlooBackend()
            data = backend.init_world(rank, 2, rendezvous.with_prefix("data"), 30.0)
            control = backend.init_world(rank, 2, rendezvous.with_prefix("control"), 30.0)
            state = ParallelState.create(
                ParallelLayout(pipeline_parallel_size=2), data, control, rendezvous.secret
            )
            states[rank] = state
            if state.pp.is_first_rank:
                state.pp.send_tensor_dict({"x": torch.arange(6.0).reshape(2, 3), "note": "hi"})
            else:
                got = state.pp.recv_tensor_dict()
                assert (
                    torch.equal(got["x"], torch.arange(6.0).reshape(2, 3)) and got["note"] == "hi"
                )
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert [states[r].pp.rank_in_group for r in (0, 1)] == [0, 1]
    assert states[0].tp.world_size == 1 and states[0].is_driver
    assert states[1].is_output_rank and not states[0].is_output_rank


def _positions(ctx) -> dict:
    state = ctx.state
    return {
        name: (g.ranks, g.rank_in_group, g.is_first_rank, g.is_last_rank, g.next_rank, g.prev_rank)
        for name, g in (("tp", state.tp), ("pp", state.pp), ("world", state.world))
    }


def _tp_assisted_hop(ctx) -> dict:
    """Stage 0 sends; stage 1 receives with the TP all-gather. Tensors divisible by tp go as
    slices, ``residual`` is excluded by all_gather_tensors, ``odd`` (5 elements) is whole."""
    state = ctx.state
    tp, pp = state.tp, state.pp
    sent = {
        "hidden_states": torch.arange(24.0).reshape(4, 6),
        "residual": torch.ones(4, 6) * 3,
        "odd": torch.arange(5, dtype=torch.int64),
        "step": 7,
    }
    flags = {"residual": False}
    if pp.is_first_rank:
        pp.isend_tensor_dict(sent, all_gather_group=tp, all_gather_tensors=flags).wait()
        return {}
    received = pp.irecv_tensor_dict(all_gather_group=tp, all_gather_tensors=flags).wait()
    return {
        key: (value.tolist() if isinstance(value, torch.Tensor) else value)
        for key, value in received.items()
    }


@pytest.fixture(scope="module")
def tp2_pp2_world():
    config = load_config(
        overrides=["parallel.tensor_parallel_size=2", "parallel.pipeline_parallel_size=2"],
        environ={},
    )
    with LocalWorld(4, ParallelSetup(config.config), call_timeout_s=60) as world:
        yield world


def test_group_positions(tp2_pp2_world):
    positions = tp2_pp2_world.run(_positions)
    assert positions[0]["tp"] == ([0, 1], 0, True, False, 1, 1)
    assert positions[3]["tp"] == ([2, 3], 1, False, True, 0, 0)
    assert positions[1]["pp"] == ([1, 3], 0, True, False, 1, 1)
    assert positions[3]["pp"] == ([1, 3], 1, False, True, 0, 0)
    assert positions[2]["world"][:2] == ([0, 1, 2, 3], 2)


def test_tp_assisted_pipeline_transfer(tp2_pp2_world):
    results = tp2_pp2_world.run(_tp_assisted_hop)
    for received in results[2:]:
        assert received["hidden_states"] == torch.arange(24.0).reshape(4, 6).tolist()
        assert received["residual"] == (torch.ones(4, 6) * 3).tolist()
        assert received["odd"] == list(range(5))
        assert received["step"] == 7


def _refuse_to_load():
    raise LookupError("this argument loads only in the parent")


class _LoadsOnlyInTheParent:
    """An argument a rank fails to unpickle (as it fails a function of the parent's
    ``__main__``)."""

    def __reduce__(self):
        return (_refuse_to_load, ())


def test_a_call_a_rank_cannot_load_fails_and_the_world_goes_on(tp2_pp2_world):
    """LocalWorld: a call the ranks cannot unpickle is answered with its error, as a call
    that raises is; no rank dies, and the next call runs."""
    with pytest.raises(WorkerError, match="loads only in the parent") as failed:
        tp2_pp2_world.run(_positions, _LoadsOnlyInTheParent())
    assert failed.value.exc_type == "LookupError"
    assert tp2_pp2_world.broken is None
    assert len(tp2_pp2_world.run(_positions)) == 4


def _a_lock(ctx) -> threading.Lock:
    return threading.Lock()


def test_a_result_that_cannot_be_pickled_fails_the_call_and_the_world_goes_on(tp2_pp2_world):
    with pytest.raises(WorkerError, match=r"reply cannot be pickled .*_thread\.lock"):
        tp2_pp2_world.run(_a_lock)
    assert tp2_pp2_world.broken is None
    assert len(tp2_pp2_world.run(_positions)) == 4


def _made_in_the_rank(ctx) -> LoadsOnlyWhereMade:
    return LoadsOnlyWhereMade()


def test_a_result_the_parent_cannot_load_fails_the_call_and_the_world_goes_on(tp2_pp2_world):
    loaded_nowhere_else = "cannot be loaded where it arrived: LookupError"
    with pytest.raises(WorkerError, match=loaded_nowhere_else) as failed:
        tp2_pp2_world.run(_made_in_the_rank)
    assert failed.value.exc_type == "TypeError"
    assert "loads only in the process that made it" in str(failed.value)
    assert tp2_pp2_world.broken is None
    assert len(tp2_pp2_world.run(_positions)) == 4


def test_a_call_that_cannot_be_pickled_is_refused_before_anything_is_sent(tp2_pp2_world):
    with pytest.raises(TypeError, match=r"call '_positions' cannot be pickled .*_thread\.lock"):
        tp2_pp2_world.run(_positions, threading.Lock())
    assert tp2_pp2_world.broken is None
    assert len(tp2_pp2_world.run(_positions)) == 4


def test_group_coordinator_rejects_mismatched_communicators():
    _store, rendezvous = serve_store()
    world = GlooBackend().init_world(0, 1, rendezvous, 10.0)
    with pytest.raises(ValueError, match="2 ranks but communicators of sizes 1"):
        GroupCoordinator("tp", [0, 1], world, world, b"s" * 32)
