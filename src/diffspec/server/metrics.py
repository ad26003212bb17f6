"""Server metrics in the Prometheus text exposition format (GET /metrics), no dependency.

Thread-safe: the event loop records requests, the worker thread records engine work.

    diffspec_requests_total{endpoint,code}      HTTP answers by endpoint and status code
    diffspec_requests_finished_total{reason}    stop | length | cancelled (client gone) | error
    diffspec_prompt_tokens_total                prompt tokens of completed requests
    diffspec_generation_tokens_total            completion tokens returned (usage.completion_tokens)
    diffspec_engine_tokens_total                tokens the engine generated, cancelled requests included
    diffspec_engine_rounds_total                draft -> verify rounds
    diffspec_speculation_off_rounds_total       rounds the policy ran no drafter in (a plain step by choice)
    diffspec_drafted_tokens_total / diffspec_accepted_tokens_total
    diffspec_mean_accepted_length               engine tokens / rounds (vLLM's convention, bonus included)
    diffspec_queue_depth / diffspec_requests_running
    diffspec_request_latency_seconds            histogram: arrival -> last token (completed requests)
    diffspec_time_to_first_token_seconds        histogram: arrival -> first text produced
"""

from __future__ import annotations

import threading
from typing import Callable, Optional

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0)


class Histogram:
    def __init__(self, buckets: tuple):
        self.buckets = tuple(buckets)
        self.counts = [0] * len(self.buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, b in enumerate(self.buckets):
            if value <= b:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list:
        out = [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        out += [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Counters, gauges and histograms of one server; `render()` gives the exposition text."""

    def __init__(self, queue_depth: Callable[[], int] = lambda: 0, running: Callable[[], int] = lambda: 0):
        self._lock = threading.Lock()
        self.queue_depth = queue_depth
        self.running = running
        self.requests: dict = {}        # (endpoint, code) -> n
        self.finished_by: dict = {}     # reason -> n
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.engine_tokens = 0
        self.rounds = 0
        self.speculation_off_rounds = 0
        self.drafted = 0
        self.accepted = 0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.ttft = Histogram(TTFT_BUCKETS)

    def request(self, endpoint: str, code: int) -> None:
        with self._lock:
            key = (endpoint, str(code))
            self.requests[key] = self.requests.get(key, 0) + 1

    def finished(self, reason: str) -> None:
        with self._lock:
            self.finished_by[reason] = self.finished_by.get(reason, 0) + 1

    def engine_work(self, rounds: int, drafted: int, accepted: int, tokens: int, speculation_off_rounds: int) -> None:
        with self._lock:
            self.rounds += rounds
            self.speculation_off_rounds += speculation_off_rounds
            self.drafted += drafted
            self.accepted += accepted
            self.engine_tokens += tokens

    def completed(self, reason: str, prompt_tokens: int, completion_tokens: int, latency_s: float,
                  ttft_s: Optional[float]) -> None:
        with self._lock:
            self.finished_by[reason] = self.finished_by.get(reason, 0) + 1
            self.prompt_tokens += prompt_tokens
            self.generation_tokens += completion_tokens
            self.latency.observe(latency_s)
            if ttft_s is not None:
                self.ttft.observe(ttft_s)

    def render(self) -> str:
        with self._lock:
            out: list = []

            def family(name: str, kind: str, text: str, samples: list) -> None:
                out.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}"] + samples)

            family("diffspec_requests_total", "counter", "HTTP answers by endpoint and status code.",
                   [f'diffspec_requests_total{{endpoint="{e}",code="{c}"}} {n}'
                    for (e, c), n in sorted(self.requests.items())])
            family("diffspec_requests_finished_total", "counter", "Generations by how they ended.",
                   [f'diffspec_requests_finished_total{{reason="{r}"}} {self.finished_by.get(r, 0)}'
                    for r in sorted({"stop", "length", "cancelled", "error"} | set(self.finished_by))])
            for name, text, value in (
                    ("diffspec_prompt_tokens_total", "Prompt tokens of completed requests.", self.prompt_tokens),
                    ("diffspec_generation_tokens_total", "Completion tokens returned to clients.",
                     self.generation_tokens),
                    ("diffspec_engine_tokens_total", "Tokens generated by the engine, cancelled requests included.",
                     self.engine_tokens),
                    ("diffspec_engine_rounds_total", "Draft-verify rounds.", self.rounds),
                    ("diffspec_speculation_off_rounds_total", "Rounds the policy ran no drafter in (a plain step "
                     "by choice).", self.speculation_off_rounds),
                    ("diffspec_drafted_tokens_total", "Tokens proposed by the drafter.", self.drafted),
                    ("diffspec_accepted_tokens_total", "Drafted tokens accepted by the target.", self.accepted)):
                family(name, "counter", text, [f"{name} {value}"])
            mean = self.engine_tokens / self.rounds if self.rounds else 0.0
            family("diffspec_mean_accepted_length", "gauge", "Engine tokens per round (bonus token included).",
                   [f"diffspec_mean_accepted_length {mean:.4f}"])
            family("diffspec_queue_depth", "gauge", "Requests waiting for the engine.",
                   [f"diffspec_queue_depth {self.queue_depth()}"])
            family("diffspec_requests_running", "gauge", "Requests being generated.",
                   [f"diffspec_requests_running {self.running()}"])
            family("diffspec_request_latency_seconds", "histogram", "Arrival to last token, completed requests.",
                   self.latency.lines("diffspec_request_latency_seconds"))
            family("diffspec_time_to_first_token_seconds", "histogram", "Arrival to the first text produced.",
                   self.ttft.lines("diffspec_time_to_first_token_seconds"))
            return "\n".join(out) + "\n"
