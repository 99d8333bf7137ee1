"""What speculative decoding by prompt lookup gains, and costs: the same engine with
``speculative.method`` none and ngram, in one run, on chat requests of three kinds:

- ``edit``: rewrite a short Python module with one change (the answer repeats most of it);
- ``quote``: repeat a paragraph word for word;
- ``question``: an open question (little of the answer is in the prompt: drafts are rare).

Each kind is one request (batch 1) of up to ``--tokens`` greedy tokens, the median of
``--repeats`` after a warm-up; then all kinds, ``--copies`` of each, at once. Engines with
drafts off and on alternate for ``--rounds`` rounds, and each figure is the faster of its
rounds (this shared machine's speed drifts between engines). Prints each
case's tokens per second with and without drafts, their ratio, the drafts accepted and the
tokens a request gained per step, and whether the answers were the same (greedy: they must
be); JSON with ``--json``.

    python benchmarks/speculative.py [--model smollm2-135m] [--layouts tp1,tp2]
        [--tokens 160] [--repeats 3] [--copies 3] [--rounds 2] [--set K=V ...] [--json FILE]

``tp2`` is TP=2 under ``mp`` with the shared-memory all-reduce; ``--set`` applies to every
engine (``speculative.num_speculative_tokens=N`` and the lookup sizes among them).
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
    "tp1": [],
    "tp2": [
        "parallel.tensor_parallel_size=2",
        "parallel.distributed_executor_backend=mp",
        "parallel.communicator=custom_ar",
    ],
}

MODULE = '''import json
from pathlib import Path


def load_settings(path):
    """Read the settings file and return a dict."""
    text = Path(path).read_text()
    settings = json.loads(text)
    if "name" not in settings:
        raise ValueError("settings need a name")
    return settings


def save_settings(path, settings):
    """Write the settings back, sorted and indented."""
    Path(path).write_text(json.dumps(settings, indent=2, sort_keys=True))


def merge_settings(base, extra):
    """Settings of base, updated with those of extra."""
    merged = dict(base)
    merged.update(extra)
    return merged
'''

PARAGRAPH = (
    "The river rises in the hills to the north of the town and runs south through a wide "
    "valley of farms and small woods. In spring the water is high and fast, and the old stone "
    "bridge at the market square is closed to carts until the floods have passed. In summer "
    "children swim below the mill, and in autumn the valley fills with mist every morning."
)

KINDS = {
    "edit": "Rewrite this module so that load_settings raises KeyError instead of ValueError. "
    "Show the whole module.\n\n" + MODULE,
    "quote": "Repeat the following paragraph word for word.\n\n" + PARAGRAPH,
    "question": "What are three good habits for someone learning to program? Explain each.",
}


def measure(model: str, layout: str, method: str, args) -> dict:
    """Per kind: the seconds of each repeat, the tokens, and the drafts proposed and accepted
    over its repeats; and the mixed batch's seconds and tokens."""
    overrides = [f"model.path={model}", *LAYOUTS[layout], *args.overrides]
    overrides.append(f"speculative.method={method}")
    greedy = SamplingParams(max_tokens=args.tokens)
    found: dict = {}
    with LLM(overrides=overrides) as llm:
        scheduler = llm.engine.scheduler
        for kind, question in KINDS.items():
            conversation = [{"role": "user", "content": question}]
            llm.chat([conversation], greedy)  # warm-up; leaves the prompt in the prefix cache
            drafted, accepted = scheduler.spec_draft_tokens, scheduler.spec_accepted_tokens
            seconds, steps = [], 0
            for _ in range(args.repeats):
                start = time.perf_counter()
                (answer,) = llm.chat([conversation], greedy)
                seconds.append(time.perf_counter() - start)
            count = len(answer.token_ids)
            accepted = scheduler.spec_accepted_tokens - accepted
            steps = args.repeats * count - accepted  # each step gains one token beyond drafts
            found[kind] = {
                "seconds": seconds,
                "tokens": count,
                "token_ids": answer.token_ids,
                "drafted": scheduler.spec_draft_tokens - drafted,
                "accepted": accepted,
                "tokens_per_step": args.repeats * count / steps,
            }
        batch = [
            [{"role": "user", "content": question}]
            for question in KINDS.values()
            for _ in range(args.copies)
        ]
        start = time.perf_counter()
        answers = llm.chat(batch, greedy)
        found["batch"] = {
            "seconds": [time.perf_counter() - start],
            "tokens": sum(len(a.token_ids) for a in answers),
            "token_ids": [a.token_ids for a in answers],
        }
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="catalog name, GGUF or HF dir")
    parser.add_argument("--layouts", default="tp1,tp2", help=f"of {', '.join(LAYOUTS)}")
    parser.add_argument("--tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copies", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    layouts = args.layouts.split(",")
    if not (
        set(layouts) <= set(LAYOUTS)
        and 1 <= args.tokens <= 1024
        and 1 <= args.repeats <= 100
        and 1 <= args.copies <= 10
        and 1 <= args.rounds <= 10
    ):
        parser.error(
            f"allowed: --layouts of {', '.join(LAYOUTS)}, --tokens 1..1024, --repeats 1..100, "
            "--copies 1..10, --rounds 1..10"
        )
    try:
        model = resolve_model_path(args.model)
        results: dict = {layout: {"none": [], "ngram": []} for layout in layouts}
        for layout in layouts:
            for _ in range(args.rounds):  # alternated: the machine drifts between engines
                for method in ("none", "ngram"):
                    results[layout][method].append(measure(model, layout, method, args))
    except ShardlineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = []
    for layout, by_method in results.items():
        off, on = by_method["none"][0], by_method["ngram"][0]
        for case in (*KINDS, "batch"):
            speed = [
                max(r[case]["tokens"] / statistics.median(r[case]["seconds"]) for r in rounds)
                for rounds in (by_method["none"], by_method["ngram"])
            ]
            drafts = on[case].get("drafted")
            rows.append(
                (
                    layout,
                    case if case != "batch" else f"all at once ({len(KINDS) * args.copies})",
                    f"{speed[0]:.1f}",
                    f"{speed[1]:.1f}",
                    f"{speed[1] / speed[0]:.2f}",
                    "-" if not drafts else f"{on[case]['accepted'] / drafts:.0%} of {drafts}",
                    "-" if drafts is None else f"{on[case]['tokens_per_step']:.2f}",
                    "yes" if off[case]["token_ids"] == on[case]["token_ids"] else "NO",
                )
            )
    print(
        f"SmolLM2 chat, greedy, up to {args.tokens} tokens; one request: median of "
        f"{args.repeats}; tokens per second include the prompt (cached after the warm-up); "
        f"the faster of {args.rounds} rounds, drafts off and on alternated"
    )
    columns = [
        "layout", "case", "drafts off tok/s", "ngram tok/s", "ngram / off", "drafts accepted",
        "tokens a step", "same answer",
    ]  # fmt: skip
    print(render(columns, rows))
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"arguments": vars(args), "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
