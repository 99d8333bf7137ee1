"""The custom all-reduce: the whole conformance suite at world sizes 1-4, the shared path
taken on one host for one-shot and two-shot sizes (one shot in C and in Python: every dtype
and op, the same bits on every rank), and no /dev/shm segment left, not even
while the world runs or after a rank is killed."""

import ast
import json
import mmap
import subprocess
import sys

import pytest
import torch

from shardline.errors import PeerLostError
from shardline.interfaces import ReduceOp
from shardline.launch.comm_world import CommunicatorSetup
from shardline.launch.local_world import LocalWorld
from support import allreduce_checks
from support.cli import shardline
from support.segments import job_segments

SUITE_TIMEOUT = 900


def _segments(job):
    return set(job_segments(job))


@pytest.mark.timeout(SUITE_TIMEOUT + 60)
def test_custom_ar_passes_the_whole_suite(tmp_path, own_shm):
    report_path = tmp_path / "custom_ar.json"
    # World sizes 2-4 here (CI time; a world of one is its base's); the CLI runs 1-4.
    result = shardline(
        "conformance",
        "custom_ar",
        "--world-sizes=2,3,4",
        "--report",
        str(report_path),
        timeout=SUITE_TIMEOUT,
        wrap=own_shm.wrap,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    report = json.loads(report_path.read_text())
    assert report["summary"] == {"passed": report["summary"]["passed"]}
    assert report["summary"]["passed"] > 800
    assert {case["world_size"] for case in report["cases"]} == {2, 3, 4}
    assert own_shm.entries() == []


@pytest.fixture(params=["native", "python"])
def one_shot_path(request, monkeypatch):
    """Both one-shot paths: C (the extension, built by the install) and the pure-Python
    fallback (``SHARDLINE_NATIVE=0``, inherited by the rank processes)."""
    if request.param == "python":
        monkeypatch.setenv("SHARDLINE_NATIVE", "0")
    else:
        pytest.importorskip("shardline_custom_allreduce._native", reason="extension not built")
        monkeypatch.delenv("SHARDLINE_NATIVE", raising=False)
    return request.param


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [2, 3])
def test_shared_path_one_shot_and_two_shot(one_shot_path, ranks):
    """One shot up to 256 KiB (4 MiB with two ranks), two shots past it: 1.2 MB is one shot
    with two ranks and two shots with three; 4 MiB + 12 B is two shots for both."""
    cases = ((5, "float32"), (1000, "bfloat16"), (300_000, "float32"), ((1 << 20) + 3, "float32"))
    with LocalWorld(ranks, CommunicatorSetup("custom_ar", 30.0), call_timeout_s=120) as world:
        for count, dtype in cases:
            results = world.run(allreduce_checks.paths_and_results, count, dtype)
            inputs = [(torch.arange(count) % 7 + r).to(getattr(torch, dtype)) for r in range(ranks)]
            expected_sum = torch.stack(inputs).sum(0).to(getattr(torch, dtype))
            expected_max = torch.stack(inputs).amax(0)
            for shared, native, total, largest in results:
                assert shared and native == (one_shot_path == "native")
                assert torch.equal(total, expected_sum) and torch.equal(largest, expected_max)
        per_rank = world.run(allreduce_checks.every_dtype_and_op)
        for key, result in per_rank[0].items():
            expected = allreduce_checks.expected_reduction(ranks, *key)
            assert result.shape == expected.shape and result.dtype == expected.dtype, key
            assert result.is_contiguous(), key
            # The same bits on every rank, and torch's (NaN where any rank has one).
            for other in per_rank[1:]:
                assert torch.equal(
                    other[key].view(-1).view(torch.uint8), result.view(-1).view(torch.uint8)
                ), key
            assert torch.equal(result.nan_to_num(7.0), expected.nan_to_num(7.0)), key
        shared, names = world.run(allreduce_checks.segments_while_mapped, world.rendezvous.job)[0]
        assert shared and names == []  # unlinked as soon as every rank mapped it


@pytest.mark.timeout(180)
@pytest.mark.parametrize("ranks", [2, 3])
def test_ranks_running_ahead_never_see_a_slot_overwritten(one_shot_path, ranks):
    """Small calls alternate the slot sets; every 50th is 512 KiB (one shot with two ranks,
    two shots with three)."""
    with LocalWorld(ranks, CommunicatorSetup("custom_ar", 30.0), call_timeout_s=120) as world:
        assert world.run(allreduce_checks.back_to_back, 400, 1) == [[]] * ranks


