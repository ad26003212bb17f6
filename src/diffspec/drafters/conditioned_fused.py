"""The conditioned drafter's pass in 8-bit arithmetic, in one C call (`--drafter-dtype q8`; issue 19: the drafters'
passes at the hardware's limit; issue 16: a drafter pass must cost well under a plain step to pay).

On a 2-core AVX2-only CPU the lean pass (conditioned_pass.py) cost 6.4-9 ms a draft step in bfloat16 (26 in
float32: torch's matmuls of a block's 8 rows ran at 4-6 GMAC/s there): ~4.4 ms of matmuls through bf16_linear's
kernel (~14 GMAC/s) and ~3 ms of some 60 small torch operations (norms, rotary embeddings, casts, attention,
residuals), each a few microseconds of dispatch for a few thousand floats of work. Here:

- every matrix (q/k/v, output, gate/up, down, the target features' projection, and the head's rows the drafter
  scores) is held as Q8_0 codes, quantized once from the drafter's float weights (`q8_linear.quantized_pack`:
  int8 codes, a float32 scale per block of 32 inputs) and rebuilt when a weight changes;
- each product quantizes its activations per block of 32 to 8 bits and sums exact integer products
  (q8_linear.c: AVX-512 VNNI, AVX2's byte multiply-adds, or plain C), the target's `--kernels q8` arithmetic,
  llama.cpp's: 2-3x bf16_linear's rate at a block's rows on AVX2;
- the block's layers and final norm (`diffspec_block_layers`) and the context's keys and values
  (`diffspec_block_context`) each run in one call of fused_layers.c, whose attention, norms, rotary embeddings
  and SiLU the target's fused pass uses; the context cache is the drafter's own (ContextCache, float32).

The drafts are the float model's up to that quantization (a draft can differ from the float pass's where two
tokens nearly tie); the output cannot: the target verifies every token, and q is the row a token was drawn from.
The `auto` dtype choice (dtype_choice.py) times this pass beside float32 and bfloat16 and keeps the fastest.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Optional

import torch

from .. import fused_layers, q8_linear
from ..packed_linear import BLOCK, NATIVE, KernelUnavailable, module_state
from ..q8_linear import Q8Weight, quantized_pack
from .conditioned_pass import stacked_layer

#: fused_layers.c's table fields (enum order) the drafter's calls read
_IN_NORM, _QKV, _O, _POST_NORM, _GU, _DOWN, _K_CACHE, _V_CACHE, _CAPACITY = 0, 1, 4, 7, 8, 11, 14, 15, 16


def unavailable(device="cpu", cfg=None) -> Optional[str]:
    """Why this pass cannot run here (None: it can): a CPU only, with fused_layers.c built, and (given the drafter's
    config) widths the C call takes: every product's inputs a multiple of 32 (the codes' blocks), an even head width
    of at most fused_layers.MAX_HEAD_DIM, query heads a multiple of the key/value heads."""
    if torch.device(device).type != "cpu":
        return f"q8 runs on a CPU only (this drafter is on {torch.device(device).type})"
    if cfg is not None:
        widths = {"hidden size": cfg.hidden_size, "intermediate size": cfg.intermediate_size,
                  "attention width": cfg.num_attention_heads * cfg.head_dim,
                  "features' width": len(cfg.target_layer_ids) * cfg.hidden_size}
        odd = [f"{name} {w}" for name, w in widths.items() if w % BLOCK]
        if odd:
            return f"8-bit codes need widths that are multiples of {BLOCK}; this drafter has {', '.join(odd)}"
        if cfg.head_dim % 2 or cfg.head_dim > fused_layers.MAX_HEAD_DIM or \
                cfg.num_attention_heads % cfg.num_key_value_heads:
            return (f"heads of {cfg.head_dim} dimensions ({cfg.num_attention_heads} query, {cfg.num_key_value_heads} "
                    f"key/value): the fused call takes even widths up to {fused_layers.MAX_HEAD_DIM} and query heads "
                    f"a multiple of the key/value heads")
    lib = fused_layers.build_library(NATIVE)
    return str(lib) if isinstance(lib, KernelUnavailable) else None


@dataclass(frozen=True, eq=False)
class Q8DrafterWeights:
    """The drafter's matrices as Q8_0 codes (q8_linear.c's layout), and what the C calls read beside them."""

    layers: tuple          # per layer: (qkv, o, gate_up, down) Q8Weights; kv = qkv's key and value rows
    kv: tuple              # per layer: the key/value rows of qkv (views), for the context
    fc: Q8Weight
    head: Q8Weight
    norms: tuple           # per layer: (input norm, post norm, qk_norm [(H + KV) * hd], k_norm [hd]), float32
    hidden_norm: torch.Tensor
    final_norm: torch.Tensor


class FusedQ8Pass:
    """The conditioned drafter's context and block passes through fused_layers.c, in 8-bit arithmetic. Holds the
    codes of one model and head (`current` rebuilds them when either changed: the model's tensors are checked as
    ServingWeights checks them, the head by identity and version)."""

    def __init__(self, model, isa_flags: tuple = NATIVE):
        cfg = model.cfg
        reason = unavailable("cpu", cfg)
        if reason:
            raise ValueError(f"fused q8 pass: {reason}")
        self.lib = fused_layers.build_library(isa_flags)
        if isinstance(self.lib, KernelUnavailable):
            raise self.lib
        self.cfg = cfg
        self.H, self.KV, self.hd, self.D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.F = cfg.intermediate_size
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self._key = self._head = None  # what the codes were made from (the head held: its identity is compared)
        self.weights: Optional[Q8DrafterWeights] = None
        L = cfg.num_hidden_layers
        fields = self.lib.diffspec_fused_layer_fields()
        self._table = (ctypes.c_int64 * (L * fields))()  # the layers' addresses; the caches' written per call
        self._fields = fields
        self._qk_norms = (ctypes.c_int64 * L)()
        self._kv_codes, self._kv_scales, self._k_norms = ((ctypes.c_int64 * L)() for _ in range(3))

    def current(self, model, head: torch.Tensor) -> Q8DrafterWeights:
        """The codes of `model` and `head` (the rows the drafter scores), quantized again when either changed."""
        key = (module_state(model), head.data_ptr(), head._version if not head.is_inference() else None)
        if key != self._key or head is not self._head:
            self.weights = self._quantize(model, head)
            self._key, self._head = key, head
        return self.weights

    @torch.no_grad()
    def _quantize(self, model, head: torch.Tensor) -> Q8DrafterWeights:
        H, KV, hd = self.H, self.KV, self.hd
        layers, kvs, norms = [], [], []
        for layer in model.layers:
            w = stacked_layer(layer)  # the lean pass's stacking (conditioned_pass.py)
            qkv = quantized_pack(w["qkv"])
            layers.append((qkv.q8, quantized_pack(w["o"]).q8, quantized_pack(w["gate_up"]).q8,
                           quantized_pack(w["down"]).q8))
            kvs.append(qkv.q8.rows(H * hd, (H + 2 * KV) * hd, qkv))  # the rows of w["kv"], as views
            norms.append(tuple(w[name].float().contiguous() for name in ("input_norm", "post_norm", "qk_norm", "k_norm")))
        weights = Q8DrafterWeights(tuple(layers), tuple(kvs), quantized_pack(model.fc.weight).q8,
                                   quantized_pack(head).q8, tuple(norms),
                                   model.hidden_norm.weight.detach().float().contiguous(),
                                   model.norm.weight.detach().float().contiguous())
        f, table = self._fields, self._table
        for l, ((qkv, o, gu, down), (in_norm, post_norm, qk, k_norm), kv) in \
                enumerate(zip(weights.layers, weights.norms, weights.kv)):
            table[l * f + _IN_NORM] = in_norm.data_ptr()
            table[l * f + _POST_NORM] = post_norm.data_ptr()
            for at, w in ((_QKV, qkv), (_O, o), (_GU, gu), (_DOWN, down)):
                table[l * f + at: l * f + at + 3] = (w.codes.data_ptr(), w.scales.data_ptr(), 0)
            self._qk_norms[l] = qk.data_ptr()
            self._kv_codes[l], self._kv_scales[l], self._k_norms[l] = \
                kv.codes.data_ptr(), kv.scales.data_ptr(), k_norm.data_ptr()
        return weights

    def _caches(self, cache) -> None:
        f = self._fields
        for l, (k, v) in enumerate(zip(cache.keys, cache.values)):
            self._table[l * f + _K_CACHE], self._table[l * f + _V_CACHE] = k.data_ptr(), v.data_ptr()
            self._table[l * f + _CAPACITY] = k.shape[1]

    def _check_cache(self, cache, end: int) -> None:
        if cache.dtype != torch.float32 or cache.capacity < end or cache.shape != (self.KV, self.hd):
            raise RuntimeError(f"fused q8 pass: the context cache must be float32 with room for {end} positions")

    @torch.inference_mode()
    def context(self, cache, features: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """The target's features [m, F] of positions start.. -> each layer's keys and values at those positions
        (context_into_cache's arithmetic, 8-bit products)."""
        w = self.weights
        m, fi = features.shape
        self._check_cache(cache, start + m)
        self._caches(cache)
        x = features.to(torch.float32).contiguous()
        cos, sin = cos.float().contiguous(), sin.float().contiguous()  # held: the call reads their addresses
        threads = torch.get_num_threads()
        work = torch.empty(self.lib.diffspec_block_context_work_floats(m, fi, self.D, self.KV, self.hd))
        self.lib.diffspec_block_context(len(w.layers), ctypes.addressof(self._table), ctypes.addressof(self._kv_codes),
                                        ctypes.addressof(self._kv_scales), ctypes.addressof(self._k_norms), m, start, fi,
                                        self.D, self.KV, self.hd, w.fc.codes.data_ptr(), w.fc.scales.data_ptr(),
                                        w.hidden_norm.data_ptr(), self.cfg.rms_norm_eps, cos.data_ptr(), sin.data_ptr(),
                                        x.data_ptr(), work.data_ptr(), threads, 1)

    @torch.inference_mode()
    def block(self, cache, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The block's states x [n, D] at positions cache.length.. -> the final norm's output [n, D] (block_hidden's
        arithmetic, 8-bit products). The block's keys and values go in the cache's scratch positions."""
        w = self.weights
        n, start = x.shape[0], cache.length
        self._check_cache(cache, start + n)
        self._caches(cache)
        h = x.to(torch.float32).clone(memory_format=torch.contiguous_format)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        threads = torch.get_num_threads()
        work = torch.empty(self.lib.diffspec_fused_work_floats(n, self.D, self.H, self.KV, self.hd, self.F, start + n,
                                                               threads))
        self.lib.diffspec_block_layers(len(w.layers), ctypes.addressof(self._table), ctypes.addressof(self._qk_norms),
                                       n, start, self.D, self.H, self.KV, self.hd, self.F, self.cfg.rms_norm_eps,
                                       self.scale, cos.data_ptr(), sin.data_ptr(), w.final_norm.data_ptr(),
                                       h.data_ptr(), work.data_ptr(), threads, 1)
        return h

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, head rows] of the rows hidden [n, D] (8-bit products)."""
        return q8_linear.q8_linear(hidden.to(torch.float32).contiguous(), self.weights.head, self.lib)
