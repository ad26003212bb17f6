"""The conditioned drafter's serving pass, lean (issue 19: the drafters' passes at the hardware's limit).

`ConditionedDraftModel.forward` is the reference pass (training and the DFlash comparison use it): per
layer it concatenates the context's keys and values with the block's, copies them for every query head,
and recomputes the rotary angles for every projection. A draft round on a 2-core CPU cost ~5-8 ms that
way, where the weights it reads (two layers and an 8192-row head, bf16) stream in under 1 ms. Here the
same network, computed in the same dtype, with:

- a position-indexed context cache (`ContextCache`): per layer, keys and values preallocated (grown by
  doubling), written at their positions. The block's own keys and values go in after the context, at the
  block's positions, without advancing the length: the next round's context overwrites them. So no
  concatenation per pass, and nothing is copied per query head;
- grouped-query attention as rows: the block attends to everything (no mask), so the query heads that
  share a key/value head are one attention's rows (`q.view(kv_heads, rep * n, d)`) over the unrepeated
  cache (SDPA ran 1.3-2.4x faster so than over a repeated cache; two bmm calls, faster still);
- the q/k/v and gate/up projections each one matmul over weights stacked once (`ServingWeights`,
  rebuilt when a weight changes: its tensors' version counters and identities are checked every pass);
- a bf16 model's matmuls (and the drafter's head) through bf16_linear's kernel on a CPU: oneDNN streamed
  these few-row products' weights at a third of the memory's bandwidth;
- the rotary angles from one table, sliced by position.

It computes what the reference does up to rounding (a stacked matmul and another attention kernel sum in
another order); tests hold the two together in fp64. The output stays exact whatever the drafter
computes: the target verifies every token, and q is the row a token was drawn from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import bf16_linear
from ..packed_linear import module_state


def cache_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """What a model of `model_dtype` keeps its context keys and values in: attention's own dtype (float32, or
    float64 for a float64 model). A bf16 model's keys and values are bf16 values, so storing them wider changes
    no score. What it saves is attention's second product on a CPU: a bf16 bmm goes to oneDNN, which builds (JIT)
    a kernel for each new shape, and the context grows every round: ~300 us to 1 ms a call where the same
    product with a cached kernel takes ~80 us, against ~140 us for MKL's float32 bmm at any length
    (benchmarks/results/issue16_training/drafter_round/)."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