@pytest.mark.timeout(180)
def test_routed_and_general_calls_mixed_give_every_rank_the_sums(one_shot_path):
    """Calls the C router runs (a size, dtype and op it has a route for) and calls it hands
    to the Python method (a first call, a subclass, a transposed input, an op it has no
    route for, more sizes than it keeps) share one numbering: every result right."""
    rounds = 30
    with LocalWorld(2, CommunicatorSetup("custom_ar", 30.0), call_timeout_s=120) as world:
        results = world.run(allreduce_checks.routed_variants, rounds)
    expected = allreduce_checks.expected_routed_variants(2, rounds)
    for router, cases in results:
        assert router == ("AllReduce" if one_shot_path == "native" else "method")
        assert [case for case, _ in cases] == [case for case, _ in expected]
        for (case, result), (_, wanted) in zip(cases, expected, strict=True):
            assert result.dtype == wanted.dtype and torch.equal(result, wanted), case
            assert not result.requires_grad, case


def test_the_router_runs_a_routed_call_in_c_and_hands_every_other_call_on():
    """One process, the peer's slots and flag written by hand: with no route a call is the
    general path's; with one, the C path sums this rank's input and the peer's slot into a
    tensor of the input's shape (or calls finish with the call's number when the peer has
    not arrived within the spin); numbers are shared with take()."""
    native = pytest.importorskip("shardline_custom_allreduce._native", reason="not built")
    slot_bytes, nbytes = 4096, 16
    memory = mmap.mmap(-1, 128 + 4 * slot_bytes)
    plan = native.OneShot(
        memory=memory,
        flags_offset=0,
        flag_stride=64,
        slots_offset=128,
        slot_bytes=slot_bytes,
        world_size=2,
        rank=0,
        dtype="float32",
        op="sum",
        nbytes=nbytes,
        spin_checks=10,
        empty_like=torch.empty_like,
    )
    general, finished = [], []
    router = native.AllReduce(
        general=lambda tensor, op=ReduceOp.SUM: general.append((tensor, op)) or "general",
        finish=lambda plan, tensor, call: finished.append(call) or "finish",
        tensor_type=torch.Tensor,
        default_op=ReduceOp.SUM,
    )
    mine = torch.arange(4, dtype=torch.float32)
    assert router(mine) == "general" and general[-1][1] is ReduceOp.SUM
    router.route(torch.float32, ReduceOp.SUM, nbytes, plan)
    assert router(mine) == "finish" and finished == [1]  # the peer never announced call 1
    peer_flag = memoryview(memory)[64:72].cast("q")
    peer_flag[0] = 1 << 40  # the peer has arrived at every call from now on
    for parity in (0, 1):  # the peer's slot of either call parity
        offset = 128 + (parity * 2 + 1) * slot_bytes
        torch.frombuffer(memory, dtype=torch.float32, count=4, offset=offset).copy_(
            torch.tensor([10.0, 20.0, 30.0, 40.0])
        )
    assert torch.equal(router(mine), torch.tensor([10.0, 21.0, 32.0, 43.0]))
    assert torch.equal(
        router(mine.view(2, 2), op=ReduceOp.SUM), torch.tensor([[10.0, 21.0], [32.0, 43.0]])
    )
    assert router.calls == 3 and router.take(2) == 4 and router.take(0) == 6 and router.calls == 5
    assert torch.equal(router(mine), torch.tensor([10.0, 21.0, 32.0, 43.0]))  # call 6
    handed_on = [
        (mine, ReduceOp.MAX),  # no route for the op
        (mine.to(torch.int32), ReduceOp.SUM),  # nor for the dtype at that size
        (torch.arange(8, dtype=torch.float32).view(2, 4)[:, :2], ReduceOp.SUM),  # strided
        (torch.nn.Parameter(mine.clone()), ReduceOp.SUM),  # a subclass
    ]
    for tensor, op in handed_on:
        assert router(tensor, op) == "general" and general[-1] == (tensor, op)
    assert router(tensor=mine) == "general"  # keyword forms other than op= go on as given
    assert router.calls == 6 and finished == [1]
    with pytest.raises(ValueError, match="nbytes"):
        router.route(torch.float32, ReduceOp.SUM, 8, plan)
    with pytest.raises(ValueError, match=">= 0"):
        router.take(-1)
    router.clear()
    assert router(mine) == "general"
    del router, plan
    peer_flag.release()
    memory.close()


@pytest.mark.timeout(180)
def test_a_killed_rank_leaves_no_segment():
    world = LocalWorld(3, CommunicatorSetup("custom_ar", 30.0), call_timeout_s=60)
    try:
        with pytest.raises(PeerLostError, match="rank 2"):
            world.run(allreduce_checks.die_in_all_reduce, 2)
    finally:
        world.close()
    assert _segments(world.rendezvous.job) == set()


