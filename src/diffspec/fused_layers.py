"""Every decoder layer of a pass in one C call, for Llama-architecture targets whose weights are GGUF codes (issue 19).

With the matmuls reading GGUF codes (packed_linear.py) and transformers' Python gone (llama_pass.py), a one-row
step of SmolLM2-135M on a 2-core CPU still spent about half its time outside the matmuls: ~20 torch operations
a layer (RMSNorm, rotary embeddings, the cache write, SDPA, SiLU, residuals), each a few microseconds of
dispatch for a few hundred floats of work. fused_layers.c does a whole pass's layers in one call, the matmuls
through the same packed kernel (compiled into it).

What changes, and what does not:
- every row of a pass is computed by the same operations whatever the pass's width (the kernel sums each output
  alone; the rest is per row or per row and head), so a row's logits are bitwise the same in a one-row step and in
  a verify pass: speculative output stays equal to plain decoding (tested, bitwise, at every width);
- against transformers' (and llama_pass's torch) operations, RMSNorm's and attention's sums and the exponential
  differ in the last bits (logits within ~2e-5 on SmolLM2), so a greedy argmax between two near-tied tokens can differ from
  transformers' `generate`; the README measures the match rate. `--kernels multi-row` leaves one-row steps to
  transformers' own arithmetic (the fused call never takes a width the plan does not run packed).

It runs a pass of one sequence where every layer's q/k/v, output, gate/up and down products run packed at that width
(the plan, kernels.py), the cache's layers are position-indexed float32 buffers, and the library builds here;
otherwise llama_pass's torch operations run it, as before.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
from pathlib import Path
from typing import Optional, Sequence

import torch

from . import packed_linear, q8_linear
from .cache import PositionalLayer
from .packed_linear import NATIVE, KernelUnavailable, compile_and_load

SOURCE = Path(__file__).with_name("fused_layers.c")
#: addresses per layer in the table the C function reads (its LAYER_FIELDS; checked when the library loads)
FIELDS = 17
#: the C function's MAX_HEAD_DIM
MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=None)
def build_library(isa_flags: tuple):
    """fused_layers.c (with the packed kernel) built with `isa_flags` and loaded, or a KernelUnavailable saying why not."""
    lib = compile_and_load(SOURCE, "fused-layers", isa_flags, includes=(packed_linear.SOURCE, q8_linear.SOURCE))
    if isinstance(lib, KernelUnavailable):
        return lib
    q8_linear.declare(lib)
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    lib.diffspec_fused_layer_fields.restype = lib.diffspec_fused_max_head_dim.restype = i64
    lib.diffspec_fused_work_floats.argtypes = [i64] * 7 + [ctypes.c_int]
    lib.diffspec_fused_work_floats.restype = i64
    lib.diffspec_fused_layers.argtypes = [i64, ptr, i64, i64, i64, i64, i64, i64, i64, f32, f32, ptr, ptr, ptr,
                                          ptr, ptr, ctypes.c_int, ctypes.c_int, ptr, f32, ptr, ctypes.c_int]
    lib.diffspec_half_round_check.argtypes = [ptr, i64, ptr, ptr]
    lib.diffspec_half_round_check.restype = None
    lib.diffspec_fused_layers.restype = None
    lib.diffspec_batch_attend.argtypes = [i64, i64, i64, i64, i64, ptr, i64, f32, ptr, ptr, ptr, ptr, ptr,
                                          ctypes.c_int]
    # the conditioned drafter's block and context (drafters/conditioned_fused.py)
    lib.diffspec_block_layers.argtypes = [i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, f32, f32, ptr, ptr, ptr,
                                          ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.diffspec_block_layers.restype = None
    lib.diffspec_block_context_work_floats.argtypes = [i64] * 5
    lib.diffspec_block_context_work_floats.restype = i64
    lib.diffspec_block_context.argtypes = [i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, ptr, ptr, ptr, f32,
                                           ptr, ptr, ptr, ptr, ctypes.c_int, ctypes.c_int]
    lib.diffspec_block_context.restype = None
    lib.diffspec_batch_attend.restype = None
    lib.diffspec_packed_isa.restype = ctypes.c_char_p
    lib.diffspec_fused_elementwise_check.argtypes = [ptr, ptr, i64, ptr, ptr, ptr, ptr]
    lib.diffspec_fused_elementwise_check.restype = None
    if (lib.diffspec_fused_layer_fields(), lib.diffspec_fused_max_head_dim()) != (FIELDS, MAX_HEAD_DIM):
        return KernelUnavailable(f"{SOURCE.name} and fused_layers.py disagree on the table's fields or the widest head")
    return lib


def kernel_key() -> str:
    """What identifies the fused pass's arithmetic (its source and the kernel's): cost tables and fingerprints."""
    return hashlib.sha256(SOURCE.read_bytes() + packed_linear.kernel_key().encode()
                          + q8_linear.kernel_key().encode()).hexdigest()[:16]


def _addresses(pack) -> tuple:
    """The codes, scales and offsets the call reads: q8_linear.c's layout where the pack has one (`--kernels q8`)."""
    pack = pack if pack.q8 is None else pack.q8
    return (pack.codes.data_ptr(), pack.scales.data_ptr(), 0 if pack.offsets is None else pack.offsets.data_ptr())


