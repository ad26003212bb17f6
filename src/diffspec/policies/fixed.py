"""Fixed speculation length: draft gamma tokens every round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..errors import DiffspecError
from .base import LengthPolicy


@dataclass
class FixedPolicy(LengthPolicy):
    gamma: int = 8
    name: str = "fixed"

    def __post_init__(self) -> None:
        if not isinstance(self.gamma, int) or self.gamma < 0:
            raise DiffspecError(f"gamma must be an integer >= 0, got {self.gamma!r}")

    def next_increment(self, confidences: Sequence[float]) -> int:
        return self.gamma if len(confidences) == 0 else 0

    def cap_notes(self, cap: int) -> tuple:
        if self.gamma > cap:
            return (f"gamma {self.gamma} drafts {cap}: the drafter drafts at most {cap} tokens a round",)
        return ()

    def describe(self) -> str:
        return f"fixed(gamma={self.gamma})"
