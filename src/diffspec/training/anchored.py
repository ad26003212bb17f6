"""One drafter forward/backward over every anchor of every sequence in a batch (conditioned kind).

A block for anchor a is [token a, mask x (B-1)] at positions a..a+B-1 (a drafter with lookup hints: prompt
lookup's copy after token a in the slots it covers, drafters/conditioned.py). Its queries see the target's
features of positions STRICTLY before a (at serving time the anchor's own features do not exist
yet) and their own block, bidirectionally; never another block. Rather than one dense mask over
[context ; all blocks] (A*B x (C + A*B), almost all of it False), each layer's attention is computed
in two parts that share one softmax:

    scores = [ q . k_context  (masked to positions < a)  |  q . k_own_block ]   -> softmax -> @ [v_ctx | v_blk]

so the cost is A*B*(C + B) per head instead of A*B*(C + A*B), with the same numbers as the serving
pass (`ConditionedDrafter.block_logits`); the tests hold the two equal in fp64. The valid anchors of
all sequences are packed (`AnchorLayout`): projections, MLPs and the LM head see no padding; only the
context attention's two matmuls run on the padded [N, A] layout.

Slot k (1..B-1) is labelled with the target's own choice at a+k (`target_next[a+k-1]`, objective
"target"), or the data token ("corpus"), or the target's own distribution there ("distill":
cross-entropy against its top-K probabilities, self-distillation as in NVIDIA Model-Optimizer's DFlash
and EAGLE-3; the same minimiser as KL, and more signal per slot than one hard label), weighted
exp(-(k-1)/decay); the loss of a batch is sum(w * CE) / sum(w) over all its slots, so a data-parallel
run can add the parts of its ranks.

Off-path slots. The drafter sees token a and masks; its slot k is accepted when it equals the target's
greedy token after the target's OWN greedy tokens a+1..a+k-1. The target's label at a+k in the data,
`target_next[a+k-1]`, answers a different question whenever the data's tokens a+1..a+k-1 are not that
path (corpus text, sampled answers): it is the target's choice after text the drafter never sees and
the target would not have written. So by default (`greedy_path_only`) slot k is supervised only where
tokens[a+j] == target_next[a+j-1] for every j < k: on the target's own greedy answers that is every slot
(the mask changes nothing), on corpus text it keeps exactly the labels a greedy verification would
check. Slot 1 is always on the path. The "corpus" objective (data tokens as labels) has no such mask.
With a reduced draft vocabulary, a slot whose label the drafter cannot draft ends the path too: a
greedy verification never gets past it, so the slots after it are not labels either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..drafters.conditioned import ConditionedDraftModel, lookup_hint_slots, rotary
from .batches import draft_index, slot_weights


def _heads(x: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    return x.view(x.shape[0], x.shape[1], n_heads, head_dim).transpose(1, 2)     # [N, heads, n, d]


@dataclass(frozen=True)
class AnchorLayout:
    """Where the M valid anchors of a batch sit: packed rows m <-> (sequence n[m], slot a[m]) of the
    padded [N, A] anchor table. Projections, MLPs and the head run on the M packed blocks only; the
    context attention scatters into the padded layout, whose matmuls are a small share of the work."""
    seq: torch.Tensor       # [M] sequence of each packed anchor
    slot: torch.Tensor      # [M] its column in the [N, A] table
    anchor: torch.Tensor    # [M] its position
    rows: int               # N
    width: int              # A


def anchored_attention(attn, x: torch.Tensor, positions: torch.Tensor, ctx: torch.Tensor, layout: AnchorLayout,
                       block_size: int) -> torch.Tensor:
    """attn: a drafters.conditioned.Attention. x [M*B, h] packed block states at positions [M, B];
    ctx [N, C, h] projected target features of positions 0..C-1. Each block sees its sequence's context
    positions < its anchor and its own block. -> [M*B, h].

    The context part's scores [N, kv heads, group * A * B, C] are the one large tensor of a step; they stay in
    the padded layout from the matmul that makes them to the one that reads them (masked in place, shifted by
    the row's max, exponentiated in place), and only their row sums and the product with the values, d wide,
    go to the packed layout. The query heads sharing a key/value head are one matmul's rows (keys and values
    are never repeated per query head). The two parts share one softmax: exp(s - m) / z with m the row's
    max over both parts and z the sum over both. Rows of empty anchor slots see position 0 (finite, never
    read)."""
    cfg = attn.cfg
    B, M, N, A, C = block_size, layout.anchor.shape[0], layout.rows, layout.width, ctx.shape[1]
    H, KV, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    rep = H // KV
    scale = 1.0 / math.sqrt(d)
    q = rotary(attn.q_norm(_heads(attn.q_proj(x).view(M, B, -1), H, d)), positions, cfg.rope_theta) * scale
    k_b = rotary(attn.k_norm(_heads(attn.k_proj(x).view(M, B, -1), KV, d)), positions, cfg.rope_theta)
    v_b = _heads(attn.v_proj(x).view(M, B, -1), KV, d)                                  # [M, KV, B, d]
    ctx_pos = torch.arange(C, device=x.device).expand(N, C)
    k_c = rotary(attn.k_norm(_heads(attn.k_proj(ctx), KV, d)), ctx_pos, cfg.rope_theta)   # [N, KV, C, d]
    v_c = _heads(attn.v_proj(ctx), KV, d)
    q = q.view(M, KV, rep, B, d)                          # head h = g * rep + r reads key/value head g
    soft = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    # block part, packed: [M, KV, rep * B, B]
    s_blk = (q.reshape(M, KV, rep * B, d) @ k_b.transpose(-1, -2)).view(M, KV, rep, B, B).to(soft)
    # context part, padded: [N, KV, rep, A, B, C]
    q_pad = q.new_zeros(N, KV, rep, A, B, d)
    q_pad[layout.seq, :, :, layout.slot] = q
    s_ctx = (q_pad.view(N, KV, rep * A * B, d) @ k_c.transpose(-1, -2)).view(N, KV, rep, A, B, C)
    anchor_pad = torch.ones(N, A, dtype=layout.anchor.dtype, device=x.device)
    anchor_pad[layout.seq, layout.slot] = layout.anchor
    hidden = torch.arange(C, device=x.device) >= anchor_pad[..., None]                  # [N, A, C]: not before a
    s_ctx.masked_fill_(hidden[:, None, None, :, None, :], float("-inf"))               # (matmul saves its inputs)
    with torch.no_grad():  # the shift cancels in exp(s - m) / z: no gradient through it
        top = s_ctx.amax(-1).to(soft)                                                   # [N, KV, rep, A, B]
        top[layout.seq, :, :, layout.slot] = torch.maximum(top[layout.seq, :, :, layout.slot], s_blk.amax(-1))
    e_ctx = s_ctx.to(soft).sub_(top[..., None]).exp_()                                  # in place: one tensor
    e_blk = (s_blk - top[layout.seq, :, :, layout.slot][..., None]).exp_()              # [M, KV, rep, B, B]
    z = e_ctx.sum(-1)[layout.seq, :, :, layout.slot] + e_blk.sum(-1)                  # [M, KV, rep, B]
    o_ctx = (e_ctx.to(v_c.dtype).view(N, KV, rep * A * B, C) @ v_c).view(N, KV, rep, A, B, d)
    o = o_ctx[layout.seq, :, :, layout.slot].to(soft) + (e_blk.to(v_b.dtype) @ v_b[:, :, None]).to(soft)
    out = (o / z[..., None]).to(x.dtype)                                                # [M, KV, rep, B, d]
    return attn.o_proj(out.view(M, H, B, d).transpose(1, 2).reshape(M * B, H * d))


def anchored_block_states(model: ConditionedDraftModel, block_embeddings: torch.Tensor, layout: AnchorLayout,
                          target_hidden: torch.Tensor) -> torch.Tensor:
    """block_embeddings [M, B, h] of the packed blocks; target_hidden [N, C, F] the target's features of
    positions 0..C-1 (C >= every anchor). -> drafter states [M, B, h]."""
    M, B, h = block_embeddings.shape
    ctx = model.project_context(target_hidden)
    positions = layout.anchor[:, None] + torch.arange(B, device=layout.anchor.device)
    x = block_embeddings.reshape(M * B, h)
    for layer in model.layers:
        x = x + anchored_attention(layer.self_attn, layer.input_layernorm(x), positions, ctx, layout, B)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x).view(M, B, h)


def on_greedy_path(data_tokens: torch.Tensor, target_choice: torch.Tensor) -> torch.Tensor:
    """data_tokens [M, B-1]: the data's tokens at a+1..a+B-1 of each block; target_choice [M, B-1]: the
    target's argmax for those positions (given the data before them). -> [M, B-1] bool: slot k is on the
    target's greedy path when the data's tokens a+1..a+k-1 all are the target's own choices."""
    agree = (data_tokens[:, :-1] == target_choice[:, :-1]).long()
    first = torch.ones_like(agree[:, :1])
    return torch.cat([first, agree], 1).cumprod(1).bool()


