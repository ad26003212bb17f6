"""The wall-clock timer behind the measured kernel plan, drafter dtype and training dtype choices.

Each choice times a few calls of a step after untimed warm-up calls, synchronising the device around
each timed call so that a CUDA step is timed to its end, not to its launch."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional

from .devices import synchronize


def step_seconds(step: Callable[[], object], repeats: int = 5, warmup: int = 1, device: Optional[str] = None) -> list:
    """Seconds of each of `repeats` calls of `step()`, after `warmup` untimed calls."""
    times = []
    for _ in range(warmup + repeats):
        if device is not None:
            synchronize(device)
        t0 = time.perf_counter()
        step()
        if device is not None:
            synchronize(device)
        times.append(time.perf_counter() - t0)
    return times[warmup:]


def median_seconds(step: Callable[[], object], repeats: int = 5, warmup: int = 1, device: Optional[str] = None) -> float:
    return statistics.median(step_seconds(step, repeats, warmup, device))


def min_seconds(step: Callable[[], object], repeats: int = 5, warmup: int = 1, device: Optional[str] = None) -> float:
    return min(step_seconds(step, repeats, warmup, device))


def median_ms(step: Callable[[], object], device: Optional[str] = None, repeats: int = 5, warmup: int = 2) -> float:
    """Median wall-clock milliseconds of `step()` after `warmup` untimed calls (device-synchronized)."""
    return 1000 * median_seconds(step, repeats, warmup, device)
