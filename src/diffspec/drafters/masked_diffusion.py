"""Masked-diffusion drafter with T denoising steps (SpecDiff; Dream-style models).

Append gamma mask tokens to the context and run T denoising steps over a fully bidirectional
model, unmasking the ceil(gamma / T) most confident masked positions per step. With a policy that
widens the window (FailFast), each increment appends its own mask tokens and gets its own T steps,
the tokens already drafted staying fixed. Bidirectional attention means the context's keys depend
on the masks, so there is no reusable cache: every step re-reads the context (the last
`context_window` tokens of it).

For rejection sampling, q of a token is the drafter's distribution at the step that unmasked it;
a token unmasked at an earlier step than some token to its left is judged with one-hot q instead,
position by position (exact; the argument is in denoising.py). Greedy drafts are argmax (one-hot q).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import llama_pass
from ..policies.base import LengthPolicy
from ..types import Draft, SamplingParams
from .base import Drafter, DrafterCapabilities, DraftBuilder, align_logits_to_vocab, draw_tokens
from .denoising import full_mask, judge_out_of_order_one_hot, logits_of_rows, select_top


@dataclass(frozen=True)
class MaskedDiffusionConfig:
    mask_token_id: int
    steps: int = 4            # T denoising steps per increment
    logit_shift: bool = True  # Dream: position i predicted from the logits at i-1
    context_window: int = 512

    def __post_init__(self) -> None:
        if self.steps < 1 or self.context_window < 1:
            raise ValueError("steps and context_window must be >= 1")


class MaskedDiffusionDrafter(Drafter):
    default_gamma = 16  # SpecDiff: 16 masks, T = 4 steps
    capabilities = DrafterCapabilities(gives_probabilities=True, needs_target_hidden_states=False,
                                       keeps_own_cache=False)

    def __init__(self, model, config: MaskedDiffusionConfig, tokenizer_fingerprint: Optional[str] = None,
                 name: str = "masked-diffusion"):
        self.model = model.eval()
        self.config = config
        self.name = name
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.device = next(model.parameters()).device
        self.vocab_size: Optional[int] = None
        self._direct: Optional[llama_pass.LlamaPass] = None  # its passes without transformers' Python (attach)

    def attach(self, target) -> None:
        super().attach(target)
        self.vocab_size = target.vocab_size
        self._direct = llama_pass.for_drafter(self.model, target)  # measured kernels: bitwise the model's, fewer calls

    @torch.inference_mode()
    def _logits(self, seq: list, first_position: int, rows: list) -> torch.Tensor:
        """One pass over `seq`; logits only for `rows` (the prediction rows of masked positions):
        the output head is not applied to the context rows nobody reads."""
        ids = torch.tensor([seq], dtype=torch.long, device=self.device)
        pos = torch.arange(first_position, first_position + len(seq), device=self.device).unsqueeze(0)
        mask = full_mask(len(seq), len(seq), self.device)
        run = self._direct if self._direct is not None and self._direct.runs_on(None) else self.model
        logits = logits_of_rows(run, rows, input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False)
        return align_logits_to_vocab(logits, self.vocab_size or logits.shape[-1])

    def propose(self, context: torch.Tensor, policy: LengthPolicy, limit: int,
                sampling: SamplingParams, generator: Optional[torch.Generator]) -> Draft:
        cfg, MASK = self.config, self.config.mask_token_id
        ids = context.tolist()
        first = max(0, len(ids) - cfg.context_window)
        seq = ids[first:]
        n_ctx = len(seq)
        builder, steps, passes, step = DraftBuilder(), [], 0, 0
        for k in builder.increments(policy, limit):
            lo = len(builder)
            seq += [MASK] * k
            per_step = math.ceil(k / cfg.steps)
            found: dict = {}
            while len(found) < k:
                masked = [i for i in range(n_ctx + lo, n_ctx + lo + k) if seq[i] == MASK]
                rows = self._logits(seq, first, [i - 1 if cfg.logit_shift else i for i in masked])
                passes += 1
                step += 1
                drawn = draw_tokens(rows, sampling, generator)
                conf, tokens, q = drawn.max_prob, drawn.tokens, drawn.q
                for j in select_top(conf, per_step).tolist():
                    seq[masked[j]] = int(tokens[j])
                    found[masked[j]] = (int(tokens[j]), float(conf[j]), None if q is None else q[j], step)
            for i in range(n_ctx + lo, n_ctx + lo + k):
                token, c, q_row, s = found[i]
                builder.add(token, c, q_row)
                steps.append(s)
        draft = builder.build(passes, context.device)
        return judge_out_of_order_one_hot(draft, steps)  # per position: see denoising.py

    def describe(self) -> str:
        return f"{self.name}(T={self.config.steps}, {'shifted' if self.config.logit_shift else 'unshifted'})"
