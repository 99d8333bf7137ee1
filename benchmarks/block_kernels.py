"""How fast the C kernels multiply a weight held as its GGUF file's blocks
(``model.weight_dtype: gguf``), kind by kind, against the same weight held in float32: one
thread, 1, 4 and 16 rows, on the AVX-512 kernels and on the AVX2 ones (where this CPU runs
them), in one run.

Each kind holds a weight of random blocks of one file type (the type named beside it), of
``--out`` x ``--in`` (a multiple of 256, for the K types); each is copied until the copies
pass ``--megabytes`` (more than the caches), used in turn, so every call reads its weight
from memory. The code kinds' rows (``Q4_CODES_F16 (Q4_0)``, ``Q4_CODES_F16 (Q4_1)``,
``Q4_CODES (Q4_K)``, ``Q8_CODES_F16 (Q8_0)``) hold the same types as codes that multiply int8 inputs
(``model.activation_dtype: int8``; no longer float32's bits). The rounds
interleave the kinds; a cell is the median over ``--rounds`` of the mean time a call.
"x float32" is float32's time over the kind's, both on the same kernels.

``--against F`` loads F, another build of ``shardline.layers._kernels`` (a former one, kept
as a copy of its ``.so``), beside this one, holds the same weights in it and times both
builds in the same rounds, call for call in turn (on a noisy host the ratio of builds
measured so is steadier than two runs'): each cell also gets that build's time, this build's
speed over it, and whether both gave the same bits.

    python benchmarks/block_kernels.py [--out 3072] [--in 512] [--rounds 7] [--against F]
                                       [--json F]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

from shardline.cli.table import render
from shardline.layers.kernels import CODE_KINDS, NativeKernels

# The tests' support writes random GGUF blocks and decodes them as a file's loader does.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.gguf_values import file_weight, random_blocks

#: Each kind with a file type it holds.
KIND_TYPES = (("Q4_0", "Q4_0"), ("Q4_1", "Q4_1"), ("Q4_K", "Q4_K"), ("Q5_K", "Q5_K"),
              ("Q8_0", "Q8_0"), ("Q6_K", "Q6_K"), ("INT8_SCALED", "Q2_K"))  # fmt: skip
ROWS = (1, 4, 16)
FLOAT32 = "float32"


def copies(held: torch.Tensor, total_bytes: float) -> list[torch.Tensor]:
    """Copies of a held weight (its attributes too) until they pass ``total_bytes``."""
    count = max(2, int(total_bytes // (held.numel() * held.element_size())) + 1)
    made = []
    for _ in range(count):
        copy = nn.Parameter(held.detach().clone(), requires_grad=False)
        for name in ("blocked_shape", "weight_kind", "held_as"):
            if hasattr(held, name):
                setattr(copy, name, getattr(held, name))
        made.append(copy)
    return made


def call_time(kernels, weights, x, y, avx2: bool) -> float:
    """Mean seconds a call over ``weights`` (each once), on the AVX2 kernels or (not
    ``avx2``) the AVX-512 ones, one row too (``KERNELS_AVX512``: also where this CPU takes the
    AVX2 ones for one row, ``linear_isa``)."""
    native = kernels.native
    rows, (out_features, in_features) = x.shape[0], weights[0].blocked_shape
    start = time.perf_counter()
    # 1: KERNELS_AVX2; a build from before KERNELS_AVX512 took 0 for the AVX-512 kernels.
    kernel_set = 1 if avx2 else getattr(native, "KERNELS_AVX512", 0)
    for weight in weights:
        native.blocked_linear(
            weight.data_ptr(), x.data_ptr(), y.data_ptr(), 0, rows, out_features, in_features,
            None, kernels._kind(weight), kernel_set,
        )  # fmt: skip
    return (time.perf_counter() - start) / len(weights)


def hold_every_kind(native, out_features: int, in_features: int, total_bytes: float) -> dict:
    """Each kind's weight (random blocks of its file type, the same for every build: a fixed
    seed), held by ``native``'s kernels and copied past ``total_bytes``: name -> (kernels,
    copies, file type)."""
    blocks, plain = NativeKernels(native, quantized=True), NativeKernels(native)
    codes = NativeKernels(native, quantized=True, codes=True)
    rng = np.random.default_rng(0)
    held = {}
    for kind, file_type in KIND_TYPES:
        weight = file_weight(
            [(file_type, random_blocks(file_type, out_features, in_features, rng))], out_features
        )
        packed = blocks.pack_linear(weight)
        assert packed.held_as == kind, (kind, packed.held_as)
        held[kind] = (blocks, copies(packed, total_bytes), file_type)
        if kind in ("Q4_0", "Q4_1", "Q4_K", "Q8_0"):  # the same blocks as codes times int8 inputs
            packed = codes.pack_linear(weight)
            assert packed.held_as in CODE_KINDS, (kind, packed.held_as)
            held[f"{packed.held_as} ({kind})"] = (codes, copies(packed, total_bytes), file_type)
    held[FLOAT32] = (plain, copies(plain.pack_linear(weight), total_bytes), "-")
    return held


def load_build(path: str):
    """Another build of the kernels' extension, from its file, beside the imported one."""
    spec = importlib.util.spec_from_file_location("shardline.layers._kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=int, default=3072)
    parser.add_argument("--in", dest="inputs", type=int, default=512)
    parser.add_argument("--megabytes", type=float, default=128)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--against", help="another build of the extension (.so) to time beside")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.inputs % 256:
        parser.error(f"--in {args.inputs}: must be a multiple of 256 (the K types' blocks)")
    import shardline.layers._kernels as native

    if not native.quantized_linear_available():
        print("this CPU runs no block kernels (they need AVX-512, or AVX2 with FMA and F16C)")
        return 1
    torch.set_num_threads(1)
    total_bytes = args.megabytes * 1e6
    builds = {"this": hold_every_kind(native, args.out, args.inputs, total_bytes)}
    if args.against:
        builds["against"] = hold_every_kind(
            load_build(args.against), args.out, args.inputs, total_bytes
        )
    held = builds["this"]
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        flags = cpuinfo.read().split()
    sets = [("avx2", True)]
    if all(f"avx512{part}" in flags for part in ("f", "bw", "vl")):
        sets.insert(0, ("avx512", False))
    times = {
        (build, name, rows, kernel): []
        for build in builds for name in held for rows in ROWS for kernel, _ in sets
    }  # fmt: skip
    same_bits = {}
    for rows in ROWS:
        x = torch.randn(rows, args.inputs)
        outputs = {build: torch.empty(rows, args.out) for build in builds}
        for _ in range(args.rounds):
            for kernel, avx2 in sets:
                for name in held:
                    for build, every_kind in builds.items():
                        kernels, weights, _ = every_kind[name]
                        times[build, name, rows, kernel].append(
                            call_time(kernels, weights, x, outputs[build], avx2)
                        )
                    if "against" in builds:
                        same_bits[name, rows, kernel] = torch.equal(*outputs.values())
    median = {key: statistics.median(found) * 1e6 for key, found in times.items()}
    table, records = [], []
    for name in held:
        kernels, weights, file_type = held[name]
        per_weight = weights[0].numel() * weights[0].element_size() / (args.out * args.inputs)
        for rows in ROWS:
            cells = []
            for kernel, _ in sets:
                us = median["this", name, rows, kernel]
                speedup = median["this", FLOAT32, rows, kernel] / us
                cells += [f"{us:.1f}", f"{speedup:.2f}"]
                record = {"kind": name, "type": file_type, "bytes_per_weight": per_weight,
                          "rows": rows, "kernels": kernel, "us": us,
                          "x_float32": speedup}  # fmt: skip
                if "against" in builds:
                    against_us = median["against", name, rows, kernel]
                    same = same_bits[name, rows, kernel]
                    bits = "yes" if same else "NO"
                    cells += [f"{against_us:.1f}", f"{against_us / us:.2f}", bits]
                    record |= {"against_us": against_us, "same_bits": same}
                records.append(record)
            table.append([name, file_type, f"{per_weight:.3f}", rows, *cells])
    print(
        f"[{args.out} x {args.inputs}] weights streamed from memory, one thread: us a call "
        f"(median of {args.rounds} rounds) and float32's time over it"
        + (f"; beside the build {args.against}, call for call in turn" if args.against else "")
    )
    headers = ["kind", "file type", "bytes a weight", "rows"]
    for kernel, _ in sets:
        headers += [f"{kernel} us", f"{kernel} x float32"]
        if args.against:
            headers += [f"{kernel} against us", f"{kernel} against / this", "same bits"]
    print(render(headers, table))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"out": args.out, "in": args.inputs, "rows": records}, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
