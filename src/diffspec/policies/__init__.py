"""Speculation-length policies, chosen by name: `auto` (measured costs, the default), `fixed` and `failfast`."""

from __future__ import annotations

from typing import Optional

from ..defaults import FAILFAST_DEFAULTS, POLICY_SETTINGS
from ..errors import DiffspecError
from .auto import AutoPolicy
from .base import LengthPolicy
from .failfast import FailFastPolicy, failfast_next_increment
from .fixed import FixedPolicy

POLICY_NAMES = ("auto", "fixed", "failfast")
# POLICY_SETTINGS (defaults.py, imported above): the settings each policy reads (make_policy's keywords); a
# setting given for a policy that does not read it is refused by name (cli_options.policy_options, the bench's
# method parameters)


def make_policy(name: str, gamma: Optional[int] = None, tau: float = FAILFAST_DEFAULTS["tau"],
                n: int = FAILFAST_DEFAULTS["n"], n_max: int = FAILFAST_DEFAULTS["n_max"],
                recalibrate: bool = False, progress: bool = False) -> LengthPolicy:
    """gamma None = 8 (callers with a drafter pass the drafter's `default_gamma`). `recalibrate`: the
    auto policy measures this machine's costs again instead of reading its cache."""
    if recalibrate and name != "auto":
        raise DiffspecError(f"recalibrate applies to the auto policy, not '{name}'")
    if name == "auto":
        return AutoPolicy(recalibrate=recalibrate, progress=progress)
    if name == "fixed":
        return FixedPolicy(gamma=8 if gamma is None else gamma)
    if name == "failfast":
        return FailFastPolicy(tau=tau, n=n, n_max=n_max)
    raise DiffspecError(f"unknown policy '{name}' (choose from: {', '.join(POLICY_NAMES)})")


__all__ = ["AutoPolicy", "LengthPolicy", "FixedPolicy", "FailFastPolicy", "failfast_next_increment", "make_policy", "POLICY_NAMES", "POLICY_SETTINGS"]
