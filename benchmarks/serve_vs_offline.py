"""The server against the engine offline, same requests, same run (issue targets of
``shardline serve``): aggregate output tokens/s of ``--concurrent`` streaming requests of
``--output-len`` tokens through ``shardline serve`` beside ``LLM.chat`` on the same requests
offline, and the median time to first token of requests sent one at a time, through the server
beside offline.

    python benchmarks/serve_vs_offline.py [--set K=V ...] [--concurrent 16] [--output-len 64]
        [--ttft-requests 8] [--json FILE]

The config is ``shardline serve``'s (SmolLM2-135M-Instruct, TP=2, unless ``--set`` says
otherwise). The server is measured first with ``shardline bench serve`` (chat prompts, greedy,
``ignore_eos``), then stopped; the engine is then started in this process for the offline
half. Offline time to first token: from ``LLM.chat`` called with one conversation to its first
streamed token. Prints a table (and JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from shardline.cli import bench_serve
from shardline.cli.serve_cmd import load_serve_config
from shardline.cli.table import render
from shardline.engine import LLM, SamplingParams

#: Seconds the server may take to start (load the model, start its ranks).
START_S = 300.0
SEED = 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="K=V")
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--ttft-requests", type=int, default=8)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    conversations = _conversations(max(args.concurrent, args.ttft_requests))
    with tempfile.TemporaryDirectory(prefix="shardline-serve-vs-offline-") as folder:
        served = _through_server(args, Path(folder))
    offline = _offline(args, conversations)
    rows = [
        (
            f"{args.concurrent} concurrent, output tok/s",
            served["throughput"],
            offline["throughput"],
            "server / offline >= 0.9",
        ),
        (
            "one at a time, median TTFT ms",
            served["ttft_ms"],
            offline["ttft_ms"],
            "server / offline <= 1.2",
        ),
    ]
    print(
        render(
            ["measure", "server", "offline", "server / offline", "target"],
            [[name, f"{a:.1f}", f"{b:.1f}", f"{a / b:.2f}", target] for name, a, b, target in rows],
        )
    )
    if args.json:
        Path(args.json).write_text(json.dumps({"server": served, "offline": offline}, indent=2))
    return 0


def _conversations(count: int) -> list[list[dict[str, str]]]:
    """The conversations ``shardline bench serve --dataset chat --seed SEED`` sends, in order."""
    questions = bench_serve.chat_prompts()
    random.Random(SEED).shuffle(questions)
    return [[{"role": "user", "content": questions[i % len(questions)]}] for i in range(count)]


def _through_server(args: argparse.Namespace, folder: Path) -> dict:
    """Start ``shardline serve``, measure both loads with ``shardline bench serve``, stop it."""
    log = folder / "server.log"
    command = [sys.executable, "-m", "shardline.cli.main", "serve", "--port", "0"]
    for item in args.overrides:
        command += ["--set", item]
    with open(log, "w") as log_file:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_file)
        try:
            url = _wait_for_banner(server, log)
            load = _bench(url, folder / "load.json", args.concurrent, args.output_len, None)
            one = _bench(url, folder / "one.json", args.ttft_requests, args.output_len, 1)
        finally:
            server.send_signal(signal.SIGTERM)
            try:
                server.wait(30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
    return {
        "throughput": load["summary"]["output_token_throughput"],
        "ttft_ms": one["summary"]["ttft_ms"]["p50"],
        "load": load["summary"],
        "one_at_a_time": one["summary"],
    }


def _wait_for_banner(server: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        found = re.search(r"at (http://\S+)/v1 ", log.read_text())
        if found:
            return found.group(1)
        if server.poll() is not None:
            break
        time.sleep(0.2)
    raise SystemExit(f"the server did not start:\n{log.read_text()}")


def _bench(url: str, report: Path, requests: int, output_len: int, concurrency: int | None):
    """``shardline bench serve`` with the chat prompts; its JSON report."""
    command = [sys.executable, "-m", "shardline.cli.main", "bench", "serve", "--url", url]
    command += ["--dataset", "chat", "--seed", str(SEED), "-n", str(requests)]
    command += ["--output-len", str(output_len), "--json", str(report)]
    if concurrency is not None:
        command += ["--max-concurrency", str(concurrency)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench serve failed:\n{done.stdout}{done.stderr}")
    return json.loads(report.read_text())


def _offline(args: argparse.Namespace, conversations: list) -> dict:
    """The same requests through ``LLM.chat`` in this process."""
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    with LLM(load_serve_config(None, args.overrides)) as llm:
        llm.chat(conversations[0], SamplingParams(max_tokens=4, temperature=0))
        started = time.perf_counter()
        outputs = llm.chat(conversations[: args.concurrent], params)
        elapsed = time.perf_counter() - started
        ttfts = [_first_token_ms(llm, c, params) for c in conversations[: args.ttft_requests]]
    return {
        "throughput": sum(len(o.token_ids) for o in outputs) / elapsed,
        "ttft_ms": statistics.median(ttfts),
    }


def _first_token_ms(llm: LLM, conversation: list, params: SamplingParams) -> float:
    """Milliseconds from ``LLM.chat`` called with ``conversation`` to its first token."""
    stamps: list[float] = []
    sent = time.perf_counter()
    llm.chat(conversation, params, stream=lambda *_: stamps.append(time.perf_counter()))
    return (stamps[0] - sent) * 1000


if __name__ == "__main__":
    raise SystemExit(main())
