"""What async scheduling gains: the same layout with ``scheduler.async_scheduling`` false and
true, both engines in one process, their calls alternating round by round (which goes first
swapped each round: this shared machine's speed drifts by more than the effect from one
minute to the next), in two sessions: one with the false engine started first, one with the
true engine first (the engine started second ran 3-5% faster here whatever its mode, even
where async can change nothing).

Each round runs, on each engine, one request of ``--tokens`` greedy tokens (batch 1; its end
of sequence ignored) and then ``--concurrent`` such requests at once. Prints, per layout and
case, each mode's median tokens per second, each session's median of the per-round ratios
(async / one step at a time; rounds are paired, so a drift that moves both alike cancels) and
in how many rounds async was the faster, the two sessions' geometric mean (the start order's
share cancels), and whether every answer was the same (greedy: it must be). JSON with
``--json``.

    python benchmarks/async_scheduling.py [--model smollm2-135m] [--layouts tp2,tp1]
        [--tokens 48] [--concurrent 16] [--rounds 20] [--set K=V ...] [--json FILE]

``tp2`` is TP=2 under ``mp`` with the shared-memory all-reduce (three processes on this
host's two cores: the driver's work while a step runs takes time from a rank); ``tp1`` one
rank in the driver's process (``uni``: nothing runs while the driver works, so its ratio is
what the method reads where there is no gain). ``--set`` applies to every engine
(``model.weight_dtype=bfloat16`` among them); with ``OMP_NUM_THREADS=1`` in the environment a
rank uses one core and leaves the other to the driver.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from shardline.catalog import resolve_model_path
from shardline.cli.table import render
from shardline.engine import LLM, SamplingParams
from shardline.errors import ShardlineError

LAYOUTS = {
    "tp2": [
        "parallel.tensor_parallel_size=2",
        "parallel.distributed_executor_backend=mp",
        "parallel.communicator=custom_ar",
    ],
    "tp1": ["parallel.tensor_parallel_size=1", "parallel.distributed_executor_backend=uni"],
}
PROMPT = "Tell me a long story about a dragon who learns to cook."


def _rate(llm: LLM, requests: int, tokens: int) -> tuple[float, list[list[int]]]:
    """Generated tokens per second of ``requests`` identical requests at once, and the
    answers."""
    sampling = SamplingParams(max_tokens=tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([PROMPT] * requests, sampling)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / seconds, [o.token_ids for o in outputs]


def _session(model: str, layout: str, args: argparse.Namespace, first: str) -> dict:
    """Both engines, the one of mode ``first`` started first, their calls alternating for
    the rounds (which goes first swapped each round); per case, each mode's rates and
    answers."""
    modes = [first, "true" if first == "false" else "false"]
    engines = {}
    try:
        for mode in modes:
            engines[mode] = LLM(
                overrides=[
                    f"model.path={model}",
                    *LAYOUTS[layout],
                    *args.set,
                    f"scheduler.async_scheduling={mode}",
                ]
            )
        cases = {"batch 1": 1, f"{args.concurrent} concurrent": args.concurrent}
        found = {case: {mode: ([], None) for mode in modes} for case in cases}
        for llm in engines.values():  # warm-up
            _rate(llm, 1, 8)
        for round_index in range(args.rounds):
            order = modes[:: 1 if round_index % 2 == 0 else -1]
            for case, requests in cases.items():
                for mode in order:
                    rate, tokens = _rate(engines[mode], requests, args.tokens)
                    found[case][mode] = (found[case][mode][0] + [rate], tokens)
        return found
    finally:
        for llm in engines.values():
            llm.shutdown()


def measure(model: str, layout: str, args: argparse.Namespace) -> list[dict]:
    """Per case: the rates of each mode over the rounds of two sessions, one with each mode's
    engine started first (in one process the engine started second ran 3-5% faster here,
    whatever its mode), each session's median ratio of paired rounds, and their geometric
    mean (the order's share cancels); whether every answer agreed."""
    sessions = {first: _session(model, layout, args, first) for first in ("false", "true")}
    rows = []
    for case in sessions["false"]:
        by_order, plain_all, ahead_all, same = {}, [], [], True
        for first, found in sessions.items():
            (plain, plain_tokens), (ahead, ahead_tokens) = found[case]["false"], found[case]["true"]
            ratios = [b / a for a, b in zip(plain, ahead, strict=True)]
            by_order[first] = {
                "ratio_median": statistics.median(ratios),
                "async_faster_rounds": sum(r > 1 for r in ratios),
                "one_at_a_time_rounds": plain,
                "async_rounds": ahead,
            }
            plain_all += plain
            ahead_all += ahead
            same = same and plain_tokens == ahead_tokens
        off_first, on_first = by_order["false"], by_order["true"]
        rows.append(
            {
                "layout": layout,
                "case": case,
                "one_at_a_time_tok_s": statistics.median(plain_all),
                "async_tok_s": statistics.median(ahead_all),
                "ratio": (off_first["ratio_median"] * on_first["ratio_median"]) ** 0.5,
                "rounds": args.rounds,
                "same_answers": same,
                "one_at_a_time_started_first": off_first,
                "async_started_first": on_first,
            }
        )
    return rows


def _ratio_cell(session: dict, rounds: int) -> str:
    return f"{session['ratio_median']:.3f} (faster in {session['async_faster_rounds']} of {rounds})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layouts", default="tp2,tp1")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--set", action="append", default=[], metavar="K=V")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown or args.tokens < 1 or args.concurrent < 1 or args.rounds < 1:
        print(
            f"--layouts = {args.layouts!r}: allowed {', '.join(LAYOUTS)}; --tokens, "
            "--concurrent and --rounds at least 1",
            file=sys.stderr,
        )
        return 2
    try:
        model = str(resolve_model_path(args.model))
        rows = [row for layout in layouts for row in measure(model, layout, args)]
    except ShardlineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(
        render(
            [
                "layout",
                "case",
                "one at a time tok/s",
                "async tok/s",
                "async / one at a time: off started first",
                "on started first",
                "both",
                "same answers",
            ],
            [
                [
                    row["layout"],
                    row["case"],
                    f"{row['one_at_a_time_tok_s']:.1f}",
                    f"{row['async_tok_s']:.1f}",
                    _ratio_cell(row["one_at_a_time_started_first"], row["rounds"]),
                    _ratio_cell(row["async_started_first"], row["rounds"]),
                    f"{row['ratio']:.3f}",
                    "yes" if row["same_answers"] else "NO",
                ]
                for row in rows
            ],
        )
    )
    if args.json:
        with open(args.json, "w", encoding="utf-8") as out:
            json.dump(rows, out, indent=2)
    return 0 if all(row["same_answers"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