@pytest.mark.timeout(180)
def test_a_native_run_sums_as_all_reduce_does_and_the_calls_go_on_after_it():
    """Communicator.native_all_reduce: a C entry point for the next calls (a decode step's
    all-reduces, made from C without the GIL): every rank gets the same bits all_reduce gives
    for the same inputs, and all_reduce works after the run."""
    pytest.importorskip("shardline_custom_allreduce._native", reason="extension not built")
    pytest.importorskip("shardline.layers._kernels", reason="kernels extension not built")
    with LocalWorld(3, CommunicatorSetup("custom_ar", 30.0), call_timeout_s=120) as world:
        results = world.run(allreduce_checks.native_runs, 2, 5)
    first = results[0][2]
    for calls, failures, natively, reduced, after in results:
        assert calls == 5 and failures == [None] * 5
        for native, expected, rank0 in zip(natively, reduced, first, strict=True):
            assert torch.equal(native, expected) and torch.equal(native, rank0)
        assert torch.equal(after, torch.full((3,), 3.0))


@pytest.mark.timeout(120)
def test_a_native_run_names_the_rank_that_never_arrives_by_its_deadline():
    pytest.importorskip("shardline_custom_allreduce._native", reason="extension not built")
    pytest.importorskip("shardline.layers._kernels", reason="kernels extension not built")
    # Operations end by 2 s; the ranks' start (3 on 2 cores, a loaded host) gets longer.
    setup = CommunicatorSetup("custom_ar", 2.0, join_timeout_s=60.0)
    with LocalWorld(3, setup, call_timeout_s=60) as world:
        results = world.run(allreduce_checks.native_run_with_a_silent_rank, 1)
    assert results[1] is None
    for rank in (0, 2):
        failure, seconds, kind, error = results[rank]
        message = f"custom_ar all_reduce on rank {rank} of 3: ranks [1] did not arrive within 2 s"
        assert failure == (message, True)  # timed out
        assert 2.0 <= seconds < 4.0
        assert kind == "CommTimeoutError" and error.startswith(message)


@pytest.mark.timeout(120)
def test_a_native_run_called_more_often_than_made_for_is_a_communication_error():
    """Not a timeout: the extra call does nothing and says so; the group goes on."""
    pytest.importorskip("shardline_custom_allreduce._native", reason="extension not built")
    pytest.importorskip("shardline.layers._kernels", reason="kernels extension not built")
    with LocalWorld(2, CommunicatorSetup("custom_ar", 10.0), call_timeout_s=60) as world:
        results = world.run(allreduce_checks.native_run_called_too_often)
    for first, kind, message, after in results:
        assert first is None
        assert kind == "CommunicationError"
        assert message.startswith(
            "custom_ar: a native all-reduce run was called more often than the calls it was "
            "made for"
        )
        assert after == [1.0, 1.0, 1.0]


@pytest.mark.timeout(120)
def test_the_barrier_is_kept_in_the_segment_and_names_a_rank_that_never_enters():
    """Barriers between all-reduces run on the segment's flags (a late rank is named by
    custom_ar, by the group's deadline), not on the base's barrier."""
    setup = CommunicatorSetup("custom_ar", 2.0, join_timeout_s=60.0)  # a slow start is not it
    with LocalWorld(3, setup, call_timeout_s=60) as world:
        results = world.run(allreduce_checks.barrier_with_a_silent_rank, 2, 50)
    assert results[2] is None
    for rank in (0, 1):
        message, seconds = results[rank]
        assert (
            message == f"custom_ar barrier on rank {rank} of 3: ranks [2] did not arrive within 2 s"
        )
        assert 2.0 <= seconds < 4.0


def test_the_base_is_built_without_running_any_other_plugin():
    """A one-rank custom_ar world imports the gloo plugin for its base and no other one."""
    program = (
        "import sys\n"
        "from shardline.comm.store import serve_store\n"
        "from shardline_custom_allreduce.communicator import CustomAllReduceBackend\n"
        "store, rendezvous = serve_store()\n"
        "comm = CustomAllReduceBackend().init_world(0, 1, rendezvous, 30.0)\n"
        "comm.close()\n"
        "print(sorted(m for m in sys.modules if m.startswith('shardline_')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    loaded = {name.split(".")[0] for name in ast.literal_eval(done.stdout)}
    assert loaded == {"shardline_custom_allreduce", "shardline_gloo"}
