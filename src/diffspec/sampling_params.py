"""SamplingParams: how the target's next-token distribution becomes a token. Apart from types.py (which re-exports
it) because it needs no torch: the CLI checks a request's sampling settings before it imports torch (~3 s)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .errors import DiffspecError


@dataclass(frozen=True)
class SamplingParams:
    """How the target's next-token distribution is turned into a token.

    temperature == 0 means greedy (argmax); top_p in (0, 1]; top_k == 0 means no top-k cut.
    seed makes sampling reproducible (one torch.Generator per request).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or math.isnan(self.temperature) or self.temperature < 0:
            raise DiffspecError(f"temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if math.isinf(self.temperature):
            raise DiffspecError("temperature must be finite")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise DiffspecError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise DiffspecError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or self.seed < 0):
            raise DiffspecError(f"seed must be an integer >= 0, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
