"""What the model and the host allow, checked before anything starts: layout sizes against the
model's heads and layers, and the memory plan of the ranks on this host against its memory
(``cache.memory_fraction``), with ``cache.num_blocks: auto`` sized to fit. The plan's weights
and KV cache are checked against what real ranks hold in test_engine."""

import os
import re

import pytest
import torch

from shardline.config import load_config
from shardline.config.capacity import (
    PROCESS_BYTES,
    HostMemory,
    HostRanks,
    plan_device_capacity,
    ranks_on_this_host,
)
from shardline.config.selection import check_config
from shardline.errors import ConfigError
from shardline.layers.kernels import screens_greedy_head
from shardline.models.llama_runner import LlamaModelRunner
from shardline.registry import Registry
from support.cli import shardline

GIB = 1 << 30


def _check(tiny_llama_dir, *overrides, available=8 * GIB):
    loaded = load_config(overrides=[f"model.path={tiny_llama_dir}", *overrides], environ={})
    return check_config(loaded, Registry.load(), {}, HostMemory(available, "test host"))


def test_layout_sizes_the_model_cannot_take_are_refused_in_one_message(tiny_llama_dir):
    # The tiny Llama: 4 layers, 8 heads, 2 KV heads, intermediate size 96.
    with pytest.raises(ConfigError) as error:
        _check(
            tiny_llama_dir,
            "parallel.tensor_parallel_size=16",
            "parallel.pipeline_parallel_size=5",
        )
    lines = str(error.value).splitlines()
    assert lines[0] == "invalid configuration:"
    assert re.search(
        r"--set parallel.tensor_parallel_size=16: parallel.tensor_parallel_size = 16: more than "
        r"the model's 8 attention heads; allowed: 1, 2, 3, 4, 6, 8",
        lines[1],
    )
    assert re.search(
        r"--set parallel.pipeline_parallel_size=5: parallel.pipeline_parallel_size = 5: the model "
        r"has only 4 layers \(every stage needs one\); allowed: 1..4",
        lines[2],
    )
    with pytest.raises(ConfigError, match=r"= 5: does not divide the model's intermediate_size"):
        _check(tiny_llama_dir, "parallel.tensor_parallel_size=5")


def test_a_cache_larger_than_the_host_is_refused_with_the_figures(tiny_llama_dir):
    checked = _check(tiny_llama_dir, "parallel.tensor_parallel_size=2")
    share = checked.capacity.shares[0]
    per_block = share.memory.kv_cache_block
    # 4 layers x K and V x 16 tokens x 1 KV head x 8 dims x 4 bytes, on each of 2 ranks.
    assert per_block == 4 * 2 * 16 * 1 * 8 * 4
    with pytest.raises(ConfigError) as error:
        _check(tiny_llama_dir, "parallel.tensor_parallel_size=2", "cache.num_blocks=16777216")
    message = str(error.value)
    assert message.startswith("--set cache.num_blocks=16777216: cache.num_blocks = 16777216: ")
    assert "2 ranks need" in message and "this host has 8.0 GiB available (test host)" in message
    assert "cache.memory_fraction = 0.9 allows 7.2 GiB" in message
    fitting = int(re.search(r"cache.num_blocks <= (\d+) here", message).group(1))
    assert (
        _check(
            tiny_llama_dir, "parallel.tensor_parallel_size=2", f"cache.num_blocks={fitting}"
        ).capacity.headroom
        >= 0
    )
    with pytest.raises(ConfigError, match="does not fit this host"):
        _check(tiny_llama_dir, "parallel.tensor_parallel_size=2", f"cache.num_blocks={fitting + 1}")


def test_auto_sizes_the_cache_to_the_budget_and_to_what_sequences_can_use(tiny_llama_dir):
    roomy = _check(tiny_llama_dir, "cache.num_blocks=auto", "scheduler.max_num_seqs=4")
    # Room for everything: 4 sequences of the model's 64-token context, 4 blocks each.
    assert roomy.config.cache.num_blocks == roomy.capacity.num_blocks == 16
    assert roomy.capacity.max_model_len == 64
    sizes = ["cache.num_blocks=auto", "parallel.tensor_parallel_size=2", "cache.memory_fraction=1"]
    unbounded = _check(tiny_llama_dir, *sizes).capacity
    assert unbounded.num_blocks == 4 * 32  # the default 32 sequences of 64 tokens
    kv = sum(len(share.ranks) * share.kv_cache for share in unbounded.shares)
    per_block = kv // unbounded.num_blocks
    host = unbounded.total - kv + 100 * per_block + per_block // 2
    tight = _check(tiny_llama_dir, *sizes, available=host)
    assert tight.capacity.num_blocks == 100
    assert tight.capacity.max_model_len == 64
    assert tight.capacity.headroom >= 0
    with pytest.raises(ConfigError, match=r"the model does not fit this host: .* before any KV"):
        _check(tiny_llama_dir, *sizes, available=PROCESS_BYTES)


