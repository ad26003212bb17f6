"""The single engine behind the server: a bounded FIFO queue and one worker thread.

Contract:
- `EngineWorker.submit(job)` queues a job or raises `QueueFull` when `max_queue` jobs already
  wait (the running one does not count). Jobs run one at a time, in arrival order.
- Each job reports to its own asyncio queue, on the event loop that submitted it, in this order:
  `("started",)` once the engine accepted the request, then `("delta", text)` for text that is
  safe to send (stop strings already removed, see stops.py), then exactly one of
  `("done", Outcome)` or `("error", status, message)`. A job that fails before starting reports
  only the error; a cancelled job ends with `("error", 499, ...)`. Nothing accepted is dropped:
  every job gets "done" or "error", also at shutdown.
- `cancel(job)` (the client went away) removes a waiting job, or makes the running one stop at
  the next round: the engine stream is closed, so no further target pass is spent on it.

Generation runs in the worker thread, off the event loop, so /health and /metrics answer while
a long request runs.

Usage accounting: `Outcome.completion_tokens` counts the generated tokens needed to produce the
text actually returned. When a stop string cuts the text at character c, it is the smallest m
such that the decoded first m generated tokens cover c characters: the tokens that made the
returned text, including one the stop string starts inside of, and none of those that only
made the stop string or what followed it in the same round. Re-tokenising the returned text
would count a different tokenisation than the one the model produced. Without a stop string it
is every generated token (a final stop token included, as GenerationResult.token_ids does).
"""

from __future__ import annotations

import asyncio
import collections
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Optional

from ..errors import DiffspecError
from ..types import draft_length_histogram
from .metrics import Metrics
from .protocol import GenerationRequest
from .stops import StopMatcher


CANCELLED = "the client closed the request; generation stopped"


class QueueFull(Exception):
    """Raised by submit when the queue is at capacity (or the server stops); `retry_after` is a hint in seconds."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


@dataclass(frozen=True)
class Outcome:
    """What one finished job produced (the text itself went out as deltas)."""

    text: str
    finish_reason: str         # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    speculative: dict          # see speculative_stats


@dataclass(eq=False)
class Job:
    """One request in the queue; `events` lives on `loop` (see the module docstring)."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    arrived: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    state: str = "new"         # new -> queued -> running -> finished

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:   # the loop is gone: nobody is listening any more
            pass


