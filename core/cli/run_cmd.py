"""``shardline run``: ask a real model on several ranks, print the answer and tokens/s."""

from __future__ import annotations

import os
import select
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from shardline.config.loader import LoadedConfig, load_config
from shardline.errors import RequestError
from shardline.tokenizer import unicode_problem

#: The built-in layer under ``--config`` and ``--set``: SmolLM2-135M-Instruct (pulled on
#: first use), two tensor-parallel ranks (worker processes, or the processes of a launcher),
#: the fastest communicator.
BUILTIN_CONFIG: dict[str, Any] = {
    "model": {"path": "smollm2-135m"},
    "parallel": {
        "tensor_parallel_size": 2,
        "distributed_executor_backend": "auto",
        "communicator": "auto",
    },
}
BUILTIN_SOURCE = "built-in run config"
DEFAULT_QUESTION = "What is the capital of France? Answer in one sentence."
#: How often the chat checks the ranks while it waits for a line.
IDLE_CHECK_S = 0.5


def load_run_config(path: str | None, overrides: Sequence[str]) -> LoadedConfig:
    """The built-in run config, then the file, the environment and ``--set`` over it."""
    return load_config(path, overrides, base=(BUILTIN_SOURCE, BUILTIN_CONFIG))


def run(loaded: LoadedConfig, question: str | None, interactive: bool) -> int:
    if question is not None:  # refused before the engine (and torch) is imported
        question = checked_question(question, "QUESTION")
    from shardline.engine import LLM

    llm = LLM(loaded)
    try:
        if interactive:
            if not llm.reports_results or llm.engine.executor.launched:
                raise RequestError(
                    "--interactive reads the terminal in one process; under a launcher "
                    "(torchrun, mpiexec) give the question as an argument instead"
                )
            return _chat_loop(llm)
        _answer(llm, [{"role": "user", "content": question or DEFAULT_QUESTION}])
        return 0
    finally:
        llm.shutdown()


def _chat_loop(llm: Any) -> int:
    """Ask the model each line typed. While the chat waits for one, the ranks are checked
    every :data:`IDLE_CHECK_S`: a rank lost meanwhile ends the chat at once, with its error."""
    print(
        "chat with the model; an empty line, /exit or end of input (Ctrl-D) ends it",
        file=sys.stderr,
    )

    def check_ranks() -> None:
        try:
            llm.engine.check_health()
        except BaseException:
            print(flush=True)  # the error goes below the prompt
            raise

    typed = TypedLines(sys.stdin)
    history: list[dict[str, str]] = []
    while True:
        sys.stdout.write("you> ")
        sys.stdout.flush()
        line = typed.next_line(check_ranks, IDLE_CHECK_S)
        if line is None:
            print(file=sys.stderr)
            check_ranks()
            return 0
        line = line.strip()
        if not line or line in ("/exit", "/quit"):
            return 0
        try:
            line = checked_question(line, "that line")
        except RequestError as error:
            print(f"error: {error}; type it again", file=sys.stderr)
            continue
        history.append({"role": "user", "content": line})
        answer = _answer(llm, history)
        history.append({"role": "assistant", "content": answer})


class TypedLines:
    """The lines of a text stream (standard input), read from its file descriptor so that a
    wait for the next one can be cut into slices; decoded as the stream decodes."""

    def __init__(self, stream: TextIO) -> None:
        self._fd = stream.fileno()
        self._encoding = stream.encoding
        self._errors = stream.errors or "strict"
        self._pending = b""
        self._ended = False

    def next_line(self, while_waiting: Callable[[], None], every_s: float) -> str | None:
        """The next line, without its end; None once the input has ended. While none is
        there, ``while_waiting()`` runs every ``every_s`` seconds (and may raise)."""
        while b"\n" not in self._pending and not self._ended:
            if select.select([self._fd], [], [], every_s)[0]:
                chunk = os.read(self._fd, 1 << 16)
                self._pending += chunk
                self._ended = not chunk
            else:
                while_waiting()
        if not self._pending:
            return None
        line, _, self._pending = self._pending.partition(b"\n")
        return line.decode(self._encoding, self._errors)


def checked_question(text: str, what: str) -> str:
    """``text`` if it is something to ask: not blank, and Unicode text; else RequestError."""
    if not text.strip():
        raise RequestError(f"{what} is empty; allowed: some text (or leave it out)")
    problem = unicode_problem(text)
    if problem is not None:
        raise RequestError(f"{what} {problem}")
    return text


def _answer(llm: Any, messages: list[dict[str, str]]) -> str:
    """Stream the answer to stdout (in the reporting process), then one line of figures to
    stderr. Returns the answer. Should the answer stop part-way (a failure, Ctrl-C), its line
    is ended first, so what is said about it starts on a line of its own."""
    stream = _Stream(llm.reports_results)
    before = llm.engine.load()
    started = time.perf_counter()
    try:
        if llm.tokenizer is not None and llm.tokenizer.chat_template:
            (output,) = llm.chat(messages, stream=stream)
        else:
            (output,) = llm.generate(messages[-1]["content"], stream=stream)
    except BaseException:
        if stream.wrote:
            print(flush=True)
        raise
    elapsed = time.perf_counter() - started
    if stream.shown:
        print()
        first_token_s = stream.first_token_at - started
        after = llm.engine.load()
        drafts = (
            after.spec_draft_tokens - before.spec_draft_tokens,
            after.spec_accepted_tokens - before.spec_accepted_tokens,
        )
        print(_figures(llm, output, elapsed, first_token_s, drafts), file=sys.stderr)
    return output.text


class _Stream:
    """The ``stream`` callback of one answer: writes each new piece of text to stdout where
    ``shown`` (the process that reports results), and notes when the first token came and
    whether anything was written."""

    def __init__(self, shown: bool) -> None:
        self.shown = shown
        self.first_token_at: float | None = None
        self.wrote = False

    def __call__(self, output: Any, delta: str) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        if self.shown and delta:
            sys.stdout.write(delta)
            sys.stdout.flush()
            self.wrote = True


def _figures(
    llm: Any, output: Any, elapsed: float, first_token_s: float, drafts: tuple[int, int]
) -> str:
    """The answer's line of figures; ``drafts``: the draft tokens proposed and accepted for
    it (speculative decoding)."""
    parallel = llm.engine.config.parallel
    speculative = ""
    if llm.engine.config.speculative.method != "none":
        speculative = f"; {drafts[1]} of {drafts[0]} draft tokens accepted"
    tokens = len(output.token_ids)
    decode_s = elapsed - first_token_s
    rate = f"{(tokens - 1) / decode_s:.1f} tokens/s" if tokens > 1 and decode_s > 0 else "n/a"
    return (
        f"[{tokens} tokens in {elapsed:.2f} s: {rate} after the first token "
        f"({first_token_s * 1000:.0f} ms for {len(output.prompt_token_ids)} prompt tokens); "
        f"tp={parallel.tensor_parallel_size} pp={parallel.pipeline_parallel_size}, "
        f"{parallel.distributed_executor_backend}, {parallel.communicator}; "
        f"stopped: {output.finish_reason}{speculative}]"
    )
