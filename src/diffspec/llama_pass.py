"""A direct forward pass for Llama-architecture targets on a CPU (issue 19): transformers' arithmetic, op for op,
without its Python around it.

Once the matmuls read GGUF codes (packed_linear.py), a one-row step of SmolLM2-135M spends more time outside
its matmuls than in them: transformers' forward makes ~60 tensor ops and ~13 module calls per decoder layer
(RMSNorm as six ops, rotary embeddings as seven per tensor, the cache's update, the attention interface, output
capturing hooks, mask construction), each a few microseconds on a CPU. `forward` below runs the same model in
the same arithmetic with fewer calls:
- the same operations on the same values in the same order wherever a value is computed (RMSNorm, rotary
  embeddings, SwiGLU, residuals, SDPA with the same mask and flags), so its logits and hidden states equal
  transformers' own pass bitwise (tested at every pass width, fresh and on a cache, with and without packed
  layers);
- fewer calls: where the plan runs q/k/v (and gate/up) through the packed kernel, one kernel call for the
  three (two) on their codes stacked in one buffer (each layer keeps views of its rows: one copy of the codes),
  which computes every output by the same operations (the kernel sums each output alone, whatever the rows
  around it); the other linear layers straight to the kernel or through their routed forwards (kernels.py's
  plan, no module call); rotary embeddings applied to queries and keys in one go, their cos and sin cut from a
  table the rotary module made once (`RotaryTable`: its own rows, bitwise); the position-indexed cache's layers
  written directly (cache.PositionalLayer);
- no attention mask for a one-row pass (as transformers: none needed), a boolean causal mask otherwise.

Where every layer of a pass runs packed at its width, the layers go to one C call instead (fused_layers.py): the
same kernel for the matmuls, its own RMSNorm (the final norm's too), softmax and SiLU, so those passes are bitwise invariant to the
pass's width but no longer bitwise transformers' own (logits within ~2e-5 on SmolLM2). `LlamaPass(fused=False)`
keeps the torch operations everywhere; the equality above is tested with it.

It takes a model only where that equality is tested: `LlamaForCausalLM` with SiLU, no biases, no tensor-parallel
split, heads of at most 256 dimensions where key/value heads are shared, sdpa attention (or attention.py's GQA
variant of it), no forward hooks but transformers' own, and a cache of position-indexed layers (`applies`,
`cache_applies`; what may change between passes, `still_applies`, is checked on every pass).
Everything else (other architectures, sliding windows, a fixed-capacity cache, compiled passes, CUDA) runs
transformers' forward as before.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Optional

import torch
import torch.nn.functional as F

from .attention import GQA_SDPA
from .cache import PositionalLayer
from .fused_layers import FusedLayers
from .kernels import ROW_BUCKETS
from .packed_linear import PackedWeight, current_pack, routing_changed
from .q8_linear import Q8Weight, run_pack


def applies(model: torch.nn.Module) -> bool:
    """Whether `LlamaPass.forward` computes exactly what `model(...)` would for this model (on a cache of
    position-indexed layers: `cache_applies`)."""
    from transformers import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM or not still_applies(model):
        return False
    cfg = model.config
    if (cfg.hidden_act != "silu" or getattr(cfg, "mlp_bias", False) or getattr(cfg, "attention_bias", False)
            or getattr(cfg, "pretraining_tp", 1) != 1 or len(model.model.layers) != cfg.num_hidden_layers):
        return False
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    if kv_heads != heads and _head_dim(cfg) > 256:  # transformers then packs query heads as rows, or repeats k/v
        return False
    if any(p.device.type != "cpu" for p in model.parameters()):
        return False
    # hooks (accelerate's offloading, which also wraps forwards as `_hf_hook`; a user's): the pass calls layers'
    # forwards directly and would skip them. transformers' own output-capturing hooks (what output_hidden_states
    # reads) are not needed: the pass collects the hidden states itself.
    return not any(hasattr(m, "_hf_hook") or any(getattr(hook, "__module__", None) != _TRANSFORMERS_CAPTURE
                                                 for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))
                   for m in model.modules())


def still_applies(model: torch.nn.Module) -> bool:
    """What of `applies` a caller may change between passes (cheap enough to check on every pass): evaluation
    mode and sdpa attention (attention.py's GQA variant of it, or transformers' own)."""
    return not model.training and model.config._attn_implementation in ("sdpa", GQA_SDPA)


def _head_dim(cfg) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


_TRANSFORMERS_CAPTURE = "transformers.utils.output_capturing"


class LayerOutputs(Sequence):
    """A pass's hidden states as transformers gives them (the embeddings [1, n, D], each layer's output, the last one
    normed) over the fused call's buffer of every layer's output [L, n, D], without a tensor per layer until one is
    read: a pass that returns hidden states for a conditioned drafter reads three of 31 (`rows_of`), and making the
    31 views cost ~0.1 ms a step."""

    def __init__(self, embeddings: torch.Tensor, outputs: torch.Tensor):
        self.embeddings, self.outputs, self.last = embeddings, outputs, None  # last: the final norm's output, set by _head

    def __len__(self) -> int:
        return self.outputs.shape[0] + 1

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self[j] for j in range(*i.indices(len(self))))
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(i)
        if i == 0:
            return self.embeddings
        if i == len(self) - 1 and self.last is not None:
            return self.last
        return self.outputs[i - 1].unsqueeze(0)

    def __setitem__(self, i, value) -> None:
        if i not in (-1, len(self) - 1):
            raise IndexError("only the last entry (the final norm's output) is set")
        self.last = value

    def rows_of(self, layers, n: int) -> Optional[torch.Tensor]:
        """torch.cat([self[i + 1][0, :n] for i in layers], -1) as one gather ([n, len(layers) * D], a copy), or None
        where a layer asked for is the last (its entry is the final norm's output, not the buffer's)."""
        if any(not 0 <= i < self.outputs.shape[0] - 1 for i in layers):
            return None
        picked = self.outputs[list(layers), :n]  # [len(layers), n, D], a copy
        return picked.transpose(0, 1).reshape(n, -1)


def cache_applies(cache, num_layers: int) -> bool:
    layers = getattr(cache, "layers", None)
    return layers is not None and len(layers) == num_layers and all(type(l) is PositionalLayer for l in layers)


def for_drafter(model: torch.nn.Module, target) -> Optional["LlamaPass"]:
    """The direct pass for a drafter's Llama body (its own matmuls as its modules route them), where the target
    runs measured kernels (`--kernels stock` keeps transformers' own code everywhere) and the pass computes what
    `model(...)` would (`applies`: a CPU model among them); else None. Callers check `runs_on` on every pass."""
    return LlamaPass(model) if getattr(target, "kernels", "stock") != "stock" and applies(model) else None


def cache_ready(cache, num_layers: int) -> bool:
    """`cache_applies`, after giving a cache of no layers yet whose layers would be position-indexed
    (cache.full_cache) its layers up front."""
    if not cache.layers and getattr(cache, "layer_class_to_replicate", None) is PositionalLayer:
        cache.layers.extend(PositionalLayer() for _ in range(num_layers))
    return cache_applies(cache, num_layers)


def _stacked(packs) -> Optional[PackedWeight]:
    """One PackedWeight of the given packs' output rows stacked (all of one kind), or None."""
    if any(p is None for p in packs) or len({p.kind for p in packs}) != 1 \
            or len({p.q8 is None for p in packs}) != 1:
        return None
    offsets = None if packs[0].offsets is None else torch.cat([p.offsets for p in packs])
    stacked = PackedWeight(packs[0].kind, torch.cat([p.codes for p in packs]), torch.cat([p.scales for p in packs]),
                           offsets, ())
    if packs[0].q8 is not None:  # q8_linear.c's layout is per output row too: stacked the same way
        stacked = dataclasses.replace(stacked, q8=Q8Weight.stacked([p.q8 for p in packs], stacked))
    return stacked


def _rows_of(stacked: PackedWeight, start: int, end: int, source: tuple) -> PackedWeight:
    """Output rows [start, end) of a stacked pack, as views (contiguous: whole rows), for the layer whose weight
    `source` describes."""
    offsets = None if stacked.offsets is None else stacked.offsets[start:end]
    view = PackedWeight(stacked.kind, stacked.codes[start:end], stacked.scales[start:end], offsets, source)
    if stacked.q8 is not None:
        view = dataclasses.replace(view, q8=stacked.q8.rows(start, end, view))
    return view


class _SameInput:
    """Linear layers that take the same input (q/k/v; gate/up; or one layer alone), run as one packed kernel call
    where each is packed and the plan routes each to the packed kernel for the pass's row count (bitwise the same
    outputs: the kernel sums each output alone); otherwise each through its own forward (kernels.py's routed one
    where installed). The layers' packs are stacked into one buffer once, and each layer is given views of its rows
    of it in place of its own pack (one copy of the codes, which its routed forward reads as before). Like the
    routed forwards, it runs a layer's pack as long as the layer holds it (`packed_weight`); a layer packed again
    is stacked again."""

    def __init__(self, mods, plan=None):
        self.mods = mods
        shapes = [tuple(m.weight.shape) for m in mods]
        # the plan is fixed: the row counts it runs every one of these layers through the packed kernel
        self.rows = frozenset(r for r in range(1, ROW_BUCKETS[-1] + 1)
                              if plan is not None and all(plan.uses_packed(s, r) for s in shapes))
        # --kernels q8: the packed kernel is the arithmetic itself, at every row count (a long prompt's prefill too)
        self.every_row = plan is not None and plan.q8
        self.state = (None, None)  # (the layers' packs when last looked at, their stacked pack or None)

    def packed_for(self, rows: int) -> Optional[PackedWeight]:
        """The layers' packs as one, where this pass's row count runs every layer through the packed kernel."""
        if rows not in self.rows and not self.every_row:
            return None
        packs, stacked = self.state
        for i, mod in enumerate(self.mods):  # (a plain loop: this runs 120 times a step)
            held = mod.__dict__
            if "forward" not in held:  # kernels.stock_kernels: F.linear, as transformers
                return None
            if packs is None or held.get("packed_weight") is not packs[i]:  # first use, or packed again
                return self._stack()
        return stacked

    def _stack(self) -> Optional[PackedWeight]:
        packs = tuple(current_pack(m) for m in self.mods)
        stacked = None
        if all(p is not None for p in packs):
            stacked = packs[0] if len(packs) == 1 else _stacked(packs)
        if stacked is not None and len(packs) > 1:  # each layer keeps views of its rows of the one buffer
            ends = [sum(p.shape[0] for p in packs[:i + 1]) for i in range(len(packs))]
            packs = tuple(_rows_of(stacked, end - p.shape[0], end, p.source) for p, end in zip(packs, ends))
            for mod, view in zip(self.mods, packs):
                mod.packed_weight = view
            routing_changed()
        else:
            packs = tuple(getattr(m, "packed_weight", None) for m in self.mods)
        self.state = (packs, stacked)
        return stacked

    def __call__(self, x: torch.Tensor, rows: int):
        """One tensor of all the layers' outputs side by side (one packed call), else a list of each one's."""
        packed = self.packed_for(rows) if x.dtype == torch.float32 and x.is_cpu else None
        if packed is not None:
            return run_pack(x, packed)
        return [m.forward(x) for m in self.mods]

    def one(self, x: torch.Tensor, rows: int) -> torch.Tensor:
        """The output of a group of one layer."""
        out = self(x, rows)
        return out if isinstance(out, torch.Tensor) else out[0]


def _rms_norm(x: torch.Tensor, norm) -> torch.Tensor:
    """transformers' LlamaRMSNorm: in float32, `weight * (x * rsqrt(mean(x^2) + eps))`. For float32 rows that is
    torch's own rms_norm on a CPU, the same operations on the same values (pow, mean, add, rsqrt, mul, mul by the
    weight) in one call; other dtypes go through float32 as transformers does."""
    if x.dtype == torch.float32 and norm.weight.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), norm.weight, norm.variance_epsilon)
    dtype = x.dtype  # torch's rms_norm without a weight: the same operations on the float32 rows, in one call
    h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, norm.variance_epsilon)
    return norm.weight * h.to(dtype)


