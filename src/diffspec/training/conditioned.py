"""The target-conditioned drafter's training pieces beside the batched step (training/anchored.py):
initialisation from the target, the reduced draft vocabulary, and the learning-rate schedule.

Objective (DFlash): random anchors a per sequence; block [token a, mask x (B-1)] sees the target's
features of positions strictly before a and its own block; slot k is labelled with the target's own
choice at a+k; CE through the frozen, shared LM head, weighted exp(-(k-1)/decay).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from ..defaults import FC_INITS  # noqa: F401 (training.conditioned.FC_INITS as before)
from ..drafters.conditioned import ConditionedDraftModel


def init_from_target(model: ConditionedDraftModel, target_model) -> int:
    """Copy matching tensors of the target's first decoder layers and final norm. -> tensors copied."""
    tgt = dict(target_model.named_parameters())
    copied = 0
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for name, p in layer.named_parameters():
                src = tgt.get(f"model.layers.{i}.{name}")
                if src is not None and src.shape == p.shape:
                    p.copy_(src.to(p.dtype))
                    copied += 1
        src = tgt.get("model.norm.weight")
        if src is not None and src.shape == model.norm.weight.shape:
            model.norm.weight.copy_(src.to(model.norm.weight.dtype))
            copied += 1
    return copied


def pass_lowest_layer_through(model: ConditionedDraftModel) -> int:
    """`fc` (target features of several layers, concatenated -> the width) set to pass the features of the
    lowest target layer through unchanged, the other layers' weights zero (they still get gradients and
    learn). With layers copied from the target's first ones (init_from_target), the drafter's context
    keys and values then start from a residual stream those layers read, instead of from a random
    projection that training must first undo. -> the index of the layer passed through."""
    h = model.cfg.hidden_size
    ids = list(model.cfg.target_layer_ids)
    lowest = ids.index(min(ids))
    with torch.no_grad():
        model.fc.weight.zero_()
        model.fc.weight[:, lowest * h:(lowest + 1) * h].copy_(torch.eye(h, dtype=model.fc.weight.dtype))
    return ids[lowest]


def response_token_counts(sequences: Sequence[tuple], vocab_size: int) -> torch.Tensor:
    """How often each token occurs in the responses of [(ids, prompt_len)] -> [vocab_size] int64."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, prompt_len in sequences:
        counts += torch.bincount(ids[prompt_len:].clamp(max=vocab_size - 1), minlength=vocab_size)
    return counts


def draft_vocab_coverage(counts: torch.Tensor, ids: torch.Tensor) -> float:
    """The share of response tokens (counts from response_token_counts) that the draft vocabulary `ids` holds."""
    return float(counts[ids].sum() / counts.sum().clamp(min=1))


def choose_draft_vocab(sequences: Sequence[tuple], size: int, vocab_size: int, always: Sequence[int] = ()) -> tuple:
    """The `size` tokens the target emits most often in its own answers [(ids, prompt_len)] (plus
    `always`, e.g. the stop tokens). -> (sorted ids [size], share of response tokens they cover)."""
    counts = response_token_counts(sequences, vocab_size)
    boosted = counts.clone()
    for t in always:
        if 0 <= t < vocab_size:
            boosted[t] = counts.max() + 1
    top = torch.topk(boosted, min(size, vocab_size)).indices
    return top.sort().values, draft_vocab_coverage(counts, top)


def lr_at(progress: float, lr: float, warmup_fraction: float = 0.04) -> float:
    """Linear warm-up over the first warmup_fraction of the budget, then cosine down to 10%."""
    if progress < warmup_fraction:
        return lr * max(0.05, progress / warmup_fraction)
    x = min(1.0, (progress - warmup_fraction) / max(1e-9, 1 - warmup_fraction))
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * x)))
