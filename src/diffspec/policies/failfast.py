"""FailFast dynamic speculation length (Pan et al., arXiv 2512.20573, Algorithm 1).

Draft a window of N tokens. When the window is fully drafted: if any token in it has confidence
below tau, stop ("fail fast": hard region, little is wasted); else if N_max tokens are drafted,
stop; else widen the window by N and go on ("win big": easy region, long drafts pay).
Paper defaults: tau = 0.45, N = 10, N_max = 60.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..defaults import FAILFAST_DEFAULTS
from ..errors import DiffspecError
from .base import LengthPolicy


def failfast_next_increment(confidences: Sequence[float], tau: float, n: int, n_max: int) -> int:
    """Pure rule: tokens to add to the window (0 = stop) given the window's confidences."""
    drafted = len(confidences)
    if drafted == 0:
        return min(n, n_max)
    if min(confidences) < tau or drafted >= n_max:
        return 0
    return min(n, n_max - drafted)


@dataclass
class FailFastPolicy(LengthPolicy):
    tau: float = FAILFAST_DEFAULTS["tau"]
    n: int = FAILFAST_DEFAULTS["n"]
    n_max: int = FAILFAST_DEFAULTS["n_max"]
    name: str = "failfast"

    def __post_init__(self) -> None:
        if not (0.0 <= self.tau <= 1.0):
            raise DiffspecError(f"failfast tau must be in [0, 1], got {self.tau!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise DiffspecError(f"failfast N must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.n_max, int) or self.n_max < self.n:
            raise DiffspecError(f"failfast N_max must be an integer >= N ({self.n}), got {self.n_max!r}")

    def next_increment(self, confidences: Sequence[float]) -> int:
        return failfast_next_increment(confidences, self.tau, self.n, self.n_max)

    def cap_notes(self, cap: int) -> tuple:
        if self.n >= cap:
            return (f"FailFast drafts {cap} every round, as fixed gamma {cap} would: its window N={self.n} is not "
                    f"smaller than the {cap} tokens the drafter drafts at most a round (tau and N_max have no effect)",)
        if self.n_max > cap:
            return (f"FailFast N_max={self.n_max} acts as {cap}: the drafter drafts at most {cap} tokens a round",)
        return ()

    def describe(self) -> str:
        return f"failfast(tau={self.tau}, N={self.n}, N_max={self.n_max})"
