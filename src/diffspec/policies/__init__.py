"""Speculation-length policies, chosen by name: `fixed` and `failfast`."""

from __future__ import annotations

from typing import Optional

from ..errors import DiffspecError
from .base import LengthPolicy
from .failfast import FailFastPolicy, failfast_next_increment
from .fixed import FixedPolicy

POLICY_NAMES = ("fixed", "failfast")


def make_policy(name: str, gamma: Optional[int] = None, tau: float = 0.45, n: int = 10, n_max: int = 60) -> LengthPolicy:
    """gamma None = 8 (callers with a drafter pass the drafter's `default_gamma`)."""
    if name == "fixed":
        return FixedPolicy(gamma=8 if gamma is None else gamma)
    if name == "failfast":
        return FailFastPolicy(tau=tau, n=n, n_max=n_max)
    raise DiffspecError(f"unknown policy '{name}' (choose from: {', '.join(POLICY_NAMES)})")


__all__ = ["LengthPolicy", "FixedPolicy", "FailFastPolicy", "failfast_next_increment", "make_policy", "POLICY_NAMES"]