class ContextCache:
    """Keys/values [kv_heads, capacity, head_dim] per layer for positions 0..length-1, position-indexed, in
    `cache_dtype(dtype)` for a model of `dtype`. Positions past `length` are scratch (the block's own keys and
    values during a pass)."""

    @torch.inference_mode()  # buffers made here and in reserve() alike: a compiled graph guards on the kind
    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device, capacity: int = 256):
        self.shape = (kv_heads, head_dim)
        dtype = cache_dtype(dtype)
        self.keys = [torch.empty(kv_heads, capacity, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty_like(k) for k in self.keys]
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @torch.inference_mode()
    def reserve(self, positions: int) -> None:
        """Room for `positions` positions (doubling: a request's growth copies O(length) in all)."""
        if positions <= self.capacity:
            return
        capacity = max(positions, 2 * self.capacity)
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                new = old.new_empty(old.shape[0], capacity, old.shape[2])
                new[:, : self.length] = old[:, : self.length]
                tensors[i] = new


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: "Matrix"              # [H*d + 2*KV*d, h]: q_proj, k_proj, v_proj stacked
    kv: "Matrix"               # [2*KV*d, h]: k_proj, v_proj (the context's keys and values)
    k_norm: torch.Tensor
    qk_norm: torch.Tensor      # [H + KV, d]: q_norm's weight for each query head, then k_norm's for each key head
    o: "Matrix"
    post_norm: torch.Tensor
    gate_up: "Matrix"          # [2*I, h]: gate_proj, up_proj stacked
    down: "Matrix"


Matrix = "torch.Tensor | bf16_linear.Bf16Weight"  # a weight as `matmul` takes it


def as_matrix(weight: torch.Tensor, use_kernel: bool):
    """The weight as the lean pass multiplies by it: bf16_linear's tiles where the kernel serves, else as is."""
    packed = bf16_linear.pack(weight) if use_kernel else None
    return packed if packed is not None else weight.detach()


def matmul(x: torch.Tensor, w) -> torch.Tensor:
    """x @ W^T, through bf16_linear's kernel for a packed weight."""
    return bf16_linear.linear(x, w) if isinstance(w, bf16_linear.Bf16Weight) else x @ w.T


@dataclass(frozen=True)
class PassWeights:
    layers: tuple          # LayerWeights per drafter layer
    fc: "Matrix"           # the target features' projection


class ServingWeights:
    """The model's weights as the lean pass reads them, stacked once (and, for a bf16 model on a CPU where
    bf16_linear's kernel builds, in its tiles); `current(model)` rebuilds them when any source weight was
    changed (in place: its version counter; or replaced: its identity)."""

    def __init__(self):
        self._key = None
        self.weights: "PassWeights | None" = None

    def current(self, model: nn.Module) -> PassWeights:
        key = module_state(model)  # (once a round; what it sees and does not: packed_linear.module_state)
        if key != self._key:
            with torch.no_grad():
                stacked = [stacked_layer(layer) for layer in model.layers]
                matrices = [w for layer in stacked for w in (layer["qkv"], layer["o"], layer["gate_up"], layer["down"])]
                # bf16_linear's kernel where this model's weights are bf16 on a CPU and it measured faster here
                use_kernel = uses_kernel(model.fc.weight) and \
                    bf16_linear.faster_here(matrices, rows=model.cfg.block_size)
                self.weights = PassWeights(
                    tuple(LayerWeights(**{name: as_matrix(w, use_kernel) if name in MATRICES else w
                                          for name, w in layer.items()}) for layer in stacked),
                    as_matrix(model.fc.weight, use_kernel))
            self._key = key
        return self.weights


def stacked_layer(layer) -> dict:
    """One drafter layer's weights as the lean pass and the q8 pass read them (LayerWeights' fields): q/k/v and
    gate/up stacked, the key/value rows apart, the q/k norms repeated per head."""
    a, m = layer.self_attn, layer.mlp
    kv = torch.cat([a.k_proj.weight, a.v_proj.weight]).detach()
    return dict(input_norm=layer.input_layernorm.weight.detach(), qkv=torch.cat([a.q_proj.weight.detach(), kv]),
                kv=kv, k_norm=a.k_norm.weight.detach(),
                qk_norm=torch.cat([a.q_norm.weight.expand(a.cfg.num_attention_heads, -1),
                                   a.k_norm.weight.expand(a.cfg.num_key_value_heads, -1)]).detach(),
                o=a.o_proj.weight.detach(), post_norm=layer.post_attention_layernorm.weight.detach(),
                gate_up=torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach(), down=m.down_proj.weight.detach())


MATRICES = ("qkv", "kv", "o", "gate_up", "down")  # the LayerWeights fields a matmul reads


def uses_kernel(weight: torch.Tensor) -> bool:
    """Whether a weight like this one may be multiplied by bf16_linear's kernel: bf16 on a CPU where it builds
    (whether it is, bf16_linear.faster_here decides by timing)."""
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and bf16_linear.available() is None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """conditioned.RMSNorm's arithmetic (DFlash's and Qwen3's too): normalised in float32 whatever x's dtype
    (a float64 model's norms too), back to x's dtype, then scaled; `weight` may be [.., heads, d]."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class RopeTable:
    """cos/sin rows [positions, head_dim] for the rotary embedding, as conditioned.rotary computes them
    (float32 angles, then the compute dtype), grown by doubling."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self.cos = self.sin = None

    def rows(self, start: int, n: int, dtype: torch.dtype, device) -> Tuple[torch.Tensor, torch.Tensor]:
        if self.cos is None or self.cos.shape[0] < start + n or self.cos.dtype != dtype or self.cos.device != device:
            size = max(start + n, 2 * (self.cos.shape[0] if self.cos is not None else 256))
            d = self.head_dim
            inv_freq = 1.0 / (self.theta ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
            angles = torch.arange(size, device=device).float()[:, None] * inv_freq
            self.cos = torch.cat([angles.cos(), angles.cos()], -1).to(dtype)
            self.sin = torch.cat([angles.sin(), angles.sin()], -1).to(dtype)
        return self.cos[start: start + n], self.sin[start: start + n]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [n, heads, d]; cos/sin [n, d] (conditioned.rotary's half-split arithmetic)."""
    half = x.shape[-1] // 2
    cos, sin = cos[:, None], sin[:, None]
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], -1) * sin


def context_into_cache(model: nn.Module, weights: PassWeights, cache: ContextCache, features: torch.Tensor,
                       positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """The target's features [m, F] of `positions` [m] -> each layer's keys and values, written into the
    cache at those positions (conditioned.Attention.context_kv's arithmetic). The positions come as a
    tensor, not a start: a compiled graph would specialise a first position of 0."""
    cfg = model.cfg
    kv_heads, d = cache.shape
    m = features.shape[0]
    ctx = rms_norm(matmul(features, weights.fc), model.hidden_norm.weight, cfg.rms_norm_eps)
    for i, w in enumerate(weights.layers):
        k, v = matmul(ctx, w.kv).view(m, 2, kv_heads, d).unbind(1)
        k = _rotate(rms_norm(k, w.k_norm, cfg.rms_norm_eps), cos, sin)
        cache.keys[i].index_copy_(1, positions, k.transpose(0, 1).to(cache.dtype))
        cache.values[i].index_copy_(1, positions, v.transpose(0, 1).to(cache.dtype))


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v with no mask, in the cache's dtype (float32, float64 for float64: bf16 scores
    would round each q.k), returned in q's dtype: two bmm calls ran 1.5-1.6x faster than CPU SDPA at a block's
    24 rows over 100-1000 keys in bf16, as accurate (max error against float64 0.0014 vs SDPA's 0.0010 at 300
    keys; bf16 scores: 0.0025)."""
    scores = torch.bmm(q.to(keys.dtype), keys.transpose(1, 2)) * scale
    return torch.bmm(torch.softmax(scores, -1).to(values.dtype), values).to(q.dtype)


def block_hidden(model: nn.Module, weights: PassWeights, cache: ContextCache, x: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The block's states x [n, h] at positions cache.length.. (all attending to the whole context and to
    each other) -> the final norm's output [n, h]. Writes the block's keys and values into the cache's
    scratch positions (reserved by the caller); the length does not move."""
    cfg = model.cfg
    heads, (kv_heads, d) = cfg.num_attention_heads, cache.shape
    n, start, eps = x.shape[0], cache.length, cfg.rms_norm_eps
    rep, q_width = heads // kv_heads, heads * d
    for i, w in enumerate(weights.layers):
        h = rms_norm(x, w.input_norm, eps)
        qkv = matmul(h, w.qkv)
        qk = _rotate(rms_norm(qkv[:, : q_width + kv_heads * d].view(n, heads + kv_heads, d), w.qk_norm, eps), cos, sin)
        q = qk[:, :heads]
        keys, values = cache.keys[i], cache.values[i]
        keys[:, start: start + n] = qk[:, heads:].transpose(0, 1)
        values[:, start: start + n] = qkv[:, q_width + kv_heads * d:].view(n, kv_heads, d).transpose(0, 1)
        # query heads j*rep .. j*rep+rep-1 read key/value head j (repeat_interleave's order): with no mask
        # they are rows of one attention over that head
        q = q.transpose(0, 1).reshape(kv_heads, rep * n, d)
        out = _attend(q, keys[:, : start + n], values[:, : start + n], 1.0 / math.sqrt(d))
        x = x + matmul(out.view(heads, n, d).transpose(0, 1).reshape(n, q_width), w.o)
        gate, up = matmul(rms_norm(x, w.post_norm, eps), w.gate_up).chunk(2, -1)
        x = x + matmul(F.silu(gate) * up, w.down)
    return rms_norm(x, model.norm.weight, eps)


class ServingPass(nn.Module):
    """The lean block pass as a module (what `--compile` compiles; the model is its only submodule)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, weights: PassWeights, cache: ContextCache, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        return block_hidden(self.model, weights, cache, x, cos, sin)