@dataclass(frozen=True)
class LossParts:
    """Sums over one batch (or one rank's share of it); the loss is weighted_ce / weight."""
    weighted_ce: torch.Tensor    # sum of w * CE over supervised slots (carries the graph)
    weight: torch.Tensor         # sum of w
    slots: torch.Tensor          # number of supervised slots
    slot1_correct: torch.Tensor  # anchors whose slot-1 argmax is its label
    slot1_count: torch.Tensor    # anchors with a supervised slot 1


class AnchoredLoss(nn.Module):
    """The conditioned drafter's training forward (a module, so DistributedDataParallel can wrap it).
    The target's embedding and LM head weights are frozen arguments, never parameters of this module."""

    def __init__(self, model: ConditionedDraftModel, objective: str = "target", slot_decay: float = 7.0,
                 greedy_path_only: bool = True):
        super().__init__()
        self.model, self.objective, self.slot_decay = model, objective, slot_decay
        self.greedy_path_only = greedy_path_only and objective != "corpus"

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor, target_hidden: torch.Tensor,
                target_next: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, embed_weight: torch.Tensor,
                head_weight: torch.Tensor, soft_probs: Optional[torch.Tensor] = None,
                soft_index: Optional[torch.Tensor] = None) -> LossParts:
        """tokens [N, L], lengths [N], target_hidden [N, L, F], target_next [N, L], anchors/valid [N, A];
        objective "distill": soft_probs/soft_index [N, L, K] (batches.soft_labels of the target's logits,
        index into the draft vocabulary when the drafter has one)."""
        model = self.model
        cfg = model.cfg
        B, (N, L) = cfg.block_size, tokens.shape
        dev = tokens.device
        dtype = model.fc.weight.dtype
        seq, slot = valid.nonzero(as_tuple=True)
        layout = AnchorLayout(seq, slot, anchors[seq, slot], N, anchors.shape[1])
        block = torch.full((seq.shape[0], B), cfg.mask_token_id, dtype=torch.long, device=dev)
        block[:, 0] = tokens[seq, layout.anchor]
        if cfg.lookup_hints:  # prompt lookup's copy after each anchor, as the drafter sees it when serving
            block[:, 1:] = lookup_hint_slots(tokens.tolist(), seq.tolist(), layout.anchor.tolist(), B,
                                             cfg.mask_token_id).to(dev)
        C = max(1, int(layout.anchor.max())) if seq.numel() else 1   # features of positions < the last anchor
        hidden = anchored_block_states(model, F.embedding(block, embed_weight).to(dtype), layout,
                                       target_hidden[:, :C].to(dtype))
        pos = layout.anchor[:, None] + torch.arange(1, B, device=dev)                 # [M, B-1] drafted positions
        ok = pos < lengths[seq][:, None]
        flat = pos.clamp(max=L - 1)
        if self.greedy_path_only:
            ok = ok & on_greedy_path(tokens[seq[:, None], flat], target_next[seq[:, None], flat - 1])
        labels = tokens[seq[:, None], flat] if self.objective == "corpus" else target_next[seq[:, None], flat - 1]
        if cfg.draft_vocab:  # labels as indices into the draft vocabulary; other tokens cannot be drafted
            labels = draft_index(model.draft_token_ids, head_weight.shape[0])[labels]
            ok = ok & ((labels >= 0).long().cumprod(1).bool() if self.greedy_path_only else labels >= 0)
            labels = labels.clamp(min=0)
        # The head (the largest matmul of a step) runs on the supervised rows only: on corpus text about
        # one slot in five is on the target's greedy path, and a row outside `ok` has weight 0 anyway.
        m, k = ok.nonzero(as_tuple=True)
        logits = hidden[:, 1:][m, k] @ model.head_weight(head_weight).to(hidden.dtype).T   # [S, V]
        wide = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        if self.objective == "distill":  # -sum_j p_j log q(j) over the target's top K at the slot's position
            if soft_probs is None or soft_index is None:
                raise ValueError("objective 'distill' needs the target's soft labels (soft_probs, soft_index)")
            rows = (seq[m], flat[m, k] - 1)
            logq = torch.log_softmax(wide, -1).gather(-1, soft_index[rows])
            ce = -(soft_probs[rows].to(logq.dtype) * logq).sum(-1)
        else:
            ce = F.cross_entropy(wide, labels[m, k], reduction="none")
        w = slot_weights(B, self.slot_decay, dev)[k].to(ce.dtype)                    # each kept row's slot weight
        correct = ((logits.argmax(-1) == labels[m, k]) & (k == 0)).sum()
        return LossParts((ce * w).sum(), w.sum(), ok.sum(), correct, ok[:, 0].sum())
