"""How closely a lower-precision mode (``model.dtype``, or float32 with ``model.weight_dtype``
bfloat16: linear weights rounded to bfloat16, computed in float32) follows float32: top-1
agreement of greedy decoding on held-out prompts (prompts no test or tuning uses), in one run.
float32 with ``model.weight_dtype`` gguf (the file's quantization blocks held as they are)
is measured too: it computes float32's very bits, so it must agree everywhere; and gguf with
``model.activation_dtype`` int8 (weights of 4-bit types and Q8_0 multiplied by inputs rounded
to int8), which does not.

float32 is the reference (its greedy tokens equal transformers'; tests/test_smollm2.py). For
each prompt it generates ``--tokens`` tokens; then each mode is asked for the next token after
every prefix of that reference (teacher-forced: prompt + the reference's first k tokens), and
top-1 agreement is the fraction of positions where its choice is the reference's. float32
itself is measured the same way as the control (a prefix run as one prefill rounds differently
from decode steps). Also: how many free-running greedy continuations equal the reference
throughout, and where the others first differ.

    python benchmarks/dtype_agreement.py [--model smollm2-135m] [--tokens 32] [--json F]
"""

from __future__ import annotations

import argparse
import json
import statistics

from shardline.catalog import resolve_model_path
from shardline.cli.table import render
from shardline.engine import LLM, SamplingParams

#: Held out: not used by any test or in choosing any kernel.
PROMPTS = (
    "The old bridge over the river was built in",
    "To make a good cup of tea, first",
    "Photosynthesis is the process by which",
    "My favourite thing about winter is",
    "def fibonacci(n):\n    ",
    "The three largest planets in the solar system are",
    "Once upon a time, a small robot",
    "The main causes of the French Revolution were",
    "A healthy breakfast usually includes",
    "In chess, the knight moves",
    "The capital of Australia is",
    "Water boils at a lower temperature at high altitude because",
)
#: (model.dtype, model.weight_dtype, model.activation_dtype) of each mode measured.
MODES = (
    ("float32", None, None),
    ("bfloat16", None, None),
    ("float32", "bfloat16", None),
    ("float32", "gguf", None),
    ("float32", "gguf", "int8"),
)


def mode_name(dtype: str, weight_dtype: str | None, activation_dtype: str | None) -> str:
    name = dtype if weight_dtype is None else f"{dtype}, weights {weight_dtype}"
    return name if activation_dtype is None else f"{name}, activations {activation_dtype}"


def greedy(llm: LLM, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    return [list(out.token_ids) for out in llm.generate(prompts, params)]


def measure(
    model: str,
    mode: tuple[str, str | None, str | None],
    prompts: list[list[int]],
    reference: list[list[int]],
) -> dict:
    tokens = len(reference[0])
    dtype, weight_dtype, activation_dtype = mode
    overrides = [
        f"model.path={model}",
        "parallel.distributed_executor_backend=uni",
        f"model.dtype={dtype}",
        *([f"model.weight_dtype={weight_dtype}"] if weight_dtype else []),
        *([f"model.activation_dtype={activation_dtype}"] if activation_dtype else []),
    ]
    with LLM(overrides=overrides) as llm:
        prefixes = [
            p + ref[:k] for p, ref in zip(prompts, reference, strict=True) for k in range(tokens)
        ]
        chosen = [ids[0] for ids in greedy(llm, prefixes, 1)]
        expected = [t for ref in reference for t in ref]
        free = greedy(llm, prompts, tokens)
    agree = sum(a == b for a, b in zip(chosen, expected, strict=True))
    first_differences = [
        next(i for i, (a, b) in enumerate(zip(run, ref, strict=True)) if a != b)
        for run, ref in zip(free, reference, strict=True)
        if run != ref
    ]
    return {
        "dtype": mode_name(dtype, weight_dtype, activation_dtype),
        "positions": len(expected),
        "top1_agreement": agree / len(expected),
        "continuations_equal": len(prompts) - len(first_differences),
        "continuations": len(prompts),
        "first_difference_median": statistics.median(first_differences)
        if first_differences
        else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json")
    args = parser.parse_args()
    model = resolve_model_path(args.model)
    with LLM(overrides=[f"model.path={model}", "parallel.distributed_executor_backend=uni"]) as llm:
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        reference = greedy(llm, prompts, args.tokens)
    results = [measure(model, mode, prompts, reference) for mode in MODES]
    print(
        f"{len(PROMPTS)} held-out prompts x {args.tokens} tokens; reference: float32 greedy "
        "(decode steps)"
    )
    table = [
        [r["dtype"], f"{r['top1_agreement']:.4f} ({r['positions']} positions)",
         f"{r['continuations_equal']} of {r['continuations']}",
         "-" if r["first_difference_median"] is None else f"{r['first_difference_median']:g}"]
        for r in results
    ]  # fmt: skip
    headers = [
        "mode",
        "top-1 agreement, teacher-forced",
        "greedy runs equal",
        "first diff (median)",
    ]
    print(render(headers, table))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"model": model, "tokens": args.tokens, "results": results}, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
