"""An autoregressive draft model: any causal LM that shares the target's tokenizer.

Drafts one token per forward pass on its own KV cache. Greedy requests draft the argmax (one-hot
q); sampling requests draw from q = the drafter's distribution under the request's temperature,
top-k and top-p, and hand q to rejection sampling. Confidence = q(drafted token) (the softmax
probability at temperature 1 when greedy), which is what FailFast reads.
"""

from __future__ import annotations

from typing import Optional

import torch

from .. import llama_pass
from ..cache import cache_length, common_prefix_length, earliest_length, new_cache, truncate_cache
from ..policies.base import LengthPolicy
from ..types import Draft, SamplingParams
from .base import Drafter, DrafterCapabilities, DraftBuilder, align_logits_to_vocab, draw_tokens
from .denoising import logits_of_rows


class AutoregressiveDrafter(Drafter):
    capabilities = DrafterCapabilities(gives_probabilities=True, needs_target_hidden_states=False,
                                       keeps_own_cache=True)

    def __init__(self, model, tokenizer=None, name: str = "ar"):
        from ..target import tokenizer_fingerprint

        self.model = model.eval()
        self.name = name
        self.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
        self.device = next(model.parameters()).device
        self.vocab_size: Optional[int] = None  # the target's, set by attach
        self._cache = new_cache(model.config)
        self._cached_ids: list = []  # the tokens whose keys/values are in _cache, in order
        self._direct: Optional[llama_pass.LlamaPass] = None  # its passes without transformers' Python (attach)

    @classmethod
    def load(cls, spec: str, dtype: torch.dtype = torch.float32, device: str = "cpu") -> "AutoregressiveDrafter":
        from ..models import load_model_and_tokenizer

        model, tok = load_model_and_tokenizer(spec, dtype=dtype, device=device)
        return cls(model, tok, name=f"ar:{spec}")

    def attach(self, target) -> None:
        super().attach(target)
        self.vocab_size = target.vocab_size
        self._direct = llama_pass.for_drafter(self.model, target)  # measured kernels: bitwise the model's, fewer calls

    def begin(self, prompt_ids: torch.Tensor) -> None:
        self._cache = new_cache(self.model.config)
        self._cached_ids = []

    @torch.inference_mode()
    def _forward(self, tokens: list) -> torch.Tensor:
        """Append tokens to the drafter cache; return the logits after the last one [V_target]."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        run = self._direct if self._direct is not None and self._direct.runs_on(self._cache) else self.model
        # the head on the last row only (a long prompt's other rows would cost [n, V] of logits)
        logits = logits_of_rows(run, 1, input_ids=ids, past_key_values=self._cache, use_cache=True)[-1]
        self._cached_ids.extend(tokens)
        return align_logits_to_vocab(logits, self.vocab_size or logits.shape[-1])

    def _sync_cache(self, context: list) -> list:
        """Keep the longest prefix of the cache that matches context; return tokens still to feed."""
        common = min(common_prefix_length(self._cached_ids, context), len(context) - 1)  # feed >= 1 token
        if common < earliest_length(self._cache):  # a sliding-window body no longer holds that far back
            self.begin(None)
            common = 0
        truncate_cache(self._cache, common)
        del self._cached_ids[common:]
        assert cache_length(self._cache) == common
        return context[common:]

    def propose(self, context: torch.Tensor, policy: LengthPolicy, limit: int,
                sampling: SamplingParams, generator: Optional[torch.Generator]) -> Draft:
        builder = DraftBuilder()
        passes = 0
        pending = self._sync_cache(context.tolist())
        for k in builder.increments(policy, limit):
            for _ in range(k):
                drawn = draw_tokens(self._forward(pending).unsqueeze(0), sampling, generator)
                passes += 1
                token = int(drawn.tokens[0])
                builder.add(token, float(drawn.token_prob[0]), None if drawn.q is None else drawn.q[0])
                pending = [token]
        return builder.build(passes, context.device)
