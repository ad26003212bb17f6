"""Speculation-length policies: how many tokens a drafter drafts in a round.

A policy sees only the confidences of the tokens drafted so far in this round and, after each
round, that round's statistics. It never sees a drafter. Drafters ask it in increments:

    k = policy.next_increment(())            # first increment
    while k > 0:
        draft k more tokens, recording each one's confidence
        k = policy.next_increment(confidences)

The drafter also stops when it cannot draft more (no n-gram match, length budget reached).

Around that, the engine gives the policy the round's frame (all optional for a policy to use):

    policy.attach(target, drafter, engine_type)   # once, when the engine is built
    policy.begin_request(greedy)              # each request
    run = policy.plan_round(context_len, sources)   # each round: which drafters run; () = a plain step
    policy.wants_hidden_states()              # after each of those two: False = stop reading them (this request)
    ... drafting (a combined drafter reads planned_sources() and calls select(name) per part) ...
    k = policy.final_length(confidences, draft_seconds)   # greedy or deterministic drafts only: verify k
    policy.update(stats)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Optional, Sequence

from ..types import RoundStats


class LengthPolicy(ABC):
    name: str = "policy"

    @abstractmethod
    def next_increment(self, confidences: Sequence[float]) -> int:
        """How many more tokens to draft given this round's confidences so far; 0 stops."""

    def update(self, stats: RoundStats) -> None:
        """Feedback after each round (adaptive policies override)."""

    def attach(self, target, drafter, engine_type=None) -> None:
        """Called once by the engine, which passes its own class (a policy that measures costs does it here,
        and may run a short engine of that class to time the drafter)."""

    def begin_request(self, greedy: bool) -> None:
        """A new request starts."""

    def plan_round(self, context_len: int, sources: Sequence[str]) -> tuple:
        """Which of the drafter's sources draft this round (all of them unless a policy says otherwise);
        an empty tuple makes the round a plain decoding step, the drafter not called."""
        return tuple(sources)

    def wants_hidden_states(self) -> bool:
        """Whether the drafter that reads the target's hidden states may still run in this request. False (asked
        after begin_request and after each plan_round) stops the engine computing them until the request ends,
        so a policy that says False must never plan that drafter again in the request."""
        return True

    def planned_sources(self) -> Optional[tuple]:
        """The last plan_round answer (None: every source)."""
        return None

    def select(self, source: str) -> None:
        """A combined drafter says which of its parts asks next_increment now."""

    def final_length(self, confidences: Sequence[float], draft_seconds: float) -> int:
        """How many of the drafted tokens to verify (a prefix). Asked only where cutting cannot bias the
        output: greedy decoding, or tokens that are a deterministic function of the context."""
        return len(confidences)

    def draft_value(self, source: str, confidences: Sequence[float], draft_seconds: float) -> float:
        """A proposal's worth, to choose between proposals: here the expected emitted tokens with each
        confidence read as the probability of acceptance."""
        from .choice import expected_emitted

        return expected_emitted(confidences)[-1]

    def prior_value(self, source: str) -> float:
        """What `source` is expected to be worth before it drafts (in draft_value's units); a combined
        drafter skips a part whose prior is below a proposal already in hand. inf: always run it."""
        return float("inf")

    def cap_notes(self, cap: int) -> tuple:
        """What this policy's parameters stop meaning for a drafter that drafts at most `cap` tokens a
        round (shown once, so no parameter is ignored silently). Empty when they all still act."""
        return ()

    def describe(self) -> str:
        return self.name
