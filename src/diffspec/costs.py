"""What a round costs on this machine: the target's verify pass for k drafted tokens (measured on a
ladder of k at a few context lengths) and a drafter's draft time (a fixed part and a per-token part).

Measured once per machine x model x dtype (x drafter) and kept as JSON under $DIFFSPEC_CACHE/costs
($DIFFSPEC_COST_CACHE overrides: the tests point it at a temporary folder, so timings taken while
tests share the cores never land in the user's cache),
so the next start reads it in milliseconds; `recalibrate=True` (`--recalibrate`) measures again.
The key holds the CPU model and flags, thread count, torch version, the accelerator's name and a
fingerprint of the model's config and weights: another machine or model never reuses a table.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .devices import synchronize
from .errors import DiffspecError
from .machine_keys import cache_key, cost_dir, machine_key, model_fingerprint
from .output import read_or_fill, write_atomically

VERIFY_KS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
CONTEXTS = (64, 256, 1024)
FORMAT = 1


@dataclass(frozen=True)
class CostTable:
    """Seconds of one verify pass over [last token, k drafts], median of `reps`, per context length.

    verify_s[c][i] is the cost at contexts[c] with ks[i] drafts. `verify(k, context)` interpolates
    linearly in k and in the context length (clamped to the measured range in context, extrapolated
    along the last segment in k)."""

    ks: tuple
    contexts: tuple
    verify_s: tuple
    key: str = ""
    machine: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if not self.ks or self.ks[0] != 0 or list(self.ks) != sorted(set(self.ks)):
            raise ValueError(f"cost table ks must be increasing and start at 0, got {self.ks}")
        if len(self.verify_s) != len(self.contexts) or any(len(row) != len(self.ks) for row in self.verify_s):
            raise ValueError("cost table shape disagrees with its ks and contexts")

    @staticmethod
    def _interp(xs: Sequence[float], ys: Sequence[float], x: float, extrapolate: bool) -> float:
        if len(xs) == 1:
            return float(ys[0])
        if x <= xs[0]:
            return float(ys[0])
        for i in range(1, len(xs)):
            if x <= xs[i]:
                w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
                return float(ys[i - 1] + w * (ys[i] - ys[i - 1]))
        if not extrapolate:
            return float(ys[-1])
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        return float(ys[-1] + max(0.0, slope) * (x - xs[-1]))

    def verify(self, k: int, context: int) -> float:
        per_context = [self._interp(self.ks, row, k, extrapolate=True) for row in self.verify_s]
        return self._interp(self.contexts, per_context, context, extrapolate=False)

    def verify_curve(self, max_k: int, context: int) -> list:
        """[verify(0), .., verify(max_k)] at one context length."""
        return [self.verify(k, context) for k in range(max_k + 1)]

    def to_json(self) -> dict:
        return {"format": FORMAT, **asdict(self)}

    @classmethod
    def from_json(cls, d: dict) -> "CostTable":
        return cls(ks=tuple(d["ks"]), contexts=tuple(d["contexts"]), verify_s=tuple(tuple(r) for r in d["verify_s"]),
                   key=d.get("key", ""), machine=d.get("machine", {}))


@dataclass(frozen=True)
class DraftCost:
    """A drafter's seconds per round: fixed_s + per_token_s * k (k drafted tokens)."""

    fixed_s: float = 0.0
    per_token_s: float = 0.0

    def __call__(self, k: int) -> float:
        return 0.0 if k <= 0 else self.fixed_s + self.per_token_s * k

    def curve(self, max_k: int) -> list:
        return [self(k) for k in range(max_k + 1)]


def fit_draft_cost(samples: Sequence[tuple]) -> DraftCost:
    """Least squares of seconds = a + b k over [(k, seconds)] with k >= 1, a and b kept >= 0."""
    pts = [(float(k), float(s)) for k, s in samples if k >= 1]
    if not pts:
        return DraftCost()
    ks = [k for k, _ in pts]
    ss = [s for _, s in pts]
    if len(set(ks)) == 1:
        return DraftCost(fixed_s=statistics.median(ss))
    mk, ms = sum(ks) / len(ks), sum(ss) / len(ss)
    var = sum((k - mk) ** 2 for k in ks)
    b = max(0.0, sum((k - mk) * (s - ms) for k, s in pts) / var)
    a = ms - b * mk
    if a < 0:  # the line through the origin instead
        a, b = 0.0, sum(k * s for k, s in pts) / sum(k * k for k in ks)
    return DraftCost(fixed_s=a, per_token_s=b)