class RotaryTable:
    """The rotary embeddings' cos and sin of positions 0 .. P - 1, made by the model's own rotary module in one call
    and cut per pass (a pass's rows of it; P doubles when a pass goes past it). Bitwise the module's own rows: a row
    depends only on its position (one product per frequency, then cos and sin elementwise; measured over 3,000 passes
    of 1-33 rows at random positions up to 8,192), so the cut rows are what the module gives that pass. The call cost
    ~0.15 ms a one-row step (seven torch operations whose code the weights' stream had pushed out of cache); a cut
    costs microseconds. Only for rotary kinds computed once (not "dynamic" or "longrope", which rescale with the
    sequence's length: `rows` answers None, and the module runs as before). Made anew when the module's inverse
    frequencies change (another tensor, or the same one changed in place where it has a version: a tensor made under
    inference mode has none), or the rows' dtype or device."""

    MIN_POSITIONS = 1024

    def __init__(self, rotary: torch.nn.Module):
        self.rotary = rotary
        rope_type = getattr(rotary, "rope_type", None)
        self.applies = rope_type in ("default", "linear", "llama3") and isinstance(
            getattr(rotary, "inv_freq", None), torch.Tensor)
        self._key, self._cos, self._sin = None, None, None

    def rows(self, h: torch.Tensor, start: int, n: int) -> Optional[tuple]:
        """(cos, sin) [1, n, head dim] of positions start .. start + n - 1 in h's dtype and device, or None."""
        if not self.applies:
            return None
        inv = self.rotary.inv_freq
        # the tensor itself (held, compared by identity: its address cannot pass to another), its version where it
        # has one, the rows' dtype and device
        state = (None if inv.is_inference() else inv._version, inv.device, h.dtype, h.device,
                 getattr(self.rotary, "attention_scaling", None))
        same = self._key is not None and self._key[0] is inv and self._key[1] == state
        if not same or self._cos.shape[1] < start + n:
            positions = max(self.MIN_POSITIONS, 1 << (start + n - 1).bit_length(), self._cos.shape[1] if same else 0)
            self._cos, self._sin = self.rotary(h, position_ids=torch.arange(positions, device=h.device).unsqueeze(0))
            self._key = (inv, state)
        return self._cos[:, start:start + n], self._sin[:, start:start + n]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(frozen=True)
