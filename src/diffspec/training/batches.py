"""Batches for the online trainer: which sequences form a step, padded tensors, the target's
features for them, and the anchors each sequence trains on.

Everything here is a pure function of (seed, epoch, step, sequence index): a data-parallel run
whose ranks each take a slice of the global batch draws exactly the anchors a single process
would, so the two runs compute the same loss (tested with two gloo processes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class PaddedBatch:
    """Right-padded token ids of a batch of sequences (causal passes are unaffected by the padding)."""
    tokens: torch.Tensor            # [N, L] int64
    lengths: torch.Tensor           # [N] int64
    first_supervised: torch.Tensor  # [N] int64: index of the first response token (the prompt is never a label)
    index: torch.Tensor             # [N] int64: the sequences' indices in the training set (seeds their anchors)

    def to(self, device) -> "PaddedBatch":
        return PaddedBatch(*(t.to(device) for t in (self.tokens, self.lengths, self.first_supervised, self.index)))


def pad_batch(sequences: Sequence[tuple], index: Sequence[int], pad_id: int) -> PaddedBatch:
    """[(ids [T] int64, prompt_len)] -> PaddedBatch."""
    width = max(int(ids.shape[0]) for ids, _ in sequences)
    tokens = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for row, (ids, _) in enumerate(sequences):
        tokens[row, : ids.shape[0]] = ids
    return PaddedBatch(tokens, torch.tensor([int(ids.shape[0]) for ids, _ in sequences]),
                       torch.tensor([int(p) for _, p in sequences]), torch.tensor(list(index), dtype=torch.long))


def epoch_batches(lengths: Sequence[int], batch_sequences: int, seed: int, epoch: int, window: int = 32) -> list:
    """The global batches of one epoch: a seeded permutation of all sequences, sorted by length within
    windows of `window` batches (less padding), the batches of a window shuffled again. -> [[index, ...]]."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(len(lengths), generator=g).tolist()
    span = batch_sequences * window
    batches = []
    for start in range(0, len(order), span):
        chunk = sorted(order[start:start + span], key=lambda i: lengths[i])
        group = [chunk[i:i + batch_sequences] for i in range(0, len(chunk), batch_sequences)]
        perm = torch.randperm(len(group), generator=g).tolist()
        batches.extend(group[i] for i in perm)
    return batches


def rank_share(batch: Sequence[int], rank: int, world: int) -> list:
    """The part of a global batch that rank `rank` of `world` computes."""
    return list(batch[rank::world])


@torch.no_grad()
def target_features(target_model, batch: PaddedBatch, layer_ids: Optional[Sequence[int]], top_k: int = 0,
                    draft_ids: Optional[torch.Tensor] = None) -> tuple:
    """One teacher-forced target pass over the batch -> (hidden [N, L, len(layer_ids) * h] of the chosen
    layers, or None without layer_ids; target_next [N, L]: the target's argmax at each position).

    With top_k > 0 a third item, the target's own distributions for self-distillation: (probs [N, L, K],
    index [N, L, K]) = the K most likely tokens at each position and their probabilities renormalised
    over those K, restricted first to `draft_ids` (a reduced draft vocabulary; index then counts in it)."""
    att = (torch.arange(batch.tokens.shape[1], device=batch.tokens.device)[None, :] < batch.lengths[:, None]).long()
    out = target_model(input_ids=batch.tokens, attention_mask=att, output_hidden_states=bool(layer_ids), use_cache=False)
    hidden = torch.cat([out.hidden_states[l + 1] for l in layer_ids], dim=-1) if layer_ids else None
    if not top_k:
        return hidden, out.logits.argmax(-1)
    return hidden, out.logits.argmax(-1), soft_labels(out.logits, top_k, draft_ids)


def soft_labels(logits: torch.Tensor, top_k: int, draft_ids: Optional[torch.Tensor] = None) -> tuple:
    """logits [..., V] -> (probs [..., K] float32 summing to 1, index [..., K] int64) of the top K, within
    `draft_ids` when given (index then points into draft_ids)."""
    scores = logits if draft_ids is None else logits.index_select(-1, draft_ids)  # no full-width float copy
    values, index = scores.topk(min(top_k, scores.shape[-1]), dim=-1)
    return torch.softmax(values.float(), dim=-1), index


def draft_index(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[vocab_size] int64: each token's index in the reduced draft vocabulary `draft_ids`, -1 for a token
    outside it (a label the drafter cannot draft)."""
    index = torch.full((vocab_size,), -1, dtype=torch.long, device=draft_ids.device)
    index[draft_ids] = torch.arange(draft_ids.shape[0], device=draft_ids.device)
    return index


def sample_anchors(batch: PaddedBatch, max_anchors: int, seed: int, epoch: int) -> tuple:
    """Up to `max_anchors` distinct anchor positions per sequence, drawn without repetition from those
    whose next token is a response token (a + 1 >= first_supervised, a + 1 < length), sorted.
    -> (anchors [N, A] int64, valid [N, A] bool); invalid entries are 0 and carry no weight."""
    rows = []
    for n in range(batch.tokens.shape[0]):
        lo = max(0, int(batch.first_supervised[n]) - 1)
        hi = int(batch.lengths[n]) - 1                  # a + 1 must exist
        count = max(0, hi - lo)
        g = torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 2_000_029 + int(batch.index[n]))
        pick = torch.randperm(count, generator=g)[:max_anchors] + lo if count else torch.zeros(0, dtype=torch.long)
        rows.append(pick.sort().values)
    width = max(1, max(r.shape[0] for r in rows))
    anchors = torch.zeros(len(rows), width, dtype=torch.long)
    valid = torch.zeros(len(rows), width, dtype=torch.bool)
    for n, r in enumerate(rows):
        anchors[n, : r.shape[0]] = r
        valid[n, : r.shape[0]] = True
    return anchors.to(batch.tokens.device), valid.to(batch.tokens.device)


def slot_weights(block_size: int, decay: float, device=None) -> torch.Tensor:
    """exp(-(k-1)/decay) for slots k = 1..B-1: early slots gate the acceptance of later ones."""
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32, device=device) / decay)
