"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram.

Training-free, no model. Confidence of every drafted token is (matched n-gram length / max_ngram):
a 3-gram match is trusted fully, a 1-gram match a third, so FailFast stops early on weak matches.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..policies.base import LengthPolicy
from ..types import Draft, SamplingParams
from .base import Drafter, DrafterCapabilities, DraftBuilder


def find_continuation(context: torch.Tensor, max_ngram: int, min_ngram: int) -> tuple:
    """Latest earlier match of context's suffix, longest n first.

    context [L] int64 -> (start index of the continuation, n) or (-1, 0) when nothing matches.
    """
    length = context.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = context[length - n:]
        windows = context[: length - 1].unfold(0, n, 1)  # [L-n, n]: windows ending before the last token
        hits = (windows == suffix).all(dim=1).nonzero()
        if hits.numel():
            return int(hits[-1, 0]) + n, n
    return -1, 0


class PromptLookupDrafter(Drafter):
    name = "prompt-lookup"
    capabilities = DrafterCapabilities(gives_probabilities=False, needs_target_hidden_states=False,
                                       keeps_own_cache=False)

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: torch.Tensor, policy: LengthPolicy, limit: int,
                sampling: SamplingParams, generator: Optional[torch.Generator]) -> Draft:
        start, n = find_continuation(context, self.max_ngram, self.min_ngram)
        builder = DraftBuilder()
        if start < 0:
            return builder.build(0, context.device)
        confidence = n / self.max_ngram
        source = context[start:].tolist()
        for k in builder.increments(policy, limit):
            for token in source[len(builder): len(builder) + k]:
                builder.add(token, confidence)
        return builder.build(0, context.device)

    def describe(self) -> str:
        return f"prompt-lookup(ngram {self.min_ngram}..{self.max_ngram})"
