"""Target-conditioned block drafter (DFlash-style).

A small stack of bidirectional transformer layers whose attention keys/values are prefixed with
the target's own hidden states (several layers, concatenated, projected to the width by `fc` and
normalised by `hidden_norm`). It shares the target's token embeddings and LM head (frozen, never
stored in its file). One forward pass over a block [last accepted token, mask, ..., mask] drafts
block_size - 1 tokens; all are drawn in that one step, so their q is valid for rejection sampling.

The target's hidden states come for free from the verification pass: the engine hands the drafter
those of every accepted position (`observe`). The drafter keeps, per layer, the keys/values of
those context positions; they are verified tokens, so this cache never needs rolling back.

Parameter names and config fields follow the DFlash checkpoint layout (layers.N.self_attn.q_proj,
q_norm/k_norm, mlp.gate_proj, fc, hidden_norm, norm; Qwen3 config fields plus block_size,
mask_token_id, target_layer_ids, num_target_layers) so a folder we write is a DFlash checkpoint -
unless it drafts from a reduced vocabulary (`draft_vocab`), which DFlash has no place for
(dflash_layout.py). `block_logits` is the one pass, compared with the reference's in the tests.

Lookup hints (`lookup_hints`, diffspec's own, trained with `train-drafter --lookup-hints`): the block's
slots carry what prompt lookup copies from the context after the anchor, where it copies anything, and
masks past that. The drafter reads the copy as a proposal it may keep or overrule: where the context
repeats, prompt lookup's first token is right ~72-86% of the time on this project's bench answers, a
mask-only drafter's ~30% (README, "Where the shipped drafter is right"). The hints are a function of
the context alone (the same `NgramIndex.continuation` in serving and in training), so the drafts stay
one pass of a deterministic function of the context: verification is unchanged and exact.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from .. import bf16_linear, fused_layers
from ..errors import DiffspecError
from ..policies.base import LengthPolicy
from ..types import Draft, SamplingParams
from .base import Drafter, DrafterCapabilities, DraftBuilder, align_logits_to_vocab, draw_tokens
from ..timing import median_ms
from . import conditioned_fused
from .compile_choice import CompilesPasses
from .conditioned_pass import (ContextCache, RopeTable, ServingPass, ServingWeights, as_matrix, cache_dtype,
                               context_into_cache, matmul, uses_kernel)
from .dtype_choice import Q8, ChoosesDtype
from .prompt_lookup import CANDIDATES, MAX_MATCH, NgramIndex

HINT_NGRAMS = (3, 2)  # the lookup hints' n-grams, longest and shortest: PromptLookupDrafter's defaults
# what a hinted drafter was trained with, kept in its folder: other hints would be inputs it never saw
HINT_RULE = (f"prompt lookup over the context: n-grams {HINT_NGRAMS[0]} down to {HINT_NGRAMS[1]}, the longest match "
             f"of the latest {CANDIDATES} up to {MAX_MATCH} tokens")


def hint_index() -> NgramIndex:
    """A fresh index for one request's (or one training sequence's) lookup hints."""
    return NgramIndex(*HINT_NGRAMS)


def lookup_hint_slots(rows: list, seq: list, anchor: list, block_size: int, fill: int) -> torch.Tensor:
    """The drafted slots of hinted blocks: for block m (the ids of sequence rows[seq[m]] up to its anchor
    anchor[m]), slots 1..B-1 carry the tokens prompt lookup copies after those ids (`NgramIndex.continuation`, as
    the drafter does when serving), `fill` (the mask token) past the copy or where nothing matches.
    -> [M, B-1] int64. Blocks are visited by sequence and rising anchor, so each sequence is indexed once."""
    out = torch.full((len(seq), block_size - 1), fill, dtype=torch.long)
    index, current = None, None
    for m in sorted(range(len(seq)), key=lambda m: (seq[m], anchor[m])):
        if seq[m] != current:
            index, current = hint_index(), seq[m]
        copied = index.continuation(rows[seq[m]][: anchor[m] + 1], block_size - 1)
        if copied:
            out[m, : len(copied)] = torch.tensor(copied, dtype=torch.long)
    return out


def default_target_layers(num_target_layers: int, count: int = 3) -> list:
    """`count` layers evenly spaced from layer 1 to layer L-3 (for L=30, 3 -> [1, 14, 27])."""
    if count == 1:
        return [num_target_layers // 2]
    lo = min(1, num_target_layers - 1)  # a one-layer target has only layer 0
    hi = max(lo, num_target_layers - 3)
    return [round(lo + i * (hi - lo) / (count - 1)) for i in range(count)]


@dataclass(frozen=True)
class ConditionedConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    num_target_layers: int
    target_layer_ids: tuple
    vocab_size: int
    mask_token_id: int
    num_hidden_layers: int = 1
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    draft_vocab: int = 0      # > 0: draft only from these many target tokens (ids in the model's draft_token_ids)
    lookup_hints: bool = False  # the block's slots carry prompt lookup's copy where it has one (lookup_hint_slots)

    @classmethod
    def for_target(cls, target_config, mask_token_id: int, num_hidden_layers: int = 1, block_size: int = 16,
                   num_features: int = 3, draft_vocab: int = 0, lookup_hints: bool = False) -> "ConditionedConfig":
        """Shapes copied from the target's config (width must equal the target's hidden size)."""
        c = target_config.get_text_config(decoder=True)
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        return cls(hidden_size=c.hidden_size, num_attention_heads=heads,
                   num_key_value_heads=getattr(c, "num_key_value_heads", heads) or heads,
                   head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads,
                   intermediate_size=c.intermediate_size, num_target_layers=c.num_hidden_layers,
                   target_layer_ids=tuple(default_target_layers(c.num_hidden_layers, num_features)),
                   vocab_size=c.vocab_size, mask_token_id=mask_token_id, num_hidden_layers=num_hidden_layers,
                   block_size=block_size, rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
                   rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
                   max_position_embeddings=getattr(c, "max_position_embeddings", 8192), draft_vocab=draft_vocab,
                   lookup_hints=lookup_hints)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = list(self.target_layer_ids)
        return d


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotary(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding (half-split convention). x [heads, n, d] with positions [n], or a batch:
    x [N, heads, n, d] with positions [N, n] (training/anchored.py)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d))
    angles = positions.float()[..., None] * inv_freq                     # [..., n, d/2]
    if positions.dim() > 1:
        angles = angles.unsqueeze(-3)                                       # [N, 1, n, d/2]: every head alike
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: ConditionedConfig):
        super().__init__()
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, cfg.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n_heads: int) -> torch.Tensor:
        return x.view(x.shape[0], n_heads, self.cfg.head_dim).transpose(0, 1)  # [heads, n, d]

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> tuple:
        """Keys/values of context features ctx [c, h] at positions [c] -> ([kv, c, d], [kv, c, d])."""
        k = self.k_norm(self._heads(self.k_proj(ctx), self.cfg.num_key_value_heads))
        v = self._heads(self.v_proj(ctx), self.cfg.num_key_value_heads)
        return rotary(k, positions, self.cfg.rope_theta), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [q, h] block states at positions [q]; past_k/v [kv, c, d] context. Bidirectional."""
        cfg = self.cfg
        q = rotary(self.q_norm(self._heads(self.q_proj(x), cfg.num_attention_heads)), positions, cfg.rope_theta)
        k_new, v_new = self.context_kv(x, positions)
        k = torch.cat([past_k, k_new], dim=1)
        v = torch.cat([past_v, v_new], dim=1)
        rep = cfg.num_attention_heads // cfg.num_key_value_heads
        k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=1.0 / math.sqrt(cfg.head_dim))
        return self.o_proj(out.transpose(0, 1).reshape(x.shape[0], -1))


