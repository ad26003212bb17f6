"""Training a standalone block-diffusion drafter (Fast-dLLM v2 style) for a target.

The body is the target's own architecture with fewer layers, initialised from the target (token
embeddings, LM head, evenly spaced layers, final norm) plus one extra embedding row: the mask.

Objective, all blocks of all sequences of a batch in one pass: the input is [clean sequence ; noisy sequence].
Clean tokens attend block-causally to clean tokens (what the drafter's cache of finished blocks
holds at inference). Noisy block b attends to the clean blocks before b and to itself
(bidirectionally). In each noisy block a random prefix stays visible (the context's partial block
at inference) and the rest is masked: entirely (one-step drafting, the FailFast setting) or at a
random ratio (the state of later denoising steps). Logits are shifted like Fast-dLLM v2: the
token at i is predicted from position i-1 (for a block's first position, the clean copy's last
position of the previous block, i.e. the cached boundary logits). Labels are the target's own
next-token choices (`objective="target"`) or the corpus tokens. With a reduced draft vocabulary the
head's rows for those tokens alone make the logits (as in drafting) and other labels are not trained.
"""

from __future__ import annotations

import copy
import random

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import GQA_SDPA
from .batches import draft_index


def make_block_body(target_model, layers: int):
    """Target architecture, `layers` layers, vocabulary + 1 (mask id = target vocab size). -> (model, mask id)."""
    cfg = copy.deepcopy(target_model.config)
    if cfg._attn_implementation == GQA_SDPA:
        cfg._attn_implementation = "sdpa"  # the target's inference-only attention (attention.py) stays with it
    n_target = cfg.num_hidden_layers
    vocab = target_model.get_output_embeddings().weight.shape[0]
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = list(cfg.layer_types)[:layers]
    cfg.vocab_size = vocab + 1
    model = type(target_model)(cfg).to(next(target_model.parameters()).dtype)
    pick = [round(i * (n_target - 1) / max(1, layers - 1)) for i in range(layers)] if layers > 1 else [0]
    src = dict(target_model.named_parameters())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".layers." in name:
                head, rest = name.split(".layers.", 1)
                idx, tail = rest.split(".", 1)
                s = src.get(f"{head}.layers.{pick[int(idx)]}.{tail}")
            else:
                s = src.get(name)
            if s is None:
                continue
            if s.shape == p.shape:
                p.copy_(s)
            elif s.shape[0] == vocab and p.shape[0] == vocab + 1:  # embedding / head: mask row = mean row
                p[:vocab].copy_(s)
                p[vocab].copy_(s.mean(0))
    return model.eval(), vocab


def noisy_copy(x: torch.Tensor, block: int, mask_id: int, rng: random.Random) -> tuple:
    """x [T] (T a multiple of block) -> (y [T] with masks, masked [T] bool), on x's device (the
    mask is drawn on the CPU: element-wise writes to a GPU tensor would each be a kernel launch)."""
    y = x.clone()
    masked = torch.zeros(x.shape, dtype=torch.bool)
    for s in range(0, x.shape[0], block):
        keep = rng.randrange(block)                                 # visible prefix of this block
        ratio = 1.0 if rng.random() < 0.5 else rng.uniform(0.1, 1.0)
        for i in range(s + keep, s + block):
            if i > 0 and (ratio >= 1.0 or rng.random() < ratio):
                masked[i] = True
        if not masked[s + keep: s + block].any() and s + keep > 0:
            masked[s + keep] = True
    masked = masked.to(x.device)
    y[masked] = mask_id
    return y, masked


def two_copy_mask(T: int, block: int, device="cpu") -> torch.Tensor:
    """[1, 1, 2T, 2T] bool for [clean ; noisy] (see the module docstring)."""
    b = torch.arange(T, device=device) // block
    clean_clean = b[None, :] <= b[:, None]
    noisy_clean = b[None, :] < b[:, None]
    noisy_noisy = b[None, :] == b[:, None]
    top = torch.cat([clean_clean, torch.zeros(T, T, dtype=torch.bool, device=device)], 1)
    bottom = torch.cat([noisy_clean, noisy_noisy], 1)
    return torch.cat([top, bottom], 0)[None, None]


