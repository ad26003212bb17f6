"""Two (or more) drafters behind one: `--drafter prompt-lookup+conditioned`.

Each round the parts the policy planned run in the order given - put the cheap one first (prompt
lookup costs ~0 and is right on copies; a trained drafter is right elsewhere). After a part has
drafted, a later part runs only if the policy's prior for it (`prior_value`) beats the best proposal
in hand; the proposal with the larger `draft_value` is verified (when sampling, a proposal drawn from
q is valued by its prior alone: see base.draft_may_be_judged). Every part's time is reported in
`Draft.costs`, so a policy learns each one's cost. At most one part may read the target's hidden
states (the engine gives one set of layers)."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Optional, Sequence

import torch

from ..errors import DiffspecError
from ..policies.base import LengthPolicy
from ..types import Draft, SamplingParams
from . import base
from .base import Drafter, DrafterCapabilities


class CombinedDrafter(Drafter):
    def __init__(self, parts: Sequence[Drafter]):
        parts = tuple(parts)
        if len(parts) < 2:
            raise DiffspecError("a combined drafter needs at least two drafters, e.g. prompt-lookup+conditioned")
        names = [p.name for p in parts]
        if len(set(names)) != len(names):
            raise DiffspecError(f"a combined drafter's parts must differ, got {'+'.join(names)}")
        readers = [p for p in parts if p.capabilities.needs_target_hidden_states]
        if len(readers) > 1:
            raise DiffspecError(f"at most one part of a combined drafter may read the target's hidden states "
                                f"({', '.join(p.name for p in readers)} both do)")
        self._parts = parts
        self.name = "+".join(names)
        self._reader = readers[0] if readers else None
        caps = [p.capabilities for p in parts]
        self.capabilities = DrafterCapabilities(
            gives_probabilities=any(c.gives_probabilities for c in caps),
            needs_target_hidden_states=self._reader is not None,
            keeps_own_cache=any(c.keeps_own_cache for c in caps),
            chooses_dtype=any(c.chooses_dtype for c in caps))
        self.target_layer_ids = tuple(self._reader.target_layer_ids) if self._reader else ()
        fingerprints = {p.tokenizer_fingerprint for p in parts} - {None}
        if len(fingerprints) > 1:
            raise DiffspecError(f"the parts of '{self.name}' use different tokenizers")
        self.tokenizer_fingerprint = next(iter(fingerprints), None)
        self.default_gamma = max(p.default_gamma for p in parts)
        caps_per_round = [p.max_tokens_per_round for p in parts]
        self.max_tokens_per_round = None if None in caps_per_round else max(caps_per_round)

    @property
    def parts(self) -> tuple:
        return self._parts

    @property
    def compute_dtype(self) -> Optional[str]:
        return next((p.compute_dtype for p in self.parts if p.capabilities.chooses_dtype), None)

    @compute_dtype.setter
    def compute_dtype(self, value: Optional[str]) -> None:
        for p in self.parts:
            if p.capabilities.chooses_dtype:
                p.compute_dtype = value

    def attach(self, target) -> None:
        for p in self.parts:
            p.attach(target)

    def begin(self, prompt_ids: torch.Tensor) -> None:
        for p in self.parts:
            p.begin(prompt_ids)

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        if self._reader is not None:
            self._reader.observe(hidden, start)

    def propose(self, context: torch.Tensor, policy: LengthPolicy, limit: int,
                sampling: SamplingParams, generator: Optional[torch.Generator]) -> Draft:
        planned = policy.planned_sources()
        running = [part for part in self.parts if planned is None or part.name in planned]
        if len(running) == 1:  # one part planned (the others off or retired): nothing to weigh its draft against
            part = running[0]
            draft, seconds = self._timed_proposal(part, context, policy, limit, sampling, generator)
            return replace(draft, source=part.name, costs=((part.name, len(draft), seconds),))
        best, best_value, costs, passes = None, float("-inf"), [], 0
        for part in running:
            if best is not None and policy.prior_value(part.name) <= best_value:
                continue  # the proposal in hand is worth more than this part usually is
            draft, seconds = self._timed_proposal(part, context, policy, limit, sampling, generator)
            costs.append((part.name, len(draft), seconds))
            passes += draft.forward_passes
            if not len(draft):
                continue
            if base.draft_may_be_judged(draft, sampling):
                value = policy.draft_value(part.name, draft.confidences.tolist(), seconds)
            else:  # tokens drawn from q: the choice must not read the draw (see draft_may_be_judged)
                value = policy.prior_value(part.name)
            if value > best_value:
                best, best_value = replace(draft, source=part.name), value
        if best is None:
            best = replace(Draft.empty(context.device), source=costs[-1][0] if costs else "")
        policy.select(best.source or self.parts[0].name)  # final_length and update read this part's record
        return replace(best, costs=tuple(costs), forward_passes=passes)

    @staticmethod
    def _timed_proposal(part: Drafter, context, policy: LengthPolicy, limit: int, sampling, generator) -> tuple:
        """(part's draft, its drafting seconds), with the policy's lengths read from that part's record."""
        policy.select(part.name)
        t0 = time.perf_counter()
        draft = part.propose(context, policy, limit, sampling, generator)
        return draft, time.perf_counter() - t0

    def describe(self) -> str:
        return "+".join(p.describe() for p in self.parts)