class MLP(nn.Module):
    def __init__(self, cfg: ConditionedConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ConditionedConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, positions, past_k, past_v, attn_mask=None):
        x = x + self.self_attn(self.input_layernorm(x), positions, past_k, past_v, attn_mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class ConditionedDraftModel(nn.Module):
    """The drafter network. Its own parameters only: embeddings and LM head are the target's."""

    def __init__(self, cfg: ConditionedConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(len(cfg.target_layer_ids) * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.draft_vocab:  # the target token ids the drafter may propose (a reduced draft vocabulary)
            self.register_buffer("draft_token_ids", torch.arange(cfg.draft_vocab, dtype=torch.long))

    def head_weight(self, full_head_weight: torch.Tensor) -> torch.Tensor:
        """Rows of the shared LM head the drafter scores: all, or those of the draft vocabulary."""
        return full_head_weight[self.draft_token_ids] if self.cfg.draft_vocab else full_head_weight

    def to_target_ids(self, index: torch.Tensor) -> torch.Tensor:
        return self.draft_token_ids[index] if self.cfg.draft_vocab else index

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[c, len(target_layer_ids) * h] target features -> [c, h]."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(self, block_embeddings: torch.Tensor, block_positions: torch.Tensor, context_kv: list,
                attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """block_embeddings [q, h] at block_positions [q]; context_kv: per layer (k, v) [kv, c, d]."""
        x = block_embeddings
        for layer, (k, v) in zip(self.layers, context_kv):
            x = layer(x, block_positions, k, v, attn_mask)
        return self.norm(x)

    def context_keys_values(self, target_hidden: torch.Tensor, positions: torch.Tensor) -> list:
        ctx = self.project_context(target_hidden)
        return [layer.self_attn.context_kv(ctx, positions) for layer in self.layers]


class ConditionedDrafter(CompilesPasses, ChoosesDtype, Drafter):
    name = "conditioned"
    capabilities = DrafterCapabilities(gives_probabilities=True, needs_target_hidden_states=True,
                                       keeps_own_cache=True, chooses_dtype=True, compiles_passes=True)
    supports_q8 = True  # --drafter-dtype q8: conditioned_fused.py

    def __init__(self, model: ConditionedDraftModel, tokenizer_fingerprint: Optional[str] = None,
                 name: str = "conditioned"):
        self.model = model.eval()
        self.cfg = model.cfg
        self.name = name
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.target_layer_ids = tuple(model.cfg.target_layer_ids)
        self.default_gamma = model.cfg.block_size - 1  # one pass drafts the whole block
        self.max_tokens_per_round = model.cfg.block_size - 1  # and never more
        self._embed = self._head_weight = self._target_head = None
        self._head_dtype: Optional[torch.dtype] = None  # what _use_dtype converted the head to (None: the target's)
        self._weights = ServingWeights()  # the lean pass's stacked weights (conditioned_pass.py)
        self._rope = RopeTable(model.cfg.head_dim, model.cfg.rope_theta)
        self._serving = ServingPass(model)
        self._fused: Optional[conditioned_fused.FusedQ8Pass] = None  # the 8-bit pass, where computing in q8
        self.vocab_size: Optional[int] = None
        self.compute_dtype: Optional[str] = None  # see dtype_choice.py
        self.dtype_note = ""
        self.begin(None)

    def attach(self, target) -> None:
        super().attach(target)
        cfg = self.cfg
        if cfg.hidden_size != target.hidden_size:
            raise DiffspecError(f"conditioned drafter '{self.name}' has width {cfg.hidden_size}, the target's hidden "
                                f"size is {target.hidden_size}: it was built for another target")
        if max(cfg.target_layer_ids) >= target.num_layers or cfg.num_target_layers != target.num_layers:
            raise DiffspecError(f"conditioned drafter '{self.name}' was built for a target of {cfg.num_target_layers} "
                                f"layers (it reads layers {list(cfg.target_layer_ids)}); the target has "
                                f"{target.num_layers}: it was built for another target")
        embed = target.input_embeddings()
        rows = int(embed.weight.shape[0])
        if cfg.vocab_size not in (rows, target.declared_vocab_size) or not 0 <= cfg.mask_token_id < rows:
            raise DiffspecError(f"conditioned drafter '{self.name}' was built for a vocabulary of {cfg.vocab_size} "
                                f"rows (mask token {cfg.mask_token_id}); the target's embeddings have {rows} rows")
        self._embed = embed
        self._target_head = target.output_head_weight()  # shared, never modified
        # in the dtype a previous attach's choice converted the model to (each engine attaches; `auto`'s calibration
        # runs two): a bf16 drafter given the float32 head again drafted at 2-3x its cost (9-12 ms a round, not 4)
        head = self.model.head_weight(self._target_head)
        self._set_head(head.to(self._head_dtype or self._half_dtype(head)))
        self.vocab_size = target.vocab_size
        with self._eager():  # both dtypes timed alike
            self._settle_dtype()
        self._settle_compile(target)

    def _compile_module(self) -> torch.nn.Module:
        if self._serving.model is not self.model:
            self._serving = ServingPass(self.model)
        return self._serving

    def _compile_extra_parts(self) -> dict:
        # turning the features a round accepted (1 + accepted rows) into context keys and values
        return {"context": self._context_part}

    def _context_part(self, weights, cache, features, positions, cos, sin):
        context_into_cache(self.model, weights, cache, features, positions, cos, sin)

    def _compile_signature(self) -> str:
        return f"block {self.cfg.block_size}, layers {self.cfg.num_hidden_layers}, draft vocabulary " \
               f"{self.cfg.draft_vocab}{', q8' if self._fused is not None else ''}"

    def _compile_refusal(self) -> Optional[str]:
        return "its q8 pass is one C call (conditioned_fused.py)" if self._fused is not None else None

    def _q8_unavailable(self) -> Optional[str]:
        return conditioned_fused.unavailable(next(self.model.parameters()).device, self.cfg)

    @property
    def computes_q8(self) -> bool:
        return self._fused is not None

    def _use_dtype(self, dtype) -> None:
        """Compute in `dtype` (None: the model's own), or Q8: a float32 model's matrices as 8-bit codes, run by
        conditioned_fused.FusedQ8Pass."""
        head = self.model.head_weight(self._target_head)  # the target's own tensor (shared) with a full vocabulary
        self._fused = None
        if dtype == Q8:
            self.model.to(torch.float32)
            self._fused = conditioned_fused.FusedQ8Pass(self.model)
            dtype = torch.float32
        if dtype is not None:
            self.model.to(dtype)
            head = head.to(dtype)
        self._head_dtype = dtype
        self._set_head(head)
        self.begin(None)  # the cache is made in the model's dtype

    def _half_dtype(self, head: torch.Tensor) -> torch.dtype:
        """The head's dtype for a drafter whose dtype no choice of ours set: a half-precision body (loaded so, or
        converted by its user) drafts with the head in its own dtype, as a chosen one does; a float32 or float64
        body reads the target's head as it is (no copy)."""
        body = next(self.model.parameters()).dtype
        return body if body in (torch.bfloat16, torch.float16) and head.dtype != body else head.dtype

    def _set_head(self, head: torch.Tensor) -> None:
        self._head_weight = head
        # bf16_linear's tiles where its kernel serves here and measured faster at a block's rows; for a draft
        # vocabulary's rows only (a copy already): the whole vocabulary's head would be another copy of it
        self._head_matrix = as_matrix(head, bool(self.cfg.draft_vocab) and uses_kernel(head)
                                      and bf16_linear.faster_here([head], self.cfg.block_size - 1))

    def _time_step(self, context_len: int = 64, repeats: int = 5) -> float:
        """Median milliseconds of one steady-state draft after a context of `context_len` positions: the
        features of one more position turned into keys and values, then the drafter's pass (block_logits).
        The context's own features go in first, at once, as a prompt's do (so a compile warm-up runs the
        context keys and values on many rows and on one: a size of 1 is its own graph)."""
        device = self._head_weight.device
        total = context_len + repeats + 4  # median_ms's warm-up steps and the timed ones each add a position
        feats = torch.zeros(total, self.model.fc.in_features, device=device)
        ctx = torch.full((total,), self.cfg.mask_token_id, dtype=torch.long, device=device)
        self.begin(None)
        self.observe(feats[: context_len - 1], 0)
        self.block_logits(ctx[:context_len])

        def step():
            n = self._context_len
            self.observe(feats[n: n + 1], n)
            return self.block_logits(ctx[: n + 2])

        ms = median_ms(step, device, repeats)
        self.begin(None)
        return ms

    def begin(self, prompt_ids) -> None:
        param = next(self.model.parameters())
        if getattr(self, "_cache", None) is not None and self._cache.dtype == cache_dtype(param.dtype) \
                and self._cache.keys[0].device == param.device:
            self._cache.length = 0  # the buffers are reused: a new request overwrites them from position 0
        else:
            self._cache = ContextCache(self.cfg.num_hidden_layers, self.cfg.num_key_value_heads, self.cfg.head_dim,
                                       param.dtype, param.device)
        self._hints = hint_index() if self.cfg.lookup_hints else None  # this request's lookup hints
        self._context_len = 0  # positions whose target features were observed (in the cache or _pending)
        self._pending: list = []  # (features [m, F], start) observed, not yet turned into keys/values

    @torch.inference_mode()
    def observe(self, hidden: torch.Tensor, start: int) -> None:
        """Features are kept as they come and turned into keys/values only when a draft needs them, in
        one batch: rounds a policy runs without this drafter cost it almost nothing."""
        if start != self._context_len:
            raise RuntimeError(f"target features arrive for position {start}, expected {self._context_len}")
        self._pending.append((hidden, start))
        self._context_len += hidden.shape[0]

    @torch.inference_mode()
    def _flush(self, weights=None) -> None:
        if not self._pending:
            return
        dtype = next(self.model.parameters()).dtype
        start = self._pending[0][1]
        if start != self._cache.length:  # positions the cache does not hold would be read as context
            raise RuntimeError(f"conditioned drafter: features from position {start}, its cache holds "
                               f"{self._cache.length}")
        hidden = torch.cat([h for h, _ in self._pending]) if len(self._pending) > 1 else self._pending[0][0]
        self._pending = []
        hidden = hidden.to(dtype)
        compiled = self._compiled_part("context")
        if compiled is not None and hidden.storage_offset():  # torch guards a graph on offsets 0/1 vs 2+:
            hidden = hidden.clone()                           # a view into a larger tensor would compile again
        m = hidden.shape[0]
        self._cache.reserve(start + m + self.cfg.block_size)  # and room for the block's scratch keys/values
        cos, sin = self._rope.rows(start, m, dtype, hidden.device)
        if self._fused is not None:
            self._fused.context(self._cache, hidden, start, cos, sin)
        else:
            positions = torch.arange(start, start + m, device=hidden.device)
            weights = weights or self._weights.current(self.model)
            (compiled or self._context_part)(weights, self._cache, hidden, positions, cos, sin)
        self._cache.length = start + m

    @torch.inference_mode()
    def block_logits(self, context: torch.Tensor) -> torch.Tensor:
        """The one drafter pass: block [context[-1], mask, ..., mask] at positions n-1.. (with lookup hints, the
        slots prompt lookup covers carry its copy instead of the mask: lookup_hint_slots) -> logits
        [block_size - 1, draft vocabulary or head rows] for the tokens after context. Needs the
        target's features for every position but the last (observe)."""
        return self._head_logits(self._block_states(context))

    def _block_states(self, context: torch.Tensor) -> torch.Tensor:
        """block_logits' pass up to the head: the final norm's output [block_size - 1, D] of the slots after the
        anchor (each slot's logits are the head of its row alone, so `propose` runs the head on the rows it uses)."""
        cfg = self.cfg
        anchor = context.shape[0] - 1  # the last token; the target has not processed it yet
        if self._context_len != anchor:
            raise RuntimeError(f"conditioned drafter has features for {self._context_len} positions, "
                               f"context needs {anchor}: was the engine told to pass hidden states?")
        if self._fused is not None:  # the 8-bit pass: its codes, checked once a round
            weights = None
            self._fused.current(self.model, self._head_weight)
        else:
            weights = self._weights.current(self.model)  # checked once a round
        self._flush(weights)
        dtype = next(self.model.parameters()).dtype
        block = torch.full((cfg.block_size,), cfg.mask_token_id, dtype=torch.long, device=context.device)
        block[0] = context[-1]
        if self._hints is not None:  # prompt lookup's copy in the slots it covers (masks past it)
            copied = self._hints.continuation(context.tolist(), cfg.block_size - 1)
            if copied:
                block[1: 1 + len(copied)] = torch.tensor(copied, dtype=torch.long, device=context.device)
        self._cache.reserve(anchor + cfg.block_size)
        cos, sin = self._rope.rows(anchor, cfg.block_size, dtype, context.device)
        if self._fused is not None:
            return self._fused.block(self._cache, self._embed(block), cos, sin)[1:]
        # compiled (compile_choice.py) on a context of 2+ positions: torch specialises lengths 0 and 1
        body = self._compiled_body(self._cache.length > 1) or self._compile_module()
        return body(weights, self._cache, self._embed(block).to(dtype), cos, sin)[1:]

    def _head_logits(self, states: torch.Tensor) -> torch.Tensor:
        """The head's logits [n, draft vocabulary or head rows] of final-norm rows states [n, D]."""
        if self._fused is not None:
            return self._fused.head(states)
        return matmul(states.to(self._head_weight.dtype), self._head_matrix)

    @torch.inference_mode()
    def propose(self, context: torch.Tensor, policy: LengthPolicy, limit: int,
                sampling: SamplingParams, generator: Optional[torch.Generator]) -> Draft:
        states = self._block_states(context)  # [B-1, D]: the one pass, over the whole block
        rows = _DrawnRows(self, states, sampling, generator)  # the head runs on the rows the policy takes
        builder = DraftBuilder()
        for k in builder.increments(policy, limit):
            end = min(len(builder) + k, self.max_tokens_per_round)
            rows.draw_to(end)
            for i in range(len(builder), end):
                builder.add(rows.tokens[i], rows.confidences[i], None if rows.q is None else rows.q[i])
        return builder.build(1, context.device)

    def cost_signature(self) -> str:
        hints = ', lookup hints' if self.cfg.lookup_hints else ''
        if self._fused is not None:  # the 8-bit pass: fused_layers.c's source is its arithmetic
            return f"fused q8 pass 2 ({fused_layers.kernel_key()}{hints})"  # 2: the head on the rows taken (93d636f)
        weights = self._weights.current(self.model)
        kernel = bf16_linear.isa() if isinstance(weights.fc, bf16_linear.Bf16Weight) else "torch matmuls"
        # 1: 52bd839's lean pass (the reference module pass before it: ~2x the time a round); 2: context keys and
        # values kept in float32 (cache_dtype), attention's products in float32; 3: the head kept in the chosen dtype
        # when attached again (33b4a2a: rounds calibrated before it cost 2-3x, the head in float32); 4: the head on the
        # rows the policy takes (93d636f: a round's cost now depends on its length)
        return f"lean pass 4 ({kernel}{hints})"

    def describe(self) -> str:
        dtype = self._dtype_text()
        hints = ", prompt-lookup hints in its block" if self.cfg.lookup_hints else ""
        return f"{self.name}(block {self.cfg.block_size}, layers {self.cfg.num_hidden_layers}, " \
               f"target layers {list(self.cfg.target_layer_ids)}{hints}, {dtype}{self._compile_text()})"


class _DrawnRows:
    """One round's drafted tokens, drawn as the policy asks for them: the head (the draft vocabulary's rows, or the
    whole vocabulary's, times the width: a row's widest product) and the draw run on rows [0, end) only, at least
    doubling what was drawn (a policy that asks one token at a time streams the head ~log2(block) times, not once
    a token; rows drawn past what it then takes are wasted, never handed over). A row's logits are its own head
    product: bitwise block_logits' row under q8 and bf16_linear's kernel (each computes a row alike whatever the
    rows beside it); through torch's matmul a product of fewer rows may round differently, so a near-tie may draft
    another token there, which changes a draft, never the output. A sampled row is one draw from its own q, as
    before; the generator is drawn from in other chunks than before, so a seeded request samples other (equally
    distributed) tokens than before this class."""

    def __init__(self, drafter: "ConditionedDrafter", states: torch.Tensor, sampling: SamplingParams,
                 generator: Optional[torch.Generator]):
        self.drafter, self.states, self.sampling, self.generator = drafter, states, sampling, generator
        self.tokens: list = []
        self.confidences: list = []
        self.q: Optional[list] = None if sampling.greedy else []

    def draw_to(self, end: int) -> None:
        have = len(self.tokens)
        if end <= have:
            return
        end = min(self.states.shape[0], max(end, 2 * have))
        d = self.drafter
        logits = d._head_logits(self.states[have:end])
        if not d.cfg.draft_vocab:
            logits = align_logits_to_vocab(logits, d.vocab_size)
        drawn = draw_tokens(logits, self.sampling, self.generator)
        q = drawn.q
        if q is not None and d.cfg.draft_vocab:  # q over the full vocabulary: zero outside the draft vocabulary
            q = q.new_zeros(q.shape[0], d.vocab_size).index_copy_(1, d.model.draft_token_ids, q)
        self.tokens += d.model.to_target_ids(drawn.tokens).tolist()
        self.confidences += drawn.token_prob.tolist()
        if q is not None:
            self.q += list(q.unbind(0))