class _Layer:
    """A decoder layer's parts, looked up once (a module's submodules and parameters cost a __getattr__ each)."""

    input_norm: torch.nn.Module
    qkv: _SameInput
    scaling: float
    o_proj: _SameInput
    post_norm: torch.nn.Module
    gate_up: _SameInput
    down_proj: _SameInput
    ffn: int  # gate_proj's outputs


class LlamaPass:
    """`forward` for one model (its layers' parts and layer groups found once)."""

    def __init__(self, model: torch.nn.Module, plan=None, fused: bool = True):
        self.model = model
        plan = plan if plan is not None and any(plan.packed_rows.values()) else None
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = _head_dim(cfg)
        inner = model.model
        self.embed, self.rotary, self.norm, self.head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.layers = [_Layer(l.input_layernorm,
                              _SameInput([l.self_attn.q_proj, l.self_attn.k_proj, l.self_attn.v_proj], plan),
                              l.self_attn.scaling, _SameInput([l.self_attn.o_proj], plan), l.post_attention_layernorm,
                              _SameInput([l.mlp.gate_proj, l.mlp.up_proj], plan), _SameInput([l.mlp.down_proj], plan),
                              l.mlp.gate_proj.weight.shape[0])
                       for l in inner.layers]
        # every layer of a pass in one C call where all run packed (fused_layers.py: rows invariant, not bitwise
        # transformers' own)
        self.fused = FusedLayers(self.layers, self.heads, self.kv_heads, self.head_dim, cfg.hidden_size,
                                 final_norm=self.norm) if fused and plan is not None else None
        self.rotary_table = RotaryTable(self.rotary)
        if self.fused is not None and not self.fused.fits:
            self.fused = None

    def runs_on(self, cache) -> bool:
        """Whether a pass on `cache` (None: no cache) computes what the model would now: `still_applies`, and a
        cache of position-indexed layers (`cache_ready` gives one of no layers yet its layers first)."""
        return still_applies(self.model) and (cache is None or cache_ready(cache, len(self.layers)))

    def __call__(self, **inputs):
        """Called as the model is (`model(input_ids=..., ...)`), so callers that run either take either."""
        return self.forward(**inputs)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, past_key_values=None, use_cache: bool = True,
                output_hidden_states: bool = False, logits_to_keep=0, attention_mask: Optional[torch.Tensor] = None,
                position_ids: Optional[torch.Tensor] = None):
        """As `model(input_ids=..., past_key_values=..., use_cache=True, output_hidden_states=...,
        logits_to_keep=..., attention_mask=..., position_ids=...)`: .logits [1, kept rows, V] and .hidden_states
        (the embeddings, then each layer's output, the last one normed) when asked.

        `attention_mask`: a boolean [1, 1, n, keys] mask (True: may attend), used as given, as transformers uses a
        4-D mask (the diffusion drafters' block-causal and bidirectional masks); without one, causal.
        `past_key_values=None` (or `use_cache=False`): no cache, the pass's own keys only (the masked-diffusion
        drafter's passes), at `position_ids` where given ([1, n]; else the positions after the cache)."""
        cache = past_key_values if use_cache else None
        n = input_ids.shape[1]
        start = cache.layers[0].get_seq_length() if cache is not None else 0
        if attention_mask is not None and (attention_mask.dtype != torch.bool or attention_mask.dim() != 4
                                           or tuple(attention_mask.shape) != (1, 1, n, start + n)):
            raise ValueError(f"the direct pass takes a boolean attention mask of shape (1, 1, {n}, {start + n}), "
                             f"got {attention_mask.dtype} {tuple(attention_mask.shape)}")
        h = F.embedding(input_ids, self.embed.weight, self.embed.padding_idx)
        rows = self.rotary_table.rows(h, start, n) if position_ids is None else None
        if rows is not None:
            cos, sin = rows
        else:
            if position_ids is None:
                position_ids = torch.arange(start, start + n).unsqueeze(0)
            cos, sin = self.rotary(h, position_ids=position_ids)
        fused = self.fused.run(h[0], cos[0], sin[0], cache.layers, start, output_hidden_states) \
            if (self.fused is not None and input_ids.shape[0] == 1 and attention_mask is None
                and cache is not None) else None
        if fused is not None:
            last, outputs, normed = fused
            hidden = LayerOutputs(h, outputs) if outputs is not None else None
            return self._head(last.unsqueeze(0), hidden, logits_to_keep,
                              normed=normed.unsqueeze(0) if normed is not None else None)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        if attention_mask is not None:  # as given (transformers returns a 4-D mask as is)
            mask, causal = attention_mask, False
        elif n == 1:
            mask, causal = None, False
        elif start == 0:
            mask, causal = None, True
        else:  # row i sees positions up to start + i (transformers' sdpa mask, boolean)
            mask = (torch.arange(start + n) <= torch.arange(start, start + n)[:, None])[None, None]
            causal = False
        hidden = [h] if output_hidden_states else None
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        for layer, layer_cache in zip(self.layers, cache.layers if cache is not None else [None] * len(self.layers)):
            qkv = layer.qkv(_rms_norm(h, layer.input_norm), n)
            if isinstance(qkv, torch.Tensor):  # one packed call: rotate queries and keys in one go
                heads = qkv.view(1, n, H + 2 * KV, D).transpose(1, 2)
                qk = heads[:, :H + KV]
                qk = (qk * cos) + (_rotate_half(qk) * sin)
                q, k, v = qk[:, :H], qk[:, H:], heads[:, H + KV:]
            else:
                q, k, v = qkv
                q = q.view(1, n, H, D).transpose(1, 2)
                k = k.view(1, n, KV, D).transpose(1, 2)
                v = v.view(1, n, KV, D).transpose(1, 2)
                q = (q * cos) + (_rotate_half(q) * sin)
                k = (k * cos) + (_rotate_half(k) * sin)
            keys, values = layer_cache.update(k, v) if layer_cache is not None else (k, v)
            o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, dropout_p=0.0, scale=layer.scaling,
                                               is_causal=causal, enable_gqa=KV != H)
            o = o.transpose(1, 2).reshape(1, n, -1)  # a copy where transformers' .contiguous() makes one
            h = h + layer.o_proj.one(o, n)
            gate_up = layer.gate_up(_rms_norm(h, layer.post_norm), n)
            if isinstance(gate_up, torch.Tensor):
                gate, up = gate_up[..., :layer.ffn], gate_up[..., layer.ffn:]
            else:
                gate, up = gate_up
            h = h + layer.down_proj.one(F.silu(gate) * up, n)
            if hidden is not None:
                hidden.append(h)
        return self._head(h, hidden, logits_to_keep)

    def _head(self, h: torch.Tensor, hidden: Optional[list], logits_to_keep, normed: Optional[torch.Tensor] = None):
        """The final norm (unless the fused call gave its rows: `normed`) and the output head over the rows kept."""
        h = normed if normed is not None else _rms_norm(h, self.norm)
        if hidden is not None:
            hidden[-1] = h
        if isinstance(logits_to_keep, int):
            kept = h[:, -logits_to_keep:, :] if logits_to_keep else h
        else:
            kept = h[:, logits_to_keep, :]
        logits = self.head.forward(kept) if kept.shape[1] else h.new_empty(1, 0, self.head.weight.shape[0])
        return SimpleNamespace(logits=logits, hidden_states=hidden if isinstance(hidden, LayerOutputs)
                               else tuple(hidden) if hidden is not None else None)