def test_rank_processes_count_even_without_a_model():
    loaded = load_config(overrides=["parallel.tensor_parallel_size=64"], environ={})
    with pytest.raises(ConfigError) as error:
        check_config(loaded, Registry.load(), {}, HostMemory(8 * GIB, "test host"))
    assert str(error.value) == (
        "--set parallel.tensor_parallel_size=64: the ranks do not fit this host: 64 rank "
        "processes need 16.0 GiB (256.0 MiB each before loading anything); this host has "
        "8.0 GiB available (test host) and cache.memory_fraction = 0.9 allows 7.2 GiB; allowed: "
        "fewer ranks on this host (64 now), more hosts (parallel.nnodes), or a higher "
        "cache.memory_fraction"
    )


def test_max_model_len_is_checked_against_the_model_and_the_cache(tiny_llama_dir):
    with pytest.raises(ConfigError, match=r"max_model_len = 65: the model's context is 64 tokens"):
        _check(tiny_llama_dir, "scheduler.max_model_len=65")
    with pytest.raises(ConfigError, match=r"the KV cache holds 32 tokens \(cache.num_blocks 2 x"):
        _check(tiny_llama_dir, "scheduler.max_model_len=40", "cache.num_blocks=2")


def test_planned_weights_are_the_model_parameters(tiny_llama_dir):
    """At TP=1 the plan's weights are transformers' parameter bytes plus the vocabulary
    padding of the embedding and LM head (100 rows padded to 128), and the head's greedy
    screen where the C kernels make one (Q8_0 codes: 34 bytes a 32 values; two float32 bounds
    a row)."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    parameters = sum(p.numel() for p in model.parameters())
    padding = 2 * (128 - 100) * 64
    screen = 128 * 64 // 32 * 34 + 8 * 128 if screens_greedy_head("cpu", os.environ) else 0
    (share,) = _check(tiny_llama_dir).capacity.shares
    assert share.memory.weights == 4 * (parameters + padding) + screen


@pytest.mark.parametrize(
    "arguments",
    [
        ["conformance", "gloo", "--world-sizes", "1,1000"],
        ["conformance", "mp", "--world-sizes", "1000"],
        ["bench", "comm", "-n", "1000"],
        ["demo", "--set", "parallel.tensor_parallel_size=1000"],
    ],
    ids=["communicator-suite", "executor-suite", "bench-comm", "demo"],
)
def test_commands_refuse_more_rank_processes_than_the_host_holds(arguments):
    result = shardline(*arguments, timeout=60)
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "1000 rank processes need 250.0 GiB (256.0 MiB each" in line, line


def test_ranks_on_devices_of_their_own_are_each_planned_against_their_device(tiny_llama_dir):
    """parallel.device = cuda: each rank's weights and KV cache go to its own device, so the
    device with the least free memory sizes an auto cache, and a device too small for its
    rank is named."""
    loaded = loaded_with(tiny_llama_dir)
    placement = HostRanks((0, 1), frozenset({0, 1}), "2 ranks on this host")
    free = {0: 8 * GIB, 1: GIB // 64}

    def memory_of(index):
        return HostMemory(free[index], f"free memory of fake device {index}")

    plan = LlamaModelRunner.plan(loaded.config)
    auto = loaded_with(tiny_llama_dir, "cache.num_blocks=auto", "scheduler.max_num_seqs=65536")
    tight = plan_device_capacity(auto, plan, placement, memory_of)
    roomy = plan_device_capacity(auto, plan, HostRanks((0,), frozenset({0}), "one rank"), memory_of)
    # Device 1 (1/64 GiB) holds fewer blocks than device 0 (8 GiB) alone would.
    assert 0 < tight.num_blocks < roomy.num_blocks
    assert tight.host.source == "free memory of fake device 1"
    assert tight.placement.ranks == (1,)
    # Each rank's share alone counts against its device: no process bytes there.
    assert tight.total == tight.shares[0].peak
    with pytest.raises(ConfigError, match=r"free memory of fake device 1"):
        plan_device_capacity(
            loaded_with(tiny_llama_dir, "cache.num_blocks=100000"), plan, placement, memory_of
        )


def loaded_with(tiny_llama_dir, *overrides):
    return load_config(
        overrides=[f"model.path={tiny_llama_dir}", "parallel.tensor_parallel_size=2", *overrides],
        environ={},
    )


@pytest.mark.parametrize(
    ("world", "rank", "local_rank", "local_size", "expected"),
    [
        (4, 1, 2, 4, (0, 1, 2, 3)),  # mpiexec oversubscribing 2 cores numbered it so
        (4, 3, 1, 2, (2, 3)),  # two hosts, each host's ranks in world order
        (4, 2, 1, 2, (1, 2)),  # not in world order: as many ranks, this one among them
        (4, 0, 1, 2, (0, 1)),
    ],
)
def test_a_launched_rank_plans_its_hosts_ranks_whatever_their_local_order(
    world, rank, local_rank, local_size, expected
):
    config = load_config(
        overrides=["parallel.distributed_executor_backend=external_launcher",
                   f"parallel.tensor_parallel_size={world}"],
        environ={},
    ).config  # fmt: skip
    environ = {
        "OMPI_COMM_WORLD_SIZE": str(world),
        "OMPI_COMM_WORLD_RANK": str(rank),
        "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank),
        "OMPI_COMM_WORLD_LOCAL_SIZE": str(local_size),
    }
    executor = Registry.load().get("executor", "external_launcher").load_available()
    placed = ranks_on_this_host(config, executor, environ)
    assert placed.ranks == expected
    assert placed.new_processes == frozenset(expected) - {rank}
