"""Prompt lookup: copy what followed an earlier occurrence of the context's last n-gram.

Training-free, no model. Among the latest `candidates` occurrences of the longest suffix n-gram that has any, the
copy comes from the one whose match reaches furthest back (up to `max_match` tokens; the latest among equals): a
suffix that matched 20 tokens back is a copy in progress, one that matched 2 is a guess. Measured on the bench's
answers (60 prompts, 256 tokens): the first copied token is right ~52% of the time after a 2-token match, ~90%
after 10-19, ~98% after 20+. Confidence is calibrated on the request itself, per match length (2, 3, 4-7, 8-15,
16-31, 32+): the smoothed rate at which the target accepted earlier copied tokens of matches that long (prior
m / (m + 2) for a match of m tokens, worth `prior_weight` tokens). The drafter reads the outcome of its previous
draft from the context it is handed next, so it needs no feedback hook. A long copy that keeps being accepted lets
FailFast win big; copies that keep failing make it fail fast.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ..errors import DiffspecError
from ..policies.base import LengthPolicy
from ..types import Draft, SamplingParams
from .base import Drafter, DrafterCapabilities, DraftBuilder

MAX_MATCH = 64   # how far back a match is followed (longer ones count as this long)
CANDIDATES = 16  # the latest occurrences of the suffix n-gram compared


class Match(NamedTuple):
    """start: where the continuation begins in the ids searched (-1: no match); n: the n-gram length that matched;
    length: how far back the match reaches (>= n, at most max_match)."""
    start: int
    n: int
    length: int


NO_MATCH = Match(-1, 0, 0)


def match_length(source: list, end: int, query: list, n: int, max_match: int = MAX_MATCH) -> int:
    """How many tokens before source[end] equal the tokens at the end of query, given that the last n do (<= max_match).
    Compared a slice at a time, galloping (4, 8, 16 .. tokens further back), then halving into the slice that
    differed: ~10 list comparisons in C where a token-by-token loop in Python took up to 64 steps a candidate (in
    repetitive text, 16 candidates of long matches each round)."""
    q = len(query)
    limit = min(max_match, end, q)
    length, step = n, 4
    while length < limit:  # source[end - length: end] == query[q - length:] holds
        further = min(limit, length + step)
        if source[end - further: end - length] != query[q - further: q - length]:
            break
        length, step = further, 2 * step
    else:
        return length
    low, high = length, min(limit, length + step)  # the match ends in (low, high]: low holds, high does not
    while high - low > 1:
        mid = (low + high) // 2
        if source[end - mid: end - low] == query[q - mid: q - low]:
            low = mid
        else:
            high = mid
    return low


def best_of(source: list, ends, query: list, n: int, max_match: int) -> Match:
    """Of continuation starts `ends` (oldest first), the one whose match reaches furthest back; the latest among
    equals."""
    best = NO_MATCH
    for end in reversed(ends):
        length = match_length(source, end, query, n, max_match)
        if length > best.length:
            best = Match(end, n, length)
            if length >= max_match:
                break
    return best


def find_continuation(context: torch.Tensor, max_ngram: int, min_ngram: int, max_match: int = MAX_MATCH,
                      candidates: int = CANDIDATES) -> Match:
    """The reference scan: the longest suffix n-gram (max_ngram down to min_ngram) with an earlier occurrence (a
    window ending before the last token); of its latest `candidates` occurrences, the one whose match reaches
    furthest back.

    context [L] int64 -> Match(start of the continuation, n, match length), or NO_MATCH.
    """
    length = context.shape[0]
    ids = context.tolist()
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context[length - n:]
        windows = context[: length - 1].unfold(0, n, 1)  # [L-n, n]: windows ending before the last token
        hits = (windows == suffix).all(dim=1).nonzero()
        if hits.numel():
            ends = [int(h) + n for h in hits[-candidates:, 0]]
            return best_of(ids, ends, ids, n, max_match)
    return NO_MATCH


class NgramIndex:
    """`find_continuation` kept up to date as a context grows: each n-gram (min..max) of the context -> the
    continuation starts of its occurrences among the windows that end before the last token (oldest first). A round
    indexes only the tokens it added (a list append each), where the scan compares every window again (~0.2 ms over
    500 tokens, 2-3% of a plain step on a 2-core CPU). Validity comes from the context alone: one that does not
    extend what was indexed (a new request, a shorter or different context) is indexed afresh."""

    def __init__(self, max_ngram: int, min_ngram: int, max_match: int = MAX_MATCH, candidates: int = CANDIDATES):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.max_match, self.candidates = max_match, candidates
        self.ids: list = []
        self.ends: dict = {}  # n-gram tuple -> [continuation start of each indexed occurrence], oldest first

    def _extend(self, ids: list) -> None:
        if len(ids) < len(self.ids) or ids[: len(self.ids)] != self.ids:
            self.ids, self.ends = [], {}
        old = len(self.ids)
        self.ids = ids
        last = len(ids) - 1  # windows must end before the last token: end index <= last - 1
        ends = self.ends
        for n in range(self.min_ngram, self.max_ngram + 1):
            for i in range(max(0, old - n), last - n + 1):  # windows newly complete before the last token
                key = tuple(ids[i: i + n])
                if key in ends:
                    ends[key].append(i + n)
                else:
                    ends[key] = [i + n]

    def find(self, context: torch.Tensor) -> Match:
        """What find_continuation(context, max_ngram, min_ngram, max_match, candidates) returns. (One `tolist` of
        the whole context and a list comparison: comparing tensors and converting only the new tokens was slower
        right after a forward pass, 69 against 36 us a call, torch's per-op overhead being cold.)"""
        ids = context.tolist()
        self._extend(ids)
        return self.lookup(ids, longest=len(ids) - 1)

    def lookup(self, ids: list, longest: Optional[int] = None) -> Match:
        """The continuation in self.ids of the longest suffix n-gram of `ids` (n <= `longest`) found in the index:
        of its latest `candidates` occurrences, the one whose match with the end of `ids` reaches furthest back."""
        length = len(ids)
        for n in range(min(self.max_ngram, length if longest is None else longest), self.min_ngram - 1, -1):
            ends = self.ends.get(tuple(ids[length - n:]))
            if ends:
                return best_of(self.ids, ends[-self.candidates:], ids, n, self.max_match)
        return NO_MATCH

    def continuation(self, ids: list, count: int) -> list:
        """The tokens prompt lookup copies after `ids` (a list), at most `count`; [] where nothing matches: what a
        PromptLookupDrafter without history drafts there at a fixed length `count` (the same index, the same match).
        `ids` is indexed as `find` indexes a context: a list that extends the last one costs only its new tokens.
        The one rule for a conditioned drafter's lookup hints, in serving and in training alike."""
        self._extend(ids)
        match = self.lookup(ids, longest=len(ids) - 1)
        return [] if match.start < 0 else self.ids[match.start: match.start + count]

    def append(self, ids: list, keep: int) -> None:
        """Add `ids` after what is indexed; past `keep` tokens, only the newest keep // 2 stay (indexed afresh:
        a rebuild once every keep // 2 tokens added, not one each time)."""
        joined = self.ids + list(ids)
        if len(joined) > keep:
            joined = joined[len(joined) - keep // 2:]
        self._extend(joined)


class PromptLookupDrafter(Drafter):
    """Copies from the request's context; with `history_tokens`, where the context has no match, from the earlier
    requests this drafter saw (their prompts and answers, the newest `history_tokens` tokens): SuffixDecoding's
    idea, an n-gram index over the target's own past outputs. Exact like any draft (the target verifies it); what
    it costs is a dict lookup. A request's answer goes to the history when the next request begins, as far as the
    drafter saw it (its last round's tokens excepted)."""

    name = "prompt-lookup"
    capabilities = DrafterCapabilities(gives_probabilities=False, needs_target_hidden_states=False,
                                       keeps_own_cache=False)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 2, prior_weight: float = 2.0, history_tokens: int = 0,
                 max_match: int = MAX_MATCH, candidates: int = CANDIDATES):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if isinstance(history_tokens, bool) or not isinstance(history_tokens, int) or history_tokens < 0:
            raise DiffspecError(f"prompt lookup: history_tokens must be an integer >= 0, got {history_tokens!r}")
        for name, value, least in (("max_match", max_match, max_ngram), ("candidates", candidates, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise DiffspecError(f"prompt lookup: {name} must be an integer >= {least}, got {value!r}")
        self.max_ngram, self.min_ngram, self.prior_weight = max_ngram, min_ngram, prior_weight
        self.history_tokens, self.max_match, self.candidates = history_tokens, max_match, candidates
        self._history = self._new_index()
        self._index = self._new_index()
        self.begin(None)

    def _new_index(self) -> NgramIndex:
        return NgramIndex(self.max_ngram, self.min_ngram, self.max_match, self.candidates)

    def begin(self, prompt_ids) -> None:
        if self.history_tokens and len(self._index.ids) > 1:  # the request that ended, as far as it was seen
            self._history.append(self._index.ids, self.history_tokens)
        self._outcomes = {}       # match length class, or ("history", class) -> [accepted tokens, judged tokens]
        self._last = None         # (context length, drafted tokens, key) of the previous draft
        self._index = self._new_index()

    @staticmethod
    def length_class(length: int) -> int:
        """A match length -> its class: 1, 2, 3, then 4 (4-7), 8 (8-15), 16 (16-31), 32 (32+)."""
        return length if length < 4 else min(32, 1 << (length.bit_length() - 1))

    def confidence(self, key) -> float:
        """The smoothed rate at which copies from matches of this length class were accepted in this request; prior
        m / (m + 2) for the context's matches of class m, half that for the history's."""
        accepted, judged = self._outcomes.get(key, (0, 0))
        m, scale = (key[1], 0.5) if isinstance(key, tuple) else (key, 1.0)
        return (accepted + self.prior_weight * scale * m / (m + 2)) / (judged + self.prior_weight)

    def _learn_from(self, context: torch.Tensor) -> None:
        """Score the previous draft against what the target actually emitted after it."""
        if self._last is None:
            return
        start, drafted, key = self._last
        emitted = context[start: start + len(drafted) + 1].tolist()
        accepted = 0
        while accepted < min(len(drafted), len(emitted)) and emitted[accepted] == drafted[accepted]:
            accepted += 1
        judged = accepted + (1 if accepted < len(drafted) and len(emitted) > accepted else 0)
        stats = self._outcomes.setdefault(key, [0, 0])
        stats[0] += accepted
        stats[1] += judged
        self._last = None

    def propose(self, context: torch.Tensor, policy: LengthPolicy, limit: int,
                sampling: SamplingParams, generator: Optional[torch.Generator]) -> Draft:
        self._learn_from(context)
        match = self._index.find(context)
        source, key = self._index.ids, self.length_class(match.length)  # the context's ids, as find just read them
        if match.start < 0 and self._history.ids:
            match = self._history.lookup(self._index.ids)
            source, key = self._history.ids, ("history", self.length_class(match.length))
        start = match.start
        builder = DraftBuilder()
        if start < 0:
            return builder.build(0, context.device)
        confidence = self.confidence(key)
        for k in builder.increments(policy, limit):
            builder.extend(source[start + len(builder): start + len(builder) + k], confidence)
        if len(builder):
            self._last = (int(context.shape[0]), list(builder.tokens), key)
        return builder.build(0, context.device)

    def describe(self) -> str:
        history = f", history {self.history_tokens} tokens" if self.history_tokens else ""
        return (f"prompt-lookup(ngram {self.min_ngram}..{self.max_ngram}, longest match of the latest {self.candidates} "
                f"up to {self.max_match}{history})")

    def cost_signature(self) -> str:
        return "ngram index, longest match"  # a run compares up to `candidates` matches: calibrated again
