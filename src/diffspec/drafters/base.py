"""The drafter contract.

A drafter proposes tokens that the target then verifies. Two methods and a feedback hook:

- `begin(prompt_ids)`: a new request starts; drop any per-request state.
- `propose(context, policy, limit, sampling, generator) -> Draft`: draft at most `limit` tokens
  continuing `context` (prompt + every token emitted so far), asking `policy` how far to go.
- `observe(hidden, start)`: feedback after every target pass, with the target's hidden states
  for positions start..start+m-1 (only for drafters that declare `needs_target_hidden_states`).

Drafters declare what they can do with `capabilities` (flags, never `hasattr`). A drafter that
keeps its own KV cache must derive its validity from `context` alone (keep the longest common
prefix with what it cached), so rejected tokens, zero-length drafts and new requests can never
leave it stale.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from ..errors import DiffspecError
from ..policies.base import LengthPolicy
from ..sampling import probs_from_logits, sample
from ..types import Draft, SamplingParams


@dataclass(frozen=True)
class DrafterCapabilities:
    gives_probabilities: bool = False        # Draft.probs is q when sampling (else one-hot q)
    needs_target_hidden_states: bool = False  # wants observe() with target hidden states
    keeps_own_cache: bool = False             # holds a KV cache across rounds
    chooses_dtype: bool = False               # computes in `compute_dtype` ('auto': measured at attach)
    compiles_passes: bool = False             # follows the target's --compile (compile_choice.py)


class Drafter(ABC):
    name: str = "drafter"
    capabilities: DrafterCapabilities = DrafterCapabilities()
    target_layer_ids: tuple = ()           # target layers whose hidden states observe() receives
    tokenizer_fingerprint: Optional[str] = None  # None: works on ids of any tokenizer
    default_gamma: int = 8                 # the fixed policy's draft length when the user names none
    max_tokens_per_round: Optional[int] = None  # the most one round can draft (None: no cap)
    compute_dtype: Optional[str] = None    # with capabilities.chooses_dtype: None (as loaded), 'auto' or a dtype name

    @property
    def parts(self) -> tuple:
        """The drafters this one is made of (itself; a combined drafter's parts, see combined.py)."""
        return (self,)

    @property
    def sources(self) -> tuple:
        """The names a policy plans rounds by: one per part."""
        return tuple(p.name for p in self.parts)

    def attach(self, target) -> None:
        """Called once by the engine: check the target is compatible, keep what is needed of it.

        The base checks refuse a backend that cannot feed this drafter (hidden states) and a target
        whose token ids mean something else than ours."""
        check = getattr(target, "check_drafter", None)
        if check is not None:
            check(self.name, self.capabilities.needs_target_hidden_states)
        self.check_tokenizer(target)

    def check_tokenizer(self, target) -> None:
        """Refuse a target whose token ids mean something else than this drafter's (unknown on either side: accepted)."""
        mine, theirs = self.tokenizer_fingerprint, target.tokenizer_fingerprint
        if mine is not None and theirs is not None and mine != theirs:
            raise DiffspecError(f"tokenizer mismatch: drafter '{self.name}' (vocabulary {mine}) does not share "
                                f"the target's tokenizer (vocabulary {theirs}); a drafter must use the target's vocabulary")

    def begin(self, prompt_ids: torch.Tensor) -> None:
        """A new request; prompt_ids [P] int64."""

    @abstractmethod
    def propose(self, context: torch.Tensor, policy: LengthPolicy, limit: int,
                sampling: SamplingParams, generator: Optional[torch.Generator]) -> Draft:
        """Draft up to `limit` tokens after `context` [n] int64."""

    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """Target hidden states [m, F] for positions start..start+m-1 (see target_layer_ids)."""

    def describe(self) -> str:
        return self.name

    def cost_signature(self) -> str:
        """What in this code, beyond the weights, sets a draft's time: part of the key of the cached calibration
        (costs.drafter_key), so a drafter whose pass got faster is timed again rather than planned by the old
        pass's costs. "" for drafters that never changed."""
        return ""


def draft_may_be_judged(draft: Draft, sampling: SamplingParams) -> bool:
    """May a rule read this draft's tokens and confidences to cut it or to prefer it to another proposal?

    Yes when greedy (nothing is random), and when the draft is verified with one-hot q (probs None):
    one-hot verification emits the target's own distribution at each position whatever token was
    proposed, so any choice made from the proposal is harmless. No when tokens were drawn from q and
    q goes to rejection sampling: keeping a token because its draw was likely under q would make the
    verified tokens follow q conditioned on being kept, not q - the output would drift from the
    target's distribution (tests/test_auto_policy.py shows the chi-square test catching it)."""
    return sampling.greedy or draft.probs is None


def align_logits_to_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Drafter logits [..., V_d] -> [..., vocab_size]: drop rows the target has no token for
    (padding, a drafter-only mask token), give target ids the drafter lacks probability 0."""
    v = logits.shape[-1]
    if v > vocab_size:
        return logits[..., :vocab_size]
    if v < vocab_size:
        pad = logits.new_full((*logits.shape[:-1], vocab_size - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)
    return logits


@dataclass(frozen=True)
class DrawnTokens:
    tokens: torch.Tensor        # [n] int64 (indices into the logits' last dimension)
    token_prob: torch.Tensor    # [n] probability of each drawn token under q (softmax at T=1 when greedy)
    max_prob: torch.Tensor      # [n] largest probability of each row (does not depend on the draw)
    q: Optional[torch.Tensor]   # [n, V] the distribution drawn from; None when greedy (one-hot q)


def draw_tokens(logits: torch.Tensor, sampling: SamplingParams, generator: Optional[torch.Generator]) -> DrawnTokens:
    """One token per row of logits [n, V]: argmax when greedy, else a draw from q = the request's
    temperature/top-k/top-p applied to the drafter's logits."""
    if sampling.greedy:
        probs = torch.softmax(logits.float(), dim=-1)
        max_prob, tokens = probs.max(dim=-1)
        return DrawnTokens(tokens, max_prob, max_prob, None)
    q = probs_from_logits(logits, sampling)
    tokens = sample(q, generator)
    return DrawnTokens(tokens, q.gather(-1, tokens[:, None])[:, 0], q.max(dim=-1).values, q)


class DraftBuilder:
    """Collects one round's drafted tokens and asks the policy for increments.

        builder = DraftBuilder()
        for k in builder.increments(policy, limit):
            ... builder.add(token, confidence, q_row) up to k times ...
        return builder.build(forward_passes)

    Stops when the policy says 0, when `limit` is reached, or when an increment came back short
    (the drafter had nothing more to offer).
    """

    def __init__(self) -> None:
        self.tokens: list = []
        self.confidences: list = []
        self.probs: list = []

    def add(self, token: int, confidence: float, q_row: Optional[torch.Tensor] = None) -> None:
        self.tokens.append(int(token))
        self.confidences.append(float(confidence))
        if q_row is not None:
            self.probs.append(q_row)

    def extend(self, tokens: Sequence[int], confidence: float) -> None:
        """Several tokens of one confidence and no q (what `add` does for each, in one go)."""
        self.tokens.extend(int(t) for t in tokens)
        self.confidences.extend([float(confidence)] * len(tokens))

    def __len__(self) -> int:
        return len(self.tokens)

    def increments(self, policy: LengthPolicy, limit: int) -> Iterator[int]:
        k = min(policy.next_increment(()), limit)
        while k > 0:
            before = len(self.tokens)
            yield k
            if len(self.tokens) - before < k:
                return
            k = min(policy.next_increment(tuple(self.confidences)), limit - len(self.tokens))

    def build(self, forward_passes: int, device="cpu") -> Draft:
        if self.probs and len(self.probs) != len(self.tokens):
            raise RuntimeError("a drafter gave q for some tokens and not others")
        if not self.tokens and forward_passes == 0:  # nothing drafted, nothing run: the shared empty draft
            return Draft.empty(device)                # (two fresh tensors cost ~40 us right after a forward pass)
        return Draft(tokens=torch.tensor(self.tokens, dtype=torch.long, device=device),
                     probs=torch.stack(self.probs) if self.probs else None,
                     confidences=torch.tensor(self.confidences, dtype=torch.float32),
                     forward_passes=forward_passes)