def non_decreasing(values: Sequence[float]) -> list:
    """The closest non-decreasing sequence in least squares (pool adjacent violators): a pass over more
    tokens never costs less, and one slow reading must not lift every larger k."""
    blocks: list = []  # [sum, count]
    for v in values:
        blocks.append([float(v), 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, n = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += n
    out = []
    for s, n in blocks:
        out += [s / n] * n
    return out


def _read(path: Path) -> Optional[dict]:
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) and d.get("format") == FORMAT else None


def _write(path: Path, d: dict) -> None:
    write_atomically(path, json.dumps(d, indent=1))


# --- measuring ---------------------------------------------------------------------------------
def verify_key(target) -> str:
    # "choices read": a pass is timed with its greedy choices (a screened head computes them after the pass)
    parts = [machine_key(target.device), target.name, str(target.dtype), target.backend, target.fingerprint,
             "choices read"]
    ks = verify_ks_for(target)
    if ks != VERIFY_KS:  # timed at more ks (bucketed compiled widths): a table timed at VERIFY_KS alone is stale
        parts.append(list(ks))
    return cache_key("verify", *parts)


def verify_ks_for(target) -> tuple:
    """The draft lengths k a target's verify pass is timed at: VERIFY_KS, plus, where its passes run
    in bucketed compiled widths (compiled.py), both ends of each bucket. Every k of a bucket runs one
    graph at one cost, so the cost is a step function of k; with both ends measured, the table's
    linear interpolation follows the steps instead of drawing a slope across them."""
    ks = set(VERIFY_KS)
    compiled = getattr(target, "compiled", None)
    if compiled is not None and getattr(compiled, "fn", None) is not None:
        from .compiled import WIDTH_BUCKETS

        below = 0
        for width in WIDTH_BUCKETS:  # a graph of `width` rows serves k = below .. width - 1
            if compiled.runs((width, True)):
                ks.update((below, width - 1))
            below = width
    return tuple(sorted(ks))


def calibration_reps() -> int:
    """Timings of each verify pass when a cost table is measured (the fastest is kept): 3, or
    $DIFFSPEC_CALIBRATION_REPS. The test suite sets 1: its tables stay in a cost cache of the run, timed while
    another test shares the cores, and no test's assertion rests on them (every policy keeps the output exact);
    the llama.cpp target's table took ~38 s of the suite at 3."""
    from .machine_keys import reps_from_env

    return reps_from_env("DIFFSPEC_CALIBRATION_REPS", 3, "timings per verify pass")


def measure_verify_costs(target, ks: Optional[Sequence[int]] = None, contexts: Sequence[int] = CONTEXTS,
                         reps: Optional[int] = None, progress: bool = False) -> CostTable:
    """Time target.forward over 1 + k tokens after a context of c tokens, for each (c, k) (ks: by default
    `verify_ks_for(target)`; reps: `calibration_reps()`). The target's cache is reset before and after (call it
    between requests)."""
    reps = calibration_reps() if reps is None else reps
    ks = verify_ks_for(target) if ks is None else ks
    ks = [k for k in ks if k + 2 <= target.max_context]  # at least one context token before the pass
    if len(ks) < 2:
        raise DiffspecError(f"the model's context ({target.max_context} tokens) is too short to time verify passes")
    max_k = max(ks)
    room = target.max_context - max_k - 1
    usable = sorted({min(c, room) for c in contexts if min(c, room) >= 1})
    gen = torch.Generator().manual_seed(0)
    vocab = target.vocab_size
    rows = []
    from .progress import progress_bar

    bar = progress_bar(len(usable) * len(ks), "timing verify passes", unit="k", enabled=progress)
    for c in usable:
        context = torch.randint(0, vocab, (c,), generator=gen).to(target.device)
        block = torch.randint(0, vocab, (max_k + 1,), generator=gen).to(target.device)
        target.reset()
        target.forward(context)
        for _ in range(2):  # warm-up
            target.forward(block[:2])
            target.truncate(c)
        # the repeats go round every k in turn, not back to back: a burst of a noisy neighbour (hundreds of ms)
        # then lifts one reading of several ks, which the min drops, instead of every reading of one k (a spike
        # the table kept: a 3-token verify timed 7.5 ms above a 2-token one put `auto` off in ~40% of rounds)
        best = [float("inf")] * len(ks)
        for _ in range(reps):
            for i, k in enumerate(ks):
                synchronize(target.device)
                t0 = time.perf_counter()
                target.forward(block[: k + 1]).greedy_tokens()  # what greedy verification reads (greedy_head.py)
                synchronize(target.device)
                best[i] = min(best[i], time.perf_counter() - t0)  # timing noise only ever adds
                target.truncate(c)
        bar.update(len(ks))
        rows.append(tuple(non_decreasing(best)))
    bar.close()
    target.reset()
    return CostTable(ks=tuple(ks), contexts=tuple(usable), verify_s=tuple(rows), key=verify_key(target),
                     machine=machine_key(target.device))


def load_or_measure_verify_costs(target, recalibrate: bool = False, progress: bool = False) -> tuple:
    """-> (CostTable, whether it came from the cache). Another process timing the same passes is waited for and
    its table read."""
    key = verify_key(target)
    path = verify_path(target)

    def cached() -> Optional[CostTable]:
        d = None if recalibrate else _read(path)
        return CostTable.from_json(d) if d is not None and d.get("key") == key else None

    def measured() -> CostTable:
        if progress:
            import sys

            print("diffspec: timing the target's verify passes on this machine (once; cached)", file=sys.stderr)
        table = measure_verify_costs(target, progress=progress)
        _write(path, table.to_json())
        return table

    return read_or_fill(path, cached, measured)


def drafter_key(target, drafter) -> str:
    """Machine x target x drafter. A drafter with a model is named by its class, name and weights (whose
    dtype is the one it settled on); describe() is not used for those, as it carries timings."""
    model = getattr(drafter, "model", None)
    what = model_fingerprint(model) if isinstance(model, torch.nn.Module) else drafter.describe()
    if drafter.capabilities.compiles_passes and drafter.runs_compiled:  # its draft costs change with it
        what = cache_key(what, "compiled passes")
    for part in drafter.parts:  # a combined drafter's parts each
        if part.cost_signature():
            what = cache_key(what, part.cost_signature())
    return cache_key("drafter", verify_key(target), type(drafter).__name__, drafter.name, what)


def verify_path(target) -> Path:
    return cost_dir() / f"verify-{verify_key(target)}.json"


def drafter_calibration(target, drafter, measure: Callable[[], dict], recalibrate: bool = False,
                        progress: bool = False) -> tuple:
    """A drafter's calibration record from the cache, or measured now by `measure()` (policies/auto.py
    `calibrate_drafter`, which runs an engine: passed in, so that timing costs never imports the engine
    that reads them; announced on stderr with `progress`) and cached. The drafter must be attached.
    -> (record, 'cache' | 'measured', path)."""
    key = drafter_key(target, drafter)  # taken once: calibrating re-attaches the drafter
    path = cost_dir() / f"drafter-{key}.json"

    def cached() -> Optional[dict]:
        d = None if recalibrate else _read(path)
        return d if d is not None and d.get("key") == key else None

    def measured() -> dict:
        if progress:
            import sys

            print(f"diffspec: timing drafter {drafter.name} on this machine (a short run at fixed draft lengths; "
                  f"once, then cached)", file=sys.stderr)
        record = {"format": FORMAT, "key": key, "drafter": drafter.describe(), **measure()}
        _write(path, record)
        return record

    record, read = read_or_fill(path, cached, measured)  # another process calibrating it: waited for, then read
    return record, "cache" if read else "measured", path