class BlockDiffusionLoss(nn.Module):
    """The block drafter's training forward over a batch (a module, so DistributedDataParallel can wrap
    it): [clean ; noisy] copies of every sequence through the body with the two-copy mask, CE at every
    masked response position. -> (sum of CE, number of supervised positions, slots, slot-1 correct,
    slot-1 count): slot 1 is a block's first masked position with the rest of its block masked too
    (the token a draft proposes first)."""

    def __init__(self, body, block_size: int, objective: str = "target", draft_token_ids=None):
        super().__init__()
        self.body, self.block_size, self.objective = body, block_size, objective
        # a reduced draft vocabulary: the head's rows for these ids only; labels outside it are not trained
        self.draft_token_ids = None if draft_token_ids is None else torch.as_tensor(draft_token_ids, dtype=torch.long)

    def forward(self, clean: torch.Tensor, noisy: torch.Tensor, masked: torch.Tensor, lengths: torch.Tensor,
                first_supervised: torch.Tensor, target_next: torch.Tensor) -> tuple:
        N, T = clean.shape
        B, dev = self.block_size, clean.device
        ids = torch.cat([clean, noisy], 1)
        pos = torch.arange(T, device=dev).repeat(2)[None].expand(N, -1)
        mask = two_copy_mask(T, B, dev).expand(N, -1, -1, -1)
        hidden = self.body.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        idx = torch.arange(T, device=dev)[None].expand(N, -1)
        sup = masked & (idx >= first_supervised.clamp(min=1)[:, None]) & (idx < lengths[:, None])
        # slot 1: the first masked position of its block, the rest of the block masked as well (decided before
        # a draft vocabulary drops labels, so a dropped first position never promotes the next one to slot 1)
        tail_masked = masked.view(N, -1, B).flip(2).long().cumprod(2).flip(2).view(N, T).bool()
        slot1 = sup & (sup.view(N, -1, B).long().cumsum(2).view(N, T) == 1) & tail_masked
        rows, cols = sup.nonzero(as_tuple=True)
        source = torch.where(cols % B == 0, cols - 1, T + cols - 1)        # shifted: row i-1 predicts token i
        labels = target_next[rows, cols - 1] if self.objective == "target" else clean[rows, cols]
        if self.draft_token_ids is None:
            logits = self.body.lm_head(hidden[rows, source])
        else:  # as the drafter drafts: the head's draft-vocabulary rows; other labels cannot be drafted
            ids = self.draft_token_ids.to(dev)
            index_of = draft_index(ids, self.body.lm_head.weight.shape[0])
            keep = index_of[labels] >= 0
            sup[rows[~keep], cols[~keep]] = False
            rows, cols, source, labels = rows[keep], cols[keep], source[keep], index_of[labels[keep]]
            head = self.body.lm_head
            logits = F.linear(hidden[rows, source], head.weight[ids], None if head.bias is None else head.bias[ids])
        ce = F.cross_entropy(logits.float(), labels, reduction="sum")
        first = slot1[rows, cols]
        correct = (logits.argmax(-1) == labels) & first
        n = sup.sum()
        return ce, n.to(ce.dtype), n, correct.sum(), first.sum()


def noise_batch(clean: torch.Tensor, block: int, mask_id: int, seeds) -> tuple:
    """Noisy copies of clean [N, T] (T a multiple of block), one seeded random.Random per row, so a row's
    noise depends only on its seed (data-parallel ranks draw what one process draws). -> (noisy, masked)."""
    rows = [noisy_copy(clean[n], block, mask_id, random.Random(int(s))) for n, s in enumerate(seeds)]
    return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
