"""Plain data passed between the engine, drafters, policies and callers.

All configs and results are frozen dataclasses; tensors carry a shape comment.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional

import torch

from .errors import DiffspecError
from .sampling_params import SamplingParams  # noqa: F401 (types.SamplingParams as before)


_EMPTY_DRAFTS: dict = {}  # device -> Draft.empty(device)


@dataclass(frozen=True)
class Draft:
    """What a drafter proposes for one round.

    tokens:      [k] int64, the drafted token ids (k may be 0).
    probs:       [k, V] float, q(. | prefix) the distribution each token was drawn from, already
                 processed with the request's SamplingParams; None means one-hot q (the drafter
                 picked its tokens deterministically, e.g. prompt lookup or greedy drafting).
    confidences: [k] float in [0, 1], the drafter's own confidence in each token (what
                 speculation-length policies read).
    forward_passes: drafter model forward passes spent on this draft.
    source:      which drafter proposed it (a combined drafter's part; "" = the engine's drafter).
    costs:       ((source, tokens drafted, seconds), ...) for each drafter that ran this round, when a
                 combined drafter ran several (empty: the engine times the one drafter itself).
    """

    tokens: torch.Tensor
    probs: Optional[torch.Tensor]
    confidences: torch.Tensor
    forward_passes: int = 0
    source: str = ""
    costs: tuple = ()

    def __post_init__(self) -> None:
        k = self.tokens.shape[0]
        if self.tokens.dim() != 1 or self.confidences.shape != (k,):
            raise ValueError(f"Draft shapes disagree: tokens {tuple(self.tokens.shape)}, "
                             f"confidences {tuple(self.confidences.shape)}")
        if self.probs is not None and (self.probs.dim() != 2 or self.probs.shape[0] != k):
            raise ValueError(f"Draft probs must be [k, V] with k={k}, got {tuple(self.probs.shape)}")

    @staticmethod
    def empty(device: torch.device | str = "cpu") -> "Draft":
        """No tokens (one per device, shared: a Draft is frozen and its empty tensors hold nothing to change)."""
        device = torch.device(device)
        if device not in _EMPTY_DRAFTS:
            _EMPTY_DRAFTS[device] = Draft(torch.empty(0, dtype=torch.long, device=device), None,
                                          torch.empty(0, device=device), 0)
        return _EMPTY_DRAFTS[device]

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def to(self, device) -> "Draft":
        """The draft with its tokens and q rows on `device` (the target's: a drafter may build them on
        the CPU, and verification compares them with the target's rows). Itself when already there."""
        device = torch.device(device)
        if self.tokens.device == device and (self.probs is None or self.probs.device == device):
            return self
        return replace(self, tokens=self.tokens.to(device), probs=None if self.probs is None else self.probs.to(device))

    def prefix(self, n: int) -> "Draft":
        """The first n drafted tokens (a prefix of a draft is a valid draft: same q rows)."""
        if n >= len(self):
            return self
        return replace(self, tokens=self.tokens[:n], probs=None if self.probs is None else self.probs[:n],
                       confidences=self.confidences[:n])


@dataclass(frozen=True)
class RoundStats:
    """One draft -> verify -> accept round.

    drafted:  tokens the drafter proposed.
    accepted: drafted tokens the target accepted (a prefix of the draft): verification's verdict, the
              drafter's record (what policies learn from, as vLLM counts it), even where a stop token or the
              length limit then cut the output short of them.
    emitted:  tokens appended to the output this round: accepted + the target's own token
              (recovered or bonus), fewer if a stop token or the length limit cut the round; so
              emitted == accepted + 1 in every round but a request's last, and there
              emitted <= accepted + 1.
    speculation_off: the policy ran no drafter this round (a plain step by choice, not for want of a
              draft); drafted is then 0.
    source:   the drafter whose proposal was verified ("" without a drafter).
    draft_costs: ((source, tokens drafted, seconds), ...) per drafter that ran; `drafted` counts the
              tokens verified, which a policy may have cut from more drafted.
    hidden_states: the verify pass returned the target's hidden states for the drafter.
    """

    drafted: int
    accepted: int
    emitted: int
    draft_time_s: float
    verify_time_s: float
    target_forward_passes: int
    drafter_forward_passes: int
    confidences: tuple = ()
    speculation_off: bool = False
    source: str = ""
    draft_costs: tuple = ()
    hidden_states: bool = False

    @property
    def wall_time_s(self) -> float:
        return self.draft_time_s + self.verify_time_s


@dataclass(frozen=True)
class GenerationResult:
    """The output of one request and how it was produced.

    token_ids excludes the prompt and includes a final stop token when generation ended on one
    (as transformers' generate does); text is decoded without special tokens.

    mean_accepted_length counts the bonus token (vLLM's convention): it is emitted tokens per
    round, so plain decoding scores 1.0 and a round that accepts all k drafted tokens scores k+1.
    accepted_tokens is verification's verdict (RoundStats.accepted): where a stop token or the
    length limit cut the last round, it may count drafted tokens the output does not hold.
    target_forward_passes includes the prefill pass; prefill_forward_passes is 0 where the target still held
    this prompt's prefill from the request before (Target.prefill) or the prompt is one token.
    """

    text: str
    token_ids: list
    prompt_token_ids: list
    finish_reason: str  # "stop" | "length"
    rounds: tuple = field(default_factory=tuple)  # of RoundStats
    wall_time_s: float = 0.0
    prefill_time_s: float = 0.0
    prefill_forward_passes: int = 0
    notes: tuple = ()  # settings that had no effect with this drafter (see LengthPolicy.cap_notes)

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    @property
    def drafted_tokens(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted_tokens(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def mean_accepted_length(self) -> float:
        return sum(r.emitted for r in self.rounds) / max(1, len(self.rounds))

    @property
    def speculation_off_rounds(self) -> int:
        return sum(1 for r in self.rounds if r.speculation_off)

    @property
    def hidden_state_rounds(self) -> int:
        """Rounds whose verify pass returned the target's hidden states for the drafter."""
        return sum(1 for r in self.rounds if r.hidden_states)

    @property
    def draft_length_histogram(self) -> dict:
        """{tokens verified in a round: rounds}, speculation-off rounds under 0 with the others."""
        return draft_length_histogram(self.rounds)

    @property
    def target_forward_passes(self) -> int:
        return self.prefill_forward_passes + sum(r.target_forward_passes for r in self.rounds)

    @property
    def drafter_forward_passes(self) -> int:
        return sum(r.drafter_forward_passes for r in self.rounds)

    @property
    def draft_time_s(self) -> float:
        return sum(r.draft_time_s for r in self.rounds)

    @property
    def verify_time_s(self) -> float:
        return sum(r.verify_time_s for r in self.rounds)

    @property
    def tokens_per_s(self) -> float:
        return len(self.token_ids) / self.wall_time_s if self.wall_time_s > 0 else 0.0

    def stats_dict(self) -> dict:
        """The stable statistics keys of `diffspec generate --json` (other tools read them)."""
        return {
            "rounds": self.num_rounds,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "target_forward_passes": self.target_forward_passes,
            "drafter_forward_passes": self.drafter_forward_passes,
            "wall_time_s": round(self.wall_time_s, 4),
            "tokens_per_s": round(self.tokens_per_s, 3),
            "draft_time_s": round(self.draft_time_s, 4),
            "verify_time_s": round(self.verify_time_s, 4),
            "prefill_time_s": round(self.prefill_time_s, 4),
            "speculation_off_rounds": self.speculation_off_rounds,
            "hidden_state_rounds": self.hidden_state_rounds,
            "draft_length_histogram": {str(k): v for k, v in self.draft_length_histogram.items()},
            "finish_reason": self.finish_reason,
            "notes": list(self.notes),
        }

    def to_dict(self) -> dict:
        return {"text": self.text, "token_ids": list(self.token_ids),
                "prompt_token_ids": list(self.prompt_token_ids), "stats": self.stats_dict()}


def draft_length_histogram(rounds) -> dict:
    """{k: rounds that verified k drafted tokens}, sorted by k."""
    hist: dict = {}
    for r in rounds:
        hist[r.drafted] = hist.get(r.drafted, 0) + 1
    return dict(sorted(hist.items()))


def format_histogram(hist: dict) -> str:
    """{k: rounds} (int or str keys) -> 'k0:12 k3:4' ('-' when empty): the stats line's and the bench's form."""
    return " ".join(f"k{k}:{n}" for k, n in sorted(hist.items(), key=lambda kv: int(kv[0]))) or "-"
