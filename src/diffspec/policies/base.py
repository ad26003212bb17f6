"""Speculation-length policies: how many tokens a drafter drafts in a round.

A policy sees only the confidences of the tokens drafted so far in this round and, after each
round, that round's statistics. It never sees a drafter. Drafters ask it in increments:

    k = policy.next_increment(())            # first increment
    while k > 0:
        draft k more tokens, recording each one's confidence
        k = policy.next_increment(confidences)

The drafter also stops when it cannot draft more (no n-gram match, length budget reached).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from ..types import RoundStats


class LengthPolicy(ABC):
    name: str = "policy"

    @abstractmethod
    def next_increment(self, confidences: Sequence[float]) -> int:
        """How many more tokens to draft given this round's confidences so far; 0 stops."""

    def update(self, stats: RoundStats) -> None:
        """Feedback after each round (adaptive policies override)."""

    def cap_notes(self, cap: int) -> tuple:
        """What this policy's parameters stop meaning for a drafter that drafts at most `cap` tokens a
        round (shown once, so no parameter is ignored silently). Empty when they all still act."""
        return ()

    def describe(self) -> str:
        return self.name
