"""Drafters used only by tests."""

from __future__ import annotations

import torch

from diffspec.drafters.base import Drafter, DrafterCapabilities, DraftBuilder


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
