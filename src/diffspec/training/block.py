"""Training a standalone block-diffusion drafter (Fast-dLLM v2 style) for a target.

The body is the target's own architecture with fewer layers, initialised from the target (token
embeddings, LM head, evenly spaced layers, final norm) plus one extra embedding row: the mask.

Objective, all blocks of a sequence in parallel: the input is [clean sequence ; noisy sequence].
Clean tokens attend block-causally to clean tokens (what the drafter's cache of finished blocks
holds at inference). Noisy block b attends to the clean blocks before b and to itself
(bidirectionally). In each noisy block a random prefix stays visible (the context's partial block
at inference) and the rest is masked: entirely (one-step drafting, the FailFast setting) or at a
random ratio (the state of later denoising steps). Logits are shifted like Fast-dLLM v2: the
token at i is predicted from position i-1 (for a block's first position, the clean copy's last
position of the previous block, i.e. the cached boundary logits). Labels are the target's own
next-token choices (`objective="target"`) or the corpus tokens.
"""

from __future__ import annotations

import copy
import random
from typing import Sequence

import torch
import torch.nn.functional as F

from .features import SequenceFeatures


def make_block_body(target_model, layers: int):
    """Target architecture, `layers` layers, vocabulary + 1 (mask id = target vocab size). -> (model, mask id)."""
    cfg = copy.deepcopy(target_model.config)
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


def block_diffusion_loss(model, seq: SequenceFeatures, block: int, mask_id: int, objective: str,
                         rng: random.Random, max_len: int = 512) -> tuple:
    """-> (mean CE over masked positions, number of supervised positions, slot-1 accuracy: the share of
    blocks whose first masked position, with the rest of the block masked too (the token a draft
    proposes first), has the label as its argmax)."""
    T = min(seq.tokens.shape[0], max_len) // block * block
    if T < block:
        return None, 0, 0.0
    x = seq.tokens[:T]
    y, masked = noisy_copy(x, block, mask_id, rng)
    ids = torch.cat([x, y])[None]
    pos = torch.arange(T, device=x.device).repeat(2)[None]
    hidden = model.model(input_ids=ids, attention_mask=two_copy_mask(T, block, x.device),
                         position_ids=pos).last_hidden_state[0]
    idx = masked.nonzero().flatten()
    idx = idx[idx >= max(1, seq.first_supervised)]
    if idx.numel() == 0:
        return None, 0, 0.0
    at_block_start = idx % block == 0
    source = torch.where(at_block_start, idx - 1, T + idx - 1)        # shifted: row i-1 predicts token i
    labels = seq.target_next[idx - 1] if objective == "target" else x[idx]
    logits = model.lm_head(hidden[source])
    blocks = idx // block                                              # idx is sorted: a block's first row comes first
    first = torch.cat([blocks.new_ones(1, dtype=torch.bool), blocks[1:] != blocks[:-1]])
    # ... counted where the rest of its block is masked too (what a draft faces: all of it unknown)
    tail_masked = masked.view(-1, block).flip(1).long().cumprod(1).flip(1).flatten().bool()
    first &= tail_masked[idx]
    slot1_acc = float((logits[first].argmax(-1) == labels[first]).float().mean()) if first.any() else 0.0
    return F.cross_entropy(logits.float(), labels), int(idx.numel()), slot1_acc


@torch.no_grad()
def block_held_out_acceptance(drafter, sequences: Sequence[SequenceFeatures], anchors_per_sequence: int = 8,
                              seed: int = 0) -> float:
    """Mean accepted length (bonus counted) of real drafts (one block, greedy) on held-out sequences."""
    from ..policies import FixedPolicy
    from ..types import SamplingParams

    rng = random.Random(seed)
    B = drafter.config.block_size
    total, count = 0.0, 0
    for seq in sequences:
        T = seq.tokens.shape[0]
        cand = list(range(max(1, seq.first_supervised), T - B))
        for a in sorted(rng.sample(cand, min(anchors_per_sequence, len(cand)))):
            drafter.begin(None)
            d = drafter.propose(seq.tokens[: a + 1], FixedPolicy(B - 1), B - 1, SamplingParams(), None)
            truth = seq.target_next[a: a + len(d)].cpu()
            lead = int(torch.cumprod((d.tokens.cpu() == truth).long(), 0).sum()) if len(d) else 0
            total += lead + 1
            count += 1
    return total / max(1, count)