class FusedLayers:
    """The fused call for one LlamaPass's layers (llama_pass._Layer): `run` does a pass's layers, or returns None
    where it does not apply (then the torch operations run it)."""

    def __init__(self, layers: Sequence, heads: int, kv_heads: int, head_dim: int, hidden: int,
                 isa_flags: tuple = NATIVE, final_norm: Optional[torch.nn.Module] = None):
        if not layers:
            raise ValueError("fused layers: no decoder layers")
        self.lib = build_library(isa_flags)
        self.layers = list(layers)
        self.heads, self.kv_heads, self.head_dim, self.hidden = heads, kv_heads, head_dim, hidden
        self.ffn = self.layers[0].ffn
        norms = [m for l in self.layers for m in (l.input_norm, l.post_norm)]
        self.eps = float(norms[0].variance_epsilon)
        self.scale = float(self.layers[0].scaling)
        # one eps, scale and shape for every layer, float32 norms of the hidden width: else never
        self.fits = (all(float(m.variance_epsilon) == self.eps and m.weight.dtype == torch.float32
                         and m.weight.shape == (hidden,) for m in norms)
                     and all(float(l.scaling) == self.scale and l.ffn == self.ffn for l in self.layers)
                     and heads % kv_heads == 0 and head_dim % 2 == 0 and head_dim <= MAX_HEAD_DIM
                     and not isinstance(self.lib, KernelUnavailable))
        self.isa = self.lib.diffspec_packed_isa().decode() if self.fits else None
        self._norm_params = [m._parameters for l in self.layers for m in (l.input_norm, l.post_norm)]
        # the model's final RMSNorm, run at the end of the call where it is a float32 one of the hidden width (its
        # rows come back beside the last layer's; else None: the caller norms them)
        self.final_norm = final_norm if (final_norm is not None and hasattr(final_norm, "variance_epsilon")
                                         and final_norm.weight.dtype == torch.float32
                                         and final_norm.weight.shape == (hidden,)) else None
        self._held: tuple = ()   # what the table was built from (packs, norm weights, cache buffers), held so ids stay theirs
        self._table: Optional[torch.Tensor] = None
        self._q8 = False         # whether the table's packs are q8_linear.c's layout (`--kernels q8`)
        self._kv_half = False    # whether the table's cache buffers hold float16 keys and values
        self._kept: dict = {}    # row count -> its packs, found in routing epoch _kept_epoch (_packs)
        self._kept_epoch = -1

    def _packs(self, rows: int) -> Optional[list]:
        """Every layer's four packs at this row count (None: one of them is not packed at it). What `packed_for`
        answers depends only on each linear layer's own `forward` and `packed_weight` (their routing and their pack),
        and every function that changes either moves packed_linear's routing epoch: so a row count's answer is kept
        with the epoch it was found in and given again while the epoch stands (asking the 120 groups again cost
        ~0.3 ms of a ~9 ms step: their 210 layers' attributes, out of cache after the weights stream through)."""
        epoch = packed_linear.routing_epoch()
        if epoch != self._kept_epoch:  # routing or packs changed: nothing kept holds (nor holds old packs alive)
            self._kept, self._kept_epoch = {}, epoch
        if rows in self._kept:
            return self._kept[rows]
        packs = []
        for layer in self.layers:
            for group in (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj):
                pack = group.packed_for(rows)
                if pack is None:
                    return None
                packs.append(pack)
        if packed_linear.routing_epoch() == epoch:  # (asking may have stacked packs again: then ask next time too)
            self._kept[rows] = packs
        return packs

    def _table_for(self, packs: list, cache_layers) -> Optional[torch.Tensor]:
        """The C call's table of addresses (None: a cache buffer the call cannot write, or packs of both arithmetics:
        one pass runs one, `--kernels q8`'s or float32's; which one is `self._q8`). Built again whenever a pack,
        a norm's weight or a cache buffer is not the very tensor it was built from; all of them are held meanwhile,
        so no address in it can be freed."""
        held = self._held
        if held and (held[0] is packs or all(a is b for a, b in zip(held[0], packs))) \
                and all(c._keys is k and c._values is v for c, (k, v) in zip(cache_layers, held[1])) \
                and all(p["weight"] is w for p, w in zip(self._norm_params, held[2])):
            return self._table
        if len({p.q8 is None for p in packs}) != 1:
            return None
        KV, D = self.kv_heads, self.head_dim
        kv_dtype = cache_layers[0]._keys.dtype  # float32, or float16 (cache.PositionalLayer's `storage`)
        if kv_dtype not in (torch.float32, torch.float16):
            return None
        for c in cache_layers:
            shape = (1, KV, c._keys.shape[2], D)
            if any(b.dtype != kv_dtype or b.shape != shape or not b.is_contiguous() for b in (c._keys, c._values)):
                return None
        rows = []
        for i, (layer, cache) in enumerate(zip(self.layers, cache_layers)):
            qkv, o, gate_up, down = packs[4 * i: 4 * i + 4]
            rows.append([layer.input_norm.weight.data_ptr(), *_addresses(qkv), *_addresses(o),
                         layer.post_norm.weight.data_ptr(), *_addresses(gate_up), *_addresses(down),
                         cache._keys.data_ptr(), cache._values.data_ptr(), cache._keys.shape[2]])
        self._table = torch.tensor(rows, dtype=torch.int64)
        self._q8 = packs[0].q8 is not None
        self._kv_half = kv_dtype == torch.float16
        self._held = (packs, [(c._keys, c._values) for c in cache_layers], [p["weight"] for p in self._norm_params])
        return self._table

    def run(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_layers, start: int,
            hidden_states: bool) -> Optional[tuple]:
        """The layers over rows h [n, D] (float32, at positions start.., cos/sin [n, head dim]) on the cache's
        position-indexed layers -> (last layer's output [n, D], each layer's output [L, n, D] or None, the final
        norm's output [n, D] or None where `final_norm` is None), the cache's layers advanced by n; or None where the
        call does not apply (nothing is changed then but room made in the cache's buffers)."""
        n = h.shape[0]
        if not self.fits or h.dtype != torch.float32 or not h.is_cpu or h.dim() != 2 or h.shape[1] != self.hidden \
                or len(cache_layers) != len(self.layers):
            return None
        H, KV, D = self.heads, self.kv_heads, self.head_dim
        if cos.shape != (n, D) or sin.shape != (n, D) or cos.dtype != torch.float32 or sin.dtype != torch.float32:
            return None
        packs = self._packs(n)
        if packs is None:
            return None
        end = start + n
        for c in cache_layers:
            if type(c) is not PositionalLayer or c.get_seq_length() != start:
                return None
        for c in cache_layers:
            if not c.is_initialized:  # the buffers are made as a first pass's update would make them
                c.lazy_initialization(h.new_empty(1, KV, 0, D), h.new_empty(1, KV, 0, D))
            if c.capacity < end:
                c.reserve(end)
        table = self._table_for(packs, cache_layers)
        if table is None:
            return None
        lib = self.lib
        threads = torch.get_num_threads()
        x = h.clone(memory_format=torch.contiguous_format)  # the call writes the residual stream into it
        cos, sin = cos.contiguous(), sin.contiguous()
        work = torch.empty(lib.diffspec_fused_work_floats(n, self.hidden, H, KV, D, self.ffn, start + n, threads),
                           dtype=torch.float32)
        hidden = torch.empty(len(self.layers), n, self.hidden, dtype=torch.float32) if hidden_states else None
        norm = self.final_norm  # (weights can be replaced or cast between passes: taken only as they are now)
        if norm is not None and (norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous()
                                 or norm.weight.device.type != "cpu"):
            norm = None
        normed = torch.empty(n, self.hidden, dtype=torch.float32) if norm is not None else None
        lib.diffspec_fused_layers(len(self.layers), table.data_ptr(), n, start, self.hidden, H, KV, D, self.ffn,
                                  self.eps, self.scale, cos.data_ptr(), sin.data_ptr(), x.data_ptr(),
                                  0 if hidden is None else hidden.data_ptr(), work.data_ptr(), threads,
                                  int(self._q8), 0 if norm is None else norm.weight.data_ptr(),
                                  0.0 if norm is None else float(norm.variance_epsilon),
                                  0 if normed is None else normed.data_ptr(), int(self._kv_half))
        for c in cache_layers:
            c.advance(n)
        return x, hidden, normed


