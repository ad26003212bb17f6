"""How likely a drafted token is to be accepted, learnt from the rounds themselves.

`AcceptanceCounts` holds Beta counts of "accepted given the drafts before it were" in three views:
by the drafter's confidence (10 bins on [0, 1]), by confidence and draft position together (positions
1, 2, 3-4, 5-8, 9+) - for tokens already drafted - and by position alone for tokens not drafted yet.
Position matters beside confidence: prompt lookup gives every token of a copy the same confidence,
yet once its first token is accepted the rest of the copy usually is too. A round that drafted k and had n accepted judges positions 1..n as
accepted and position n+1 (when n < k) as rejected; later positions were never judged.

`AcceptanceModel` keeps two sets of counts: one for the engine's life (seeded by the calibration
run) and one for the current request. An estimate is the request's counts shrunk towards the
long-lived one, worth `request_prior` tokens: a request that copies much learns it within a few
rounds, and a new request starts from what the drafter usually does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

BINS = 10
POSITIONS = 64
GROUPS = 5


def _bin(confidence: float) -> int:
    return min(BINS - 1, max(0, int(float(confidence) * BINS)))


def _group(position: int) -> int:
    """Draft position (0 = first) -> 0, 1, 2 (2-3), 3 (4-7), 4 (8+)."""
    return min(GROUPS - 1, position.bit_length())


GROUP_SPANS = ((0, 1), (1, 2), (2, 4), (4, 8), (8, 1 << 62))  # the positions of each group, [lo, hi)


@dataclass
class AcceptanceCounts:
    bin_accepted: list = field(default_factory=lambda: [0.0] * BINS)
    bin_judged: list = field(default_factory=lambda: [0.0] * BINS)
    pos_accepted: list = field(default_factory=lambda: [0.0] * POSITIONS)
    pos_judged: list = field(default_factory=lambda: [0.0] * POSITIONS)
    cell_accepted: list = field(default_factory=lambda: [0.0] * (BINS * GROUPS))  # [bin * GROUPS + group]
    cell_judged: list = field(default_factory=lambda: [0.0] * (BINS * GROUPS))

    def add(self, confidences: Sequence[float], accepted: int) -> None:
        judged = min(len(confidences), accepted + 1)
        for i in range(judged):
            ok = 1.0 if i < accepted else 0.0
            b, p = _bin(confidences[i]), min(i, POSITIONS - 1)
            self.bin_accepted[b] += ok
            self.bin_judged[b] += 1.0
            self.pos_accepted[p] += ok
            self.pos_judged[p] += 1.0
            cell = b * GROUPS + _group(i)
            self.cell_accepted[cell] += ok
            self.cell_judged[cell] += 1.0

    def scaled(self, factor: float) -> "AcceptanceCounts":
        return AcceptanceCounts(*([x * factor for x in v] for v in self.__dict__.values()))

    def to_json(self) -> dict:
        return {k: [round(x, 3) for x in v] for k, v in self.__dict__.items()}

    @classmethod
    def from_json(cls, d: dict) -> "AcceptanceCounts":
        c = cls()
        for k in c.__dict__:
            v = d.get(k)
            if isinstance(v, list) and len(v) == len(getattr(c, k)):
                setattr(c, k, [float(x) for x in v])
        return c


def _shrunk(acc: float, judged: float, prior_p: float, prior_weight: float) -> float:
    return (acc + prior_weight * prior_p) / (judged + prior_weight)


class AcceptanceModel:
    """P(accepted | earlier drafts accepted) by confidence and by position; see the module docstring.

    Before anything is seen, a token of confidence c is accepted with probability c (a calibrated
    drafter), worth `base_weight` tokens per bin, and a position with probability `base_position`."""

    def __init__(self, base_weight: float = 4.0, base_position: float = 0.3, request_prior: float = 6.0):
        self.base_weight, self.base_position, self.request_prior = base_weight, base_position, request_prior
        self.life = AcceptanceCounts()
        self.request = AcceptanceCounts()
        self._life_pos_cache = None

    def begin_request(self) -> None:
        self.request = AcceptanceCounts()

    def update(self, confidences: Sequence[float], accepted: int) -> None:
        self.life.add(confidences, accepted)
        self.request.add(confidences, accepted)
        self._life_pos_cache = None

    def seed(self, counts: AcceptanceCounts) -> None:
        """Start the long-lived counts from a calibration run's."""
        self.life = counts
        self._life_pos_cache = None

    def _life_bin(self, b: int) -> float:
        centre = (b + 0.5) / BINS
        return _shrunk(self.life.bin_accepted[b], self.life.bin_judged[b], centre, self.base_weight)

    def _life_positions(self) -> list:
        """Per position; a position never judged takes the estimate of the one before it."""
        if self._life_pos_cache is None:
            out, before = [], self.base_position
            for p in range(POSITIONS):
                judged = self.life.pos_judged[p]
                prior = before if p > 0 and judged < 1 else self.base_position
                before = _shrunk(self.life.pos_accepted[p], judged, prior, self.base_weight)
                out.append(before)
            self._life_pos_cache = out
        return self._life_pos_cache

    def _life_cell(self, b: int, g: int) -> float:
        cell = b * GROUPS + g
        return _shrunk(self.life.cell_accepted[cell], self.life.cell_judged[cell], self._life_bin(b), self.base_weight)

    def by_confidence(self, confidence: float, position: int = 0) -> float:
        """A drafted token of this confidence at this draft position (0 = first)."""
        b, g = _bin(confidence), _group(position)
        cell = b * GROUPS + g
        return _shrunk(self.request.cell_accepted[cell], self.request.cell_judged[cell], self._life_cell(b, g),
                       self.request_prior)

    def by_confidences(self, confidences: Sequence[float]) -> list:
        """[by_confidence(c, i) for i, c in enumerate(confidences)], each (bin, position group) worked out once,
        and a group's positions of one confidence (a copy's: prompt lookup gives all its tokens one) in one go."""
        confidences = list(confidences)
        n = len(confidences)
        memo: dict = {}
        out: list = []
        for g, (lo, hi) in enumerate(GROUP_SPANS):
            if lo >= n:
                break
            span = confidences[lo: min(hi, n)]
            if span.count(span[0]) == len(span):  # one confidence: one cell
                out.extend([self.by_confidence(span[0], lo)] * len(span))
                continue
            for i, c in enumerate(span, lo):
                key = _bin(c)
                if key not in memo:
                    memo[key] = self.by_confidence(c, i)
                out.append(memo[key])
            memo.clear()
        return out

    def by_position(self, position: int) -> float:
        """position 0 = the first drafted token."""
        p = min(position, POSITIONS - 1)
        return _shrunk(self.request.pos_accepted[p], self.request.pos_judged[p], self._life_positions()[p], self.request_prior)

    def probabilities(self, confidences: Sequence[float], horizon: int) -> list:
        """Estimates for positions 0..horizon-1: by confidence where a token is drafted, by position after."""
        out = self.by_confidences(confidences[:horizon])
        out += [self.by_position(i) for i in range(len(out), horizon)]
        return out
