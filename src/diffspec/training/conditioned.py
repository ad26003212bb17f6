"""Training the target-conditioned block drafter (DFlash recipe, adapted to a CPU budget).

Per step: a few sequences; in each, many random anchor positions a. Block i's input is
[token a, mask x (B-1)] at positions a..a+B-1; it attends to the target's features of positions
STRICTLY before a (at inference the anchor's own features do not exist yet) and bidirectionally
to its own block, never to other blocks. Slot k (1..B-1) is labelled with the token at a+k:
`objective="target"` uses the target's own choice there (target_next[a+k-1]: alignment),
`objective="corpus"` the data token. Cross-entropy through the frozen, shared LM head, weighted
exp(-(k-1)/gamma) so early slots (which gate acceptance of the later ones) count most.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from ..drafters.conditioned import ConditionedDraftModel
from .features import SequenceFeatures


@dataclass(frozen=True)
class ConditionedTrainConfig:
    anchors_per_sequence: int = 32
    sequences_per_step: int = 2
    lr: float = 6e-4
    warmup_fraction: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    slot_decay: float = 4.0          # gamma of the exp(-(k-1)/gamma) slot weights
    objective: str = "target"        # "target" (alignment) | "corpus"


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


def choose_draft_vocab(sequences: Sequence[SequenceFeatures], size: int, always: Sequence[int] = ()) -> tuple:
    """The `size` target tokens the target emits most often in the training data (plus `always`).
    -> (sorted ids [size], share of supervised labels they cover)."""
    counts = torch.zeros(int(max(int(s.target_next.max()) for s in sequences)) + 1, dtype=torch.long)
    for s in sequences:
        counts += torch.bincount(s.target_next[max(0, s.first_supervised - 1):].cpu(), minlength=counts.shape[0])
    for t in always:
        if t < counts.shape[0]:
            counts[t] = counts.max() + 1
    top = torch.topk(counts, min(size, counts.shape[0])).indices
    return top.sort().values, float(counts[top].sum() / counts.sum().clamp(min=1))


def valid_anchors(seq: SequenceFeatures) -> range:
    """Anchors a whose next token is supervised (a + 1 >= first_supervised) and exists."""
    return range(max(0, seq.first_supervised - 1), seq.tokens.shape[0] - 1)


def block_batch(model: ConditionedDraftModel, seq: SequenceFeatures, anchors: Sequence[int], embed) -> tuple:
    """Forward the blocks of `anchors` for one sequence -> drafter hidden states [A, B, h]."""
    cfg = model.cfg
    B = cfg.block_size
    dtype = next(model.parameters()).dtype
    dev = seq.tokens.device
    ctx_len = max(anchors)  # features of positions < max anchor are all any block may see
    anchors_t = torch.tensor(anchors, device=dev)
    ctx_pos = torch.arange(ctx_len, device=dev)
    kv = model.context_keys_values(seq.hidden[:ctx_len].to(dtype), ctx_pos)
    block_tokens = torch.full((len(anchors), B), cfg.mask_token_id, dtype=torch.long, device=dev)
    block_tokens[:, 0] = seq.tokens[anchors_t]
    positions = (anchors_t[:, None] + torch.arange(B, device=dev)[None, :]).reshape(-1)
    sees_ctx = ctx_pos[None, :] < anchors_t.repeat_interleave(B)[:, None]          # strictly before the anchor
    block_id = torch.arange(len(anchors), device=dev).repeat_interleave(B)
    sees_block = block_id[:, None] == block_id[None, :]                             # own block only, both ways
    mask = torch.cat([sees_ctx, sees_block], dim=1)
    hidden = model(embed(block_tokens.reshape(-1)).to(dtype), positions, kv, attn_mask=mask)
    return hidden.view(len(anchors), B, -1), anchors_t


def block_loss(model, seq: SequenceFeatures, anchors: Sequence[int], embed, head_weight: torch.Tensor,
               objective: str, slot_decay: float) -> tuple:
    """Weighted CE over slots 1..B-1 -> (loss, number of supervised slots, slot-1 accuracy)."""
    B = model.cfg.block_size
    hidden, anchors_t = block_batch(model, seq, anchors, embed)
    T = seq.tokens.shape[0]
    dev = anchors_t.device
    pos = anchors_t[:, None] + torch.arange(1, B, device=dev)[None, :]              # [A, B-1] predicted positions
    valid = pos < T
    pos_c = pos.clamp(max=T - 1)
    labels = seq.target_next[pos_c - 1] if objective == "target" else seq.tokens[pos_c]
    if model.cfg.draft_vocab:  # labels as indices into the draft vocabulary; others cannot be drafted
        index_of = torch.full((head_weight.shape[0],), -1, dtype=torch.long, device=dev)  # target id -> draft index
        index_of[model.draft_token_ids] = torch.arange(model.cfg.draft_vocab, device=dev)
        labels = index_of[labels]
        valid = valid & (labels >= 0)
        labels = labels.clamp(min=0)
    logits = hidden[:, 1:].float() @ model.head_weight(head_weight).float().T       # [A, B-1, V or draft vocab]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(pos)
    w = torch.exp(-torch.arange(B - 1, dtype=torch.float32, device=dev) / slot_decay)[None, :] * valid
    loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
    acc = (logits[:, 0].argmax(-1) == labels[:, 0]).float().mean()
    return loss, int(valid.sum()), float(acc)


@torch.no_grad()
def held_out_acceptance(model, sequences: Sequence[SequenceFeatures], embed, head_weight, max_anchors: int = 64,
                        seed: int = 0) -> float:
    """Mean accepted length (bonus counted) of one-block greedy drafts on target-generated sequences:
    1 + the number of leading slots whose argmax equals the target's own next token."""
    rng = random.Random(seed)
    B = model.cfg.block_size
    total, count = 0.0, 0
    for seq in sequences:
        cand = [a for a in valid_anchors(seq) if a >= 1 and a + B - 1 < seq.tokens.shape[0]]
        if not cand:
            continue
        anchors = sorted(rng.sample(cand, min(max_anchors, len(cand))))
        hidden, anchors_t = block_batch(model, seq, anchors, embed)
        draft = model.to_target_ids((hidden[:, 1:].float() @ model.head_weight(head_weight).float().T).argmax(-1))
        pos = anchors_t[:, None] + torch.arange(1, B, device=anchors_t.device)[None, :]
        truth = seq.target_next[pos - 1]
        lead = torch.cumprod((draft == truth).long(), dim=1).sum(1)
        total += float((lead + 1).sum())
        count += len(anchors)
    return total / max(1, count)


def lr_at(progress: float, cfg: ConditionedTrainConfig) -> float:
    """Linear warm-up over the first warmup_fraction of the budget, then cosine down to 10%."""
    if progress < cfg.warmup_fraction:
        return cfg.lr * max(0.05, progress / cfg.warmup_fraction)
    x = min(1.0, (progress - cfg.warmup_fraction) / max(1e-9, 1 - cfg.warmup_fraction))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * x)))


def sample_step(rng: random.Random, data: Sequence[SequenceFeatures], cfg: ConditionedTrainConfig) -> list:
    """(sequence, anchors) pairs for one optimizer step."""
    out = []
    for _ in range(cfg.sequences_per_step):
        seq = data[rng.randrange(len(data))]
        cand = list(valid_anchors(seq))
        if cand:
            out.append((seq, sorted(rng.sample(cand, min(cfg.anchors_per_sequence, len(cand))))))
    return out