def available(isa_flags: tuple = NATIVE) -> bool:
    """Whether the library builds and loads here."""
    return not isinstance(build_library(isa_flags), KernelUnavailable)


def batch_attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, first: torch.Tensor, last: int,
                 scale: float, isa_flags: tuple = NATIVE) -> Optional[torch.Tensor]:
    """Attention of one query row per (row, head) of a batch (make-data's decode step, training/batch_step.py):
    q [B, H, hd], keys and values [B, KV, capacity, hd] (float32, contiguous, on the CPU), row b reading positions
    first[b] .. last -> out [B, H, hd]: softmax(q . k * scale) . v, each (row, head) summed by fused_layers.c's
    `attend` (a verify pass's arithmetic). None where the library does not build here or the inputs do not fit."""
    lib = build_library(isa_flags)
    if isinstance(lib, KernelUnavailable):
        return None
    B, H, hd = q.shape
    if (keys.dim() != 4 or keys.shape[0] != B or H % keys.shape[1] or keys.shape[3] != hd or values.shape != keys.shape
            or not 0 <= last < keys.shape[2] or hd > MAX_HEAD_DIM or first.shape != (B,)
            or any(t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() for t in (q, keys, values))):
        return None
    first = first.to(torch.int64).contiguous()
    if B and not (0 <= int(first.min()) and int(first.max()) <= last):
        return None
    threads = torch.get_num_threads()
    out = torch.empty_like(q)
    scores = torch.empty(threads * (last + 1), dtype=torch.float32)
    lib.diffspec_batch_attend(B, H, keys.shape[1], hd, keys.shape[2], first.data_ptr(), last, float(scale),
                              q.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), scores.data_ptr(),
                              threads)
    return out
