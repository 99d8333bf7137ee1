"""The engine in a thread of its own, apart from the HTTP event loop.

Handlers submit a :class:`Ticket`; the engine thread adds it to the engine between steps, so
requests join the running batch as they arrive (the scheduler batches whatever is queued), and
hands every step's gains back to the handler's event loop (``call_soon_threadsafe``) as
:class:`Update` objects. A handler whose client went away aborts its ticket: the request
leaves the engine before the next step and its KV-cache blocks are free at once.

When a step fails (a rank died, a deadline passed) every open request gets an error update,
new requests are refused with 503 while the thread shuts the engine down and starts a new one
(ranks included), and serving resumes; ``shardline_engine_restarts`` counts the restarts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardline.engine.engine import COUNTED, LLMEngine, RequestOutput
from shardline.errors import RequestError
from shardline.interfaces.step import SamplingParams, TokenLogprobs
from shardline.serve.errors import ApiError, bad_request, unavailable
from shardline.serve.metrics import ServeMetrics

log = logging.getLogger("shardline.serve")

#: Seconds between liveness checks of an idle engine's ranks.
HEALTH_POLL_S = 0.25
#: Seconds between attempts to start the engine again, doubling up to the second figure.
RESTART_DELAY_S = (1.0, 30.0)


@dataclass(frozen=True)
class Update:
    """What a request gained in one step: ``text`` (new text, maybe empty), ``num_tokens``
    (generated so far), and once it ends ``finish_reason`` ("stop", "length", "pooled") and
    ``embedding``; or ``error``, the last update of a request the engine could not finish.
    ``scored``: the step's new tokens with their log-probabilities, where the request asked
    for them; ``prompt_scored``, in the update with the first token, the prompt's tokens with
    theirs (None for the first), where asked."""

    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    embedding: Any = None
    error: ApiError | None = None
    scored: tuple[tuple[int, TokenLogprobs], ...] = ()
    prompt_scored: tuple[tuple[int, TokenLogprobs | None], ...] = ()


class Ticket:
    """One prompt on its way through the engine. Made in the handler's event loop, whose
    ``updates`` queue receives ``(choice, Update)`` pairs in order; the tickets of one
    request's choices (``n``) may share one queue, each with its ``choice`` index."""

    def __init__(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        pooling: str | None = None,
        *,
        choice: int = 0,
        updates: asyncio.Queue[tuple[int, Update]] | None = None,
    ) -> None:
        self.prompt_token_ids = prompt_token_ids
        self.sampling = sampling
        self.pooling = pooling
        self.choice = choice
        self.updates: asyncio.Queue[tuple[int, Update]] = (
            asyncio.Queue() if updates is None else updates
        )
        self.arrived = time.monotonic()
        self._loop = asyncio.get_running_loop()
        # Kept by the engine thread.
        self.req_id: str | None = None
        self.num_tokens = 0
        self.last_token_at: float | None = None

    def push(self, update: Update) -> None:
        """Hand ``update`` to the handler's event loop (from any thread)."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening
            self._loop.call_soon_threadsafe(self.updates.put_nowait, (self.choice, update))


class EngineLoop:
    """Owns the engine and the thread that drives it.

    ``start_engine`` builds an engine (ranks started, model loaded); it is called once here,
    so that a bad config fails before anything is served, and again after each failure.
    At most ``max_waiting`` prompts wait for a place in the running batch (or one request's,
    when it has more); beyond that :meth:`submit` refuses with 503.
    """

    def __init__(
        self,
        start_engine: Callable[[], LLMEngine],
        metrics: ServeMetrics,
        max_waiting: int,
    ) -> None:
        self.engine = start_engine()
        self.metrics = metrics
        self._start_engine = start_engine
        self._max_waiting = max_waiting
        self._cond = threading.Condition()
        self._inbox: deque[Ticket] = deque()
        self._aborts: list[Ticket] = []
        self._active: dict[str, Ticket] = {}
        self._num_waiting = 0  # in the scheduler's queue, as of the engine thread's last look
        self._counted: dict[str, int] = {}  # the engine's running totals, as published
        self._failure: str | None = None  # why the engine is down; None while it serves
        self._drain_deadline: float | None = None  # set once the server is told to stop
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="shardline-engine", daemon=True)
        metrics.kv_blocks_total.set(self.engine.load().blocks_total)

    def start(self) -> None:
        self._thread.start()

    # ---- called from the HTTP event loop ----------------------------------------------------

    def submit(self, *tickets: Ticket) -> None:
        """Queue ``tickets`` (one request's prompts) for the engine, all or none. Raises
        ApiError 503 while the engine restarts, the server stops, or the waiting queue has no
        room for them all (a request with more prompts than the queue holds is queued when
        nothing waits: then it waits alone)."""
        with self._cond:
            if self._leaving():
                raise unavailable("the server is shutting down", "shutting_down")
            if self._failure is not None:
                raise unavailable(
                    f"the engine is restarting after a failure ({self._failure}); retry shortly",
                    "engine_restarting",
                )
            waiting = self._num_waiting + len(self._inbox)
            if waiting and waiting + len(tickets) > self._max_waiting:
                adds = f"; this request adds {len(tickets)}" if len(tickets) > 1 else ""
                raise unavailable(
                    f"{waiting} prompts are waiting for the running batch (each input of an "
                    f"embeddings request and each of n choices is one){adds}, the most "
                    f"serve.max_waiting_requests = {self._max_waiting} allows; retry shortly",
                    "queue_full",
                )
            self._inbox.extend(tickets)
            self._cond.notify()

    def abort(self, ticket: Ticket) -> None:
        """The client went away: drop the request (a finished one is left alone)."""
        with self._cond:
            if ticket in self._inbox:
                self._inbox.remove(ticket)
            else:
                self._aborts.append(ticket)
                self._cond.notify()

    def healthy(self) -> bool:
        """Whether the engine serves and every rank is alive."""
        with self._cond:
            if (
                self._failure is not None
                or self._stopping
                or self._drain_deadline is not None
                or not self._thread.is_alive()
            ):
                return False
            engine = self.engine
        try:
            engine.check_health()
        except Exception:
            return False
        return True

    def drain(self, grace_s: float) -> None:
        """The server was told to stop: refuse new requests (503 shutting_down) and give the
        open ones ``grace_s`` seconds to finish; then the thread ends those still open with a
        503 update (a stream: an error event, then ``[DONE]``), as :meth:`stop` would."""
        with self._cond:
            deadline = time.monotonic() + grace_s
            if self._drain_deadline is None or deadline < self._drain_deadline:
                self._drain_deadline = deadline
            self._cond.notify()

    def stop(self, timeout_s: float) -> None:
        """Stop the thread (open requests end with a 503), waiting up to ``timeout_s`` for
        the step it runs, and shut the engine and its ranks down."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.engine.shutdown()  # also ends a step still running: its ranks are stopped
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    # ---- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._has_work, timeout=HEALTH_POLL_S)
                if self._stopping or self._drained():
                    break
                self._take_arrivals()
            try:
                if self.engine.has_unfinished_requests():
                    changed = self.engine.step()
                    now = time.monotonic()
                    for output, delta in changed:
                        self._deliver(output, delta, now)
                else:
                    self.engine.check_health()
                self._publish()
            except Exception as error:
                if not self._restart(error):
                    break
        self._fail_open(
            unavailable(
                "the server is shutting down; the request was not completed", "shutting_down"
            ),
            "abort",
        )

    def _leaving(self) -> bool:
        """Whether the server is stopping or draining (caller holds the lock)."""
        return self._stopping or self._drain_deadline is not None

    def _drained(self) -> bool:
        """Whether the grace :meth:`drain` gave has run out (caller holds the lock)."""
        return self._drain_deadline is not None and time.monotonic() >= self._drain_deadline

    def _has_work(self) -> bool:
        return bool(
            self._stopping or self._inbox or self._aborts or self.engine.has_unfinished_requests()
        )

    def _take_arrivals(self) -> None:
        """Add new tickets to the engine and drop aborted ones (caller holds the lock, so
        that :meth:`submit` counts every waiting request exactly once)."""
        for ticket in self._aborts:
            if ticket.req_id is not None and self._active.pop(ticket.req_id, None) is ticket:
                self.engine.abort(ticket.req_id)
                self.metrics.requests_finished.labels("abort").inc()
        self._aborts.clear()
        while self._inbox:
            ticket = self._inbox.popleft()
            try:
                output = self.engine.add_request(
                    ticket.prompt_token_ids, ticket.sampling, ticket.pooling
                )
            except RequestError as error:
                ticket.push(Update(error=bad_request(str(error), "prompt")))
                continue
            ticket.req_id = output.req_id
            self._active[output.req_id] = ticket
            self.metrics.prompt_tokens.inc(len(ticket.prompt_token_ids))
        self._num_waiting = self.engine.load().waiting

    def _deliver(self, output: RequestOutput, delta: str, now: float) -> None:
        """Hand one request's gains of a step to its handler; time its tokens."""
        ticket = self._active.get(output.req_id)
        if ticket is None:
            return
        gained = len(output.token_ids) - ticket.num_tokens
        scored, prompt_scored = (), ()
        if output.logprobs is not None and gained > 0:
            new = slice(ticket.num_tokens, None)
            scored = tuple(zip(output.token_ids[new], output.logprobs[new], strict=True))
        if output.prompt_logprobs is not None and gained > 0 and ticket.num_tokens == 0:
            prompt_scored = tuple(zip(output.prompt_token_ids, output.prompt_logprobs, strict=True))
        if gained > 0:
            self.metrics.generation_tokens.inc(gained)
            if ticket.last_token_at is None:
                self.metrics.time_to_first_token.observe(now - ticket.arrived)
            else:
                self.metrics.inter_token_latency.observe(now - ticket.last_token_at)
            ticket.last_token_at = now
            ticket.num_tokens = len(output.token_ids)
        if output.finished:
            del self._active[output.req_id]
            self.metrics.requests_finished.labels(output.finish_reason).inc()
        if delta or gained > 0 or output.finished:
            ticket.push(
                Update(
                    delta,
                    len(output.token_ids),
                    output.finish_reason,
                    output.embedding,
                    scored=scored,
                    prompt_scored=prompt_scored,
                )
            )

    def _publish(self) -> None:
        load = self.engine.load()
        with self._cond:
            self._num_waiting = load.waiting
            waiting = self._num_waiting + len(self._inbox)
        self.metrics.requests_running.set(load.running)
        self.metrics.requests_waiting.set(waiting)
        self.metrics.kv_blocks_used.set(load.blocks_used)
        for name in COUNTED:  # Prometheus counters take increments
            total = getattr(load, name)
            getattr(self.metrics, name).inc(total - self._counted.get(name, 0))
            self._counted[name] = total

    def _restart(self, error: Exception) -> bool:
        """After a failed step or a dead rank: fail every open request, start a new engine
        (retrying with growing delays). False when the server is stopping or draining (no
        new engine for a server on its way out)."""
        reason = f"{type(error).__name__}: {error}"
        with self._cond:
            if self._stopping:
                return False
            self._failure = reason
            leaving = self._leaving()
        then = "the server is stopping: no restart" if leaving else "restarting the engine"
        log.error("engine failed: %s; %s", reason, then)
        self._fail_open(
            unavailable(
                f"the engine failed while serving this request ({reason}); the request was "
                "not completed",
                "engine_failed",
            ),
            "error",
        )
        for gauge in (
            self.metrics.requests_running,
            self.metrics.requests_waiting,
            self.metrics.kv_blocks_used,
        ):
            gauge.set(0)
        with contextlib.suppress(Exception):
            self.engine.shutdown()
        if leaving:
            return False
        delay, longest = RESTART_DELAY_S
        started = time.monotonic()
        while True:
            try:
                engine = self._start_engine()
                break
            except Exception as failure:
                log.error("engine restart failed: %s; next try in %.0f s", failure, delay)
            with self._cond:
                if self._cond.wait_for(self._leaving, timeout=delay):
                    return False
            delay = min(2 * delay, longest)
        with self._cond:
            leaving = self._leaving()
            if not leaving:
                self.engine = engine
                self._failure = None
                self._counted = {}
        if leaving:
            engine.shutdown()
            return False
        self.metrics.engine_restarts.inc()
        self._publish()
        log.warning("engine restarted in %.1f s; serving again", time.monotonic() - started)
        return True

    def _fail_open(self, error: ApiError, reason: str) -> None:
        """End every queued and running request with ``error``, counted as ``reason``."""
        with self._cond:
            tickets = [*self._inbox, *self._active.values()]
            self._inbox.clear()
            self._active.clear()
            self._aborts.clear()
        for ticket in tickets:
            ticket.push(Update(error=error))
        self.metrics.requests_finished.labels(reason).inc(len(tickets))
