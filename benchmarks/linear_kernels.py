"""Which CPU kernel multiplies a decode step's weights fastest: the shapes of one rank of
SmolLM2-135M (TP=1 and TP=2) at 1, 4 and 16 rows, one torch thread by default (a TP=2 rank's
share of this machine; ``--threads 2``: a TP=1 rank's), in one run:

- ``F.linear``, weight ``[out, in]`` contiguous (as checkpoints store it; torch's GEMM);
- ``F.linear``, weight stored column by column (``[in, out]`` contiguous);
- oneDNN's linear on the weight packed in its blocked layout (``shardline.layers.kernels.packed``;
  what a bfloat16 model, or a CPU without AVX-512 or AVX2, uses);
- Shardline's C kernel on its own blocked layout (``shardline.layers.kernels.blocked``; what a
  float32 rank uses; with ``--threads N``, each call shared by a team of N threads, as a rank
  with N torch threads shares it), where the extension is built and the CPU has AVX-512 (or
  AVX2 and FMA);
- the same with the weight held in bfloat16 (``model.weight_dtype: bfloat16``: half the bytes,
  float32 rows and sums).

Each weight set is larger than the caches (several copies, used in turn), so every call reads
its weight from memory; GB/s is the weight's bytes over the median time.

Then a whole batch-1 step of one TP=2 rank's weights (30 layers' four, then the LM head, in a
step's order) with the C kernel, the weights placed two ways: each in its own allocation, made
between other allocations as a model's loading makes them, and back to back in one buffer
(``NativeKernels.weight_packer``, what a model now uses), and in one buffer held in bfloat16;
on a CPU with AVX-512, both buffers also through the AVX2 kernels (what a CPU without it runs)
and through the AVX-512 ones (a CPU that runs AVX-512 in halves, Zen 4, takes the AVX2 ones for
one row: the line under the table says which kernels one row takes); each round also sums a
256 MiB tensor, the decode floor's bandwidth probe (``Worker.read_bandwidth``), so each
placement's GB/s is also a fraction of the probe's. ``--step-only``: that step alone.

    python benchmarks/linear_kernels.py [--dtype float32|bfloat16] [--threads 1] [--step-only]
        [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from shardline.cli.table import render
from shardline.layers.kernels import (
    PACKED_FOR_ROWS,
    NativeKernels,
    blocked,
    layer_kernels,
    linear,
    packed,
)
from shardline.worker.worker import BANDWIDTH_PROBE_BYTES

#: (name, out, in) per rank: SmolLM2-135M's qkv, o, gate+up, down and LM head.
SHAPES = {
    1: [("qkv", 960, 576), ("o", 576, 576), ("gate_up", 3072, 576), ("down", 576, 1536),
        ("lm_head", 49152, 576)],
    2: [("qkv", 480, 576), ("o", 576, 288), ("gate_up", 1536, 576), ("down", 576, 768),
        ("lm_head", 24576, 576)],
}  # fmt: skip
ROWS = (1, 4, 16)
#: The C kernel on the weight held in bfloat16.
C_HALF = "C blocked, bf16 weight"
SET_BYTES = 128 << 20  # per kernel and shape: past the last-level cache


def median_s(call, repeats: int) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def c_kernels(dtype: torch.dtype) -> NativeKernels | None:
    """The kernels with the C linear, where it runs here (built, AVX-512 or AVX2 and FMA,
    float32)."""
    kernels = layer_kernels(torch.device("cpu"), {})
    if isinstance(kernels, NativeKernels) and dtype == torch.float32:
        return kernels if kernels.native.blocked_linear_available() else None
    return None


def measure(out_features: int, in_features: int, rows: int, dtype: torch.dtype) -> dict:
    size = out_features * in_features * torch.empty(0, dtype=dtype).element_size()
    copies = max(2, SET_BYTES // size)
    plain = [torch.randn(out_features, in_features).to(dtype) for _ in range(copies)]
    layouts = {
        "[out, in]": plain,
        "[in, out]": [w.t().contiguous().t() for w in plain],
        "oneDNN packed": [packed(w) for w in plain],
    }
    native = c_kernels(dtype)
    if native is not None:
        block = native.native.LINEAR_BLOCK
        layouts["C blocked"] = [blocked(w, block) for w in plain]
        layouts[C_HALF] = [blocked(w, block, dtype=torch.bfloat16) for w in plain]
    x = torch.randn(rows, in_features).to(dtype)
    result = {}
    for name, weights in layouts.items():
        turn = iter(range(1 << 60))
        multiply = native.linear if name.startswith("C blocked") else linear
        seconds = median_s(
            lambda ws=weights, t=turn, f=multiply: f(x, ws[next(t) % len(ws)], None), 200
        )
        held = size // 2 if name == C_HALF else size
        result[name] = {"us": seconds * 1e6, "gb_s": held / seconds / 1e9}
    reference = F.linear(x, plain[0])
    result["oneDNN max abs difference"] = float(
        (linear(x, layouts["oneDNN packed"][0], None) - reference).abs().max()
    )
    return result


#: One TP=2 rank's weights in a decode step's order: 30 layers, then the LM head.
STEP_WEIGHTS = [shape for _, *shape in SHAPES[2][:4]] * 30 + [SHAPES[2][4][1:]]
STEP_ROUNDS = 30


def measure_step(native: NativeKernels) -> dict:
    """GB/s (median of :data:`STEP_ROUNDS`) of one row through :data:`STEP_WEIGHTS`, weights
    in their own allocations, in one buffer and in one buffer in bfloat16, and of the floor's
    probe, in turn."""
    block = native.native.LINEAR_BLOCK
    apart, loaded = [], []
    for out_features, in_features in STEP_WEIGHTS:
        loaded.append(torch.randn(out_features, in_features))
        apart.append(blocked(loaded[-1], block))
    packer = native.weight_packer(loaded)
    together = [packer(weight) for weight in loaded]
    halves = NativeKernels(native.native, torch.get_num_threads(), torch.bfloat16)
    half_packer = halves.weight_packer(loaded)
    in_bfloat16 = [half_packer(weight) for weight in loaded]
    del loaded
    rows = {size: torch.randn(1, size) for _, size in STEP_WEIGHTS}
    weight_bytes = sum(o * i * 4 for o, i in STEP_WEIGHTS)
    probe = torch.ones(BANDWIDTH_PROBE_BYTES // 4)

    def step(weights: list[torch.Tensor], kernels: NativeKernels = native) -> None:
        for weight, (_, in_features) in zip(weights, STEP_WEIGHTS, strict=True):
            kernels.linear(rows[in_features], weight, None)

    outputs = {size: torch.empty(1, size) for size, _ in STEP_WEIGHTS}

    def step_on(weights: list[torch.Tensor], kind: int, kernel_set: int) -> None:
        for weight, (out_features, in_features) in zip(weights, STEP_WEIGHTS, strict=True):
            native.native.blocked_linear(
                weight.data_ptr(), rows[in_features].data_ptr(), outputs[out_features].data_ptr(),
                0, 1, out_features, in_features, None, kind, kernel_set,
            )  # fmt: skip

    runs = {
        "own allocations": (lambda: step(apart), weight_bytes),
        "one buffer": (lambda: step(together), weight_bytes),
        "one buffer, bfloat16": (lambda: step(in_bfloat16, halves), weight_bytes // 2),
        "probe (torch.sum)": (probe.sum, BANDWIDTH_PROBE_BYTES),
    }
    if torch.backends.cpu.get_cpu_capability() == "AVX512":  # what a CPU without it runs
        float32, bfloat16 = native.native.WEIGHT_FLOAT32, native.native.WEIGHT_BFLOAT16
        for name, kernel_set in (("AVX2", native.native.KERNELS_AVX2),
                                 ("AVX-512", native.native.KERNELS_AVX512)):  # fmt: skip
            runs[f"one buffer, {name} kernels"] = (
                lambda k=kernel_set: step_on(together, float32, k),
                weight_bytes,
            )
            runs[f"one buffer, bfloat16, {name} kernels"] = (
                lambda k=kernel_set: step_on(in_bfloat16, bfloat16, k),
                weight_bytes // 2,
            )
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(STEP_ROUNDS):
        for name, (run, size) in runs.items():
            start = time.perf_counter()
            run()
            rates[name].append(size / (time.perf_counter() - start) / 1e9)
    return {name: statistics.median(values) for name, values in rates.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--step-only", action="store_true", help="only a whole step's weights")
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    records, table = [], []
    for tp, shapes in {} if args.step_only else SHAPES.items():
        for name, out_features, in_features in shapes:
            for rows in ROWS:
                found = measure(out_features, in_features, rows, dtype)
                records.append({"tp": tp, "weight": name, "rows": rows, **found})
                plain, packed_ = found["[out, in]"], found["oneDNN packed"]
                c = found.get("C blocked")
                table.append(
                    [f"tp{tp} {name} [{out_features}x{in_features}]", rows,
                     *(f"{found[k]['us']:.0f} ({found[k]['gb_s']:.1f})" for k in
                       ("[out, in]", "[in, out]", "oneDNN packed")),
                     f"{c['us']:.0f} ({c['gb_s']:.1f})" if c else "-",
                     *([f"{found[C_HALF]['us']:.0f} ({found[C_HALF]['gb_s']:.1f})"] if c else
                       ["-"]),
                     f"{plain['us'] / packed_['us']:.2f}",
                     f"{packed_['us'] / c['us']:.2f}" if c else "-"]
                )  # fmt: skip
    if table:
        print(
            f"{args.dtype}, {args.threads} thread(s), oneDNN packed for {PACKED_FOR_ROWS} rows: "
            "us per call (GB/s of weights); a speed-up is the other time over this one"
        )
        headers = ["weight", "rows", "[out, in]", "[in, out]", "oneDNN packed", "C blocked"]
        headers += [C_HALF, "oneDNN speed-up", "C speed-up over oneDNN"]
        print(render(headers, table))
    native = c_kernels(dtype)
    step = measure_step(native) if native is not None else None
    if step is not None:
        probe = step["probe (torch.sum)"]
        print(
            f"\na TP=2 rank's batch-1 step of weights ({len(STEP_WEIGHTS)} weights, "
            f"{sum(o * i * 4 for o, i in STEP_WEIGHTS) / 2**20:.0f} MiB), C kernel; median of "
            f"{STEP_ROUNDS} rounds"
        )
        print(
            render(
                ["weights placed", "GB/s", "of the probe"],
                [[name, f"{rate:.1f}", f"{rate / probe:.2f}"] for name, rate in step.items()],
            )
        )
        one_row = native.native.linear_isa(1, native.native.WEIGHT_FLOAT32)
        print(f"one row takes the {one_row} kernels here (linear_isa)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(
                {"dtype": args.dtype, "threads": args.threads, "rows": records, "step": step},
                handle,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