class EngineWorker:
    """Owns the engine; see the module docstring."""

    def __init__(self, engine, metrics: Metrics, max_queue: int = 64):
        if max_queue < 0:
            raise DiffspecError(f"--max-queue must be >= 0, got {max_queue}")
        self.engine = engine
        self.metrics = metrics
        self.max_queue = max_queue
        self._queue: collections.deque = collections.deque()
        self._cond = threading.Condition()
        self._running: Optional[Job] = None
        self._stopping = False
        self._service_s = 1.0      # moving average of a job's run time, for Retry-After
        self._thread = threading.Thread(target=self._loop, name="diffspec-engine", daemon=True)

    # --- called from the event loop ---------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop after the running job; jobs still waiting get an error (503)."""
        with self._cond:
            self._stopping = True
            waiting, self._queue = list(self._queue), collections.deque()
            self._cond.notify_all()
        for job in waiting:
            job.state = "finished"
            job.emit("error", 503, "the server is shutting down; the request was not run")
        self._thread.join(timeout)

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                raise QueueFull("the server is shutting down; retry later", 1)
            idle = 1 if self._running is None else 0  # an idle worker takes the first job at once
            if len(self._queue) >= self.max_queue + idle:
                depth = len(self._queue)
                wait = self._service_s * (depth + 1)
                raise QueueFull(f"server busy: {depth} requests already waiting (--max-queue {self.max_queue}); "
                                f"retry later", max(1, min(600, int(wait + 0.999))))
            job.state = "queued"
            self._queue.append(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """The client is gone: drop a waiting job, or stop the running one at the next round."""
        with self._cond:
            if job.state in ("finished", "new") or job.cancelled.is_set():
                return
            job.cancelled.set()
            if job.state == "queued":
                self._queue.remove(job)
                job.state = "finished"
                self.metrics.finished("cancelled")
                job.emit("error", 499, CANCELLED)

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def running(self) -> int:
        return 0 if self._running is None else 1

    # --- the worker thread ------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                job = self._queue.popleft()
                job.state, self._running = "running", job
            t0 = time.perf_counter()
            try:
                self._run(job)
            except DiffspecError as e:
                self.metrics.finished("error")
                job.emit("error", 400, str(e))
            except Exception as e:  # a bug or a model failure: report it, keep serving
                traceback.print_exc()
                self.metrics.finished("error")
                job.emit("error", 500, f"generation failed: {type(e).__name__}: {e}")
            finally:
                with self._cond:
                    job.state, self._running = "finished", None
                self._service_s = 0.8 * self._service_s + 0.2 * (time.perf_counter() - t0)

    def _run(self, job: Job) -> None:
        req = job.request
        if job.cancelled.is_set():  # gone between leaving the queue and starting
            self.metrics.finished("cancelled")
            job.emit("error", 499, CANCELLED)
            return
        stream = self.engine.stream(list(req.prompt_ids), max_new_tokens=req.max_tokens, sampling=req.sampling,
                                    chat=False)
        job.emit("started")
        matcher = StopMatcher(req.stop)
        text, first, finish = [], None, None
        try:
            for block in stream:
                if job.cancelled.is_set():
                    break
                out = matcher.feed(block)
                if matcher.stopped:
                    finish = "stop"
                if out:
                    first = first if first is not None else time.perf_counter()
                    text.append(out)
                    job.emit("delta", out)
                if finish:
                    break
            else:
                out = matcher.flush()
                if out:
                    first = first if first is not None else time.perf_counter()
                    text.append(out)
                    job.emit("delta", out)
        finally:
            stream.close()  # a stop string or a cancel: no further round runs
        if finish is None and not job.cancelled.is_set() and stream.result is not None:
            finish = stream.result.finish_reason
        rounds = stream.round_stats
        spec = speculative_stats(rounds)
        self.metrics.engine_work(spec["rounds"], spec["drafted_tokens"], spec["accepted_tokens"],
                                 len(stream.token_ids), spec["speculation_off_rounds"])
        if finish is None:  # cancelled: the client is gone
            self.metrics.finished("cancelled")
            job.emit("error", 499, CANCELLED)
            return
        generated = list(stream.token_ids)
        completion = self._tokens_covering(generated, matcher.released_chars) if matcher.stopped else len(generated)
        now = time.perf_counter()
        self.metrics.completed(finish, len(req.prompt_ids), completion, now - job.arrived,
                               None if first is None else first - job.arrived)
        job.emit("done", Outcome("".join(text), finish, len(req.prompt_ids), completion, spec))

    def _tokens_covering(self, ids: list, chars: int) -> int:
        """Smallest m such that the first m generated tokens decode to at least `chars` characters."""
        decode = self.engine.target.decode
        m = len(ids)
        while m > 0 and len(decode(ids[: m - 1])) >= chars:
            m -= 1
        return m


def speculative_stats(rounds) -> dict:
    """The per-request `speculative` object from the engine's RoundStats: rounds, drafted_tokens,
    accepted_tokens (verification's verdict: a request's last round, cut by a stop token or the length limit,
    may count drafted tokens the completion does not hold), mean_accepted_length (emitted tokens a round, bonus
    token included), acceptance_rate,
    speculation_off_rounds (rounds the policy ran no drafter in), hidden_state_rounds (rounds whose verify pass
    computed the target's hidden states for the drafter) and draft_length_histogram
    ({"k": rounds that verified k drafted tokens}, as `diffspec generate --json` gives it)."""
    n = len(rounds)
    drafted = sum(r.drafted for r in rounds)
    accepted = sum(r.accepted for r in rounds)
    emitted = sum(r.emitted for r in rounds)
    return {"rounds": n, "drafted_tokens": drafted, "accepted_tokens": accepted,
            "mean_accepted_length": round(emitted / n, 4) if n else 0.0,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "speculation_off_rounds": sum(1 for r in rounds if r.speculation_off),
            "hidden_state_rounds": sum(1 for r in rounds if r.hidden_states),
            "draft_length_histogram": {str(k): v for k, v in draft_length_histogram(rounds).items()}}
