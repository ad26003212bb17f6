"""Drafters and policies used only by tests."""

from __future__ import annotations

import torch

from diffspec.drafters.base import Drafter, DrafterCapabilities, DraftBuilder
from diffspec.policies import LengthPolicy


class RandomDrafter(Drafter):
    """Drafts uniformly random tokens; with_probs=True hands q = uniform to rejection sampling."""

    name = "random"

    def __init__(self, vocab_size: int, seed: int = 0, with_probs: bool = False):
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed)
        self.with_probs = with_probs
        self.capabilities = DrafterCapabilities(gives_probabilities=with_probs)

    def propose(self, context, policy, limit, sampling, generator):
        builder = DraftBuilder()
        uniform = torch.full((self.vocab_size,), 1.0 / self.vocab_size, dtype=torch.float64)
        for k in builder.increments(policy, limit):
            for _ in range(k):
                tok = int(torch.randint(self.vocab_size, (1,), generator=self.gen))
                builder.add(tok, 1.0 / self.vocab_size, uniform if self.with_probs and not sampling.greedy else None)
        return builder.build(0)


class ScriptedDrafter(Drafter):
    """Drafts a fixed continuation (e.g. the reference output itself) with given confidences."""

    name = "scripted"

    def __init__(self, full_sequence, confidence: float = 1.0):
        self.full = list(full_sequence)
        self.confidence = confidence

    def propose(self, context, policy, limit, sampling, generator):
        builder = DraftBuilder()
        rest = self.full[len(context):]
        for k in builder.increments(policy, limit):
            for tok in rest[len(builder): len(builder) + k]:
                builder.add(tok, self.confidence)
        return builder.build(0)


class AlternatingPolicy(LengthPolicy):
    """Drafts `gamma` tokens in a round and switches speculation off in the next (plan_round -> ()),
    from the first round of each request: rounds 1, 3, 5 .. draft, rounds 2, 4, 6 .. are plain steps."""

    name = "alternating"

    def __init__(self, gamma: int = 3):
        self.gamma = gamma
        self.planned = 0

    def begin_request(self, greedy):
        self.planned = 0

    def plan_round(self, context_len, sources):
        self.planned += 1
        return tuple(sources) if self.planned % 2 else ()

    def next_increment(self, confidences):
        return self.gamma if not confidences else 0
