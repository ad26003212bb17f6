"""Linear layers over GGUF codes with 8-bit activations, llama.cpp's arithmetic (q8_linear.c; the target's
`--kernels q8`, kernels.q8_plan).

packed_linear.py keeps the float32 model's arithmetic: each weight decoded into float32, multiplied by float32
activations. That is what makes our plain decoding equal transformers' `generate`, and it is why a wide verify
pass is bound by float32 multiply-adds. Here each row of activations is quantized per block of 32 to 8-bit codes
(the scale max|x| / 127), and each block's product with the weight's codes is an exact integer sum (AVX-512 VNNI
where the CPU has it, AVX2's byte multiply-adds, or plain C), scaled once per block: the arithmetic llama.cpp
uses for the same GGUF. A different target arithmetic, not a reordering, so it is the target's option and every
pass uses it, plain decoding included: speculation stays exact against plain decoding with the same option
(every row is quantized alone and summed in one fixed order: a row's output is bitwise the same in a one-row step
and in a wide pass, and on every build).

`Q8Weight.of(packed)` lays a PackedWeight's codes out for the kernel (q8_linear.c's header says how);
`q8_linear(x, weight)` is F.linear with quantized activations.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .packed_linear import (BLOCK, NATIVE, KernelUnavailable, PackedWeight, _run_kernel, compile_and_load,
                            linear_groups, pack_model, routing_changed)

SOURCE = Path(__file__).with_name("q8_linear.c")


def kernel_key() -> str:
    """What identifies the 8-bit kernel's arithmetic (its source): cost tables and fingerprints."""
    return hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def build_library(isa_flags: tuple):
    """q8_linear.c compiled with `isa_flags` (cached per machine) and loaded, or a KernelUnavailable saying why not."""
    lib = compile_and_load(SOURCE, "q8-linear", isa_flags)
    if isinstance(lib, KernelUnavailable):
        return lib
    declare(lib)
    return lib


def declare(lib) -> None:
    """ctypes signatures of q8_linear.c's functions (also for a library that includes it: fused_layers.c)."""
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.diffspec_q8_isa.restype = ctypes.c_char_p
    lib.diffspec_q8_scale_count.argtypes = lib.diffspec_q8_xrow_bytes.argtypes = [i64]
    lib.diffspec_q8_scale_count.restype = lib.diffspec_q8_xrow_bytes.restype = i64
    lib.diffspec_q8_quantize.argtypes = [ptr, i64, i64, ptr, ctypes.c_int]
    lib.diffspec_q8_quantize.restype = None
    lib.diffspec_q8act_linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.diffspec_q8act_linear.restype = None


def library(isa_flags: tuple = NATIVE):
    lib = build_library(isa_flags)
    if isinstance(lib, KernelUnavailable):
        raise lib
    return lib


def isa(isa_flags: tuple = NATIVE) -> str:
    """'avx512vnni', 'avx2' or 'scalar': what the kernel was built for here."""
    return library(isa_flags).diffspec_q8_isa().decode()


def unavailable() -> Optional[str]:
    lib = build_library(NATIVE)
    return str(lib) if isinstance(lib, KernelUnavailable) else None


def _layout_sizes(k: int) -> tuple:
    nb = k // BLOCK
    groups, rest = divmod(nb, 16)
    pairs = (rest + 1) // 2
    return nb, groups, pairs


class NotHalfScales(ValueError):
    """A pack whose scales or offsets are not all float16 values (GGUF's are): q8_linear.c reads float16."""


def half_exactly(t: torch.Tensor, what: str) -> torch.Tensor:
    """t (float32) as float16, if every value is one (GGUF's Q8_0 and Q4_1 fields are), else NotHalfScales."""
    half = t.to(torch.float16)
    if not torch.equal(half.to(t.dtype), t):
        raise NotHalfScales(f"{what} are not all float16 values (a GGUF's are)")
    return half.contiguous()


@dataclass(frozen=True, eq=False)
class Q8Weight:
    """A PackedWeight's codes in q8_linear.c's layout: kind 'q4' or 'q8', codes uint8 [N, row bytes], scales and
    (Q4) offsets float16 [N, blocks] (the GGUF's own fields: a row streams the bytes the file holds; `of` refuses
    a pack whose scales are not float16 values). `packed`: the PackedWeight it came from."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor]
    packed: PackedWeight

    @property
    def shape(self):
        return self.packed.shape

    @staticmethod
    def stacked(weights: list, packed: PackedWeight) -> "Q8Weight":
        """The weights' output rows one after another (the layout is per row), for the stacked pack `packed`."""
        offsets = None if weights[0].offsets is None else torch.cat([w.offsets for w in weights])
        return Q8Weight(weights[0].kind, torch.cat([w.codes for w in weights]),
                        torch.cat([w.scales for w in weights]), offsets, packed)

    def rows(self, start: int, end: int, packed: PackedWeight) -> "Q8Weight":
        """Output rows [start, end) as views, for the pack `packed` of those rows."""
        offsets = None if self.offsets is None else self.offsets[start:end]
        return Q8Weight(self.kind, self.codes[start:end], self.scales[start:end], offsets, packed)

    @classmethod
    @torch.no_grad()
    def of(cls, packed: PackedWeight) -> "Q8Weight":
        n, k = packed.shape
        scales = half_exactly(packed.scales, "the scales")  # first: nothing laid out for a pack refused
        offsets = half_exactly(packed.offsets, "the offsets") if packed.kind == "q4" else None
        nb, groups, pairs = _layout_sizes(k)
        pad_blocks = 16 * groups + 2 * pairs - nb   # 0 or 1 zero block closing an odd pair
        if packed.kind == "q4":
            blocks = packed.codes.view(n, nb, BLOCK // 2)                              # byte j: code j | code j+16 << 4
            if pad_blocks:
                blocks = torch.cat([blocks, blocks.new_zeros(n, pad_blocks, BLOCK // 2)], 1)
            grouped = blocks[:, : 16 * groups].reshape(n, groups, 16, 4, 4).transpose(2, 3)  # [n, g, chunk, block, 4]
            paired = blocks[:, 16 * groups:]                                          # A's 16 bytes, then B's
            codes = torch.cat([grouped.reshape(n, -1), paired.reshape(n, -1)], 1)
        else:
            blocks = (packed.codes.view(n, nb, BLOCK).view(torch.uint8) ^ 0x80)          # code + 128
            if pad_blocks:
                blocks = torch.cat([blocks, torch.full((n, pad_blocks, BLOCK), 0x80, dtype=torch.uint8)], 1)
            grouped = blocks[:, : 16 * groups].reshape(n, groups, 16, 8, 4).transpose(2, 3)  # [n, g, chunk, block, 4]
            paired = blocks[:, 16 * groups:].reshape(n, pairs, 2, 2, 16).transpose(2, 3)    # [n, p, half, side, 16]
            codes = torch.cat([grouped.reshape(n, -1), paired.reshape(n, -1)], 1)
        return cls(packed.kind, codes.contiguous(), scales, offsets, packed)


@torch.no_grad()
def quantized_pack(weight: torch.Tensor) -> PackedWeight:
    """Any float weight [N, K] (K a multiple of 32) rounded to Q8_0 codes, laid out for this kernel too: per block of
    32 inputs, scale = max|w| / 127 rounded to float16 (as GGUF's Q8_0 stores it) and code = round(w / scale) within
    +-127. Not the weight's own values (a drafter's `--drafter-dtype q8`: what it drafts with is approximate, and the
    target verifies every token)."""
    w = weight.detach().to(device="cpu", dtype=torch.float32)
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 codes need rows of a multiple of {BLOCK} inputs, got {k}")
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    if not torch.isfinite(blocks).all():
        raise ValueError("Q8_0 codes need finite weights")
    # float16 scales: a block of magnitudes past float16's range (~8e6: none in a trained model) is refused, not
    # turned into infinities; a block whose largest magnitude is under ~4e-6 gets scale 0 and codes 0
    scales = (blocks.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    if torch.isinf(scales).any():
        raise ValueError(f"Q8_0 codes' float16 scales reach {torch.finfo(torch.float16).max:g}: a weight of "
                         f"magnitude {w.abs().max().item():.3g} is past them")
    scales = scales.float()
    codes = torch.round(blocks / torch.where(scales > 0, scales, torch.ones_like(scales))).clamp_(-127, 127)
    packed = PackedWeight("q8", codes.to(torch.int8).reshape(n, k).contiguous(), scales.reshape(n, -1).contiguous(),
                          None)
    return dataclasses.replace(packed, q8=Q8Weight.of(packed))


def quantize(x: torch.Tensor, lib=None, threads: Optional[int] = None) -> torch.Tensor:
    """x [R, K] float32 -> its rows quantized in q8_linear.c's layout, uint8 [R, xrow bytes]."""
    lib = lib or library()
    x = x.contiguous()
    r, k = x.shape
    out = torch.empty(r, lib.diffspec_q8_xrow_bytes(k), dtype=torch.uint8)
    lib.diffspec_q8_quantize(x.data_ptr(), r, k, out.data_ptr(), threads or torch.get_num_threads())
    return out


def dequantized_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies by in place of x [.., K]: each block of 32 rounded to dx * round(x * (1 / dx))
    (dx = max|x| / 127; codes 0 where 1 / dx is not finite), in torch (the tests' reference)."""
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = 1.0 / d
    inv = torch.where((d > 0) & torch.isfinite(inv), inv, torch.zeros_like(d))
    return (d * torch.round(blocks * inv)).reshape(x.shape)


def q8_linear(x: torch.Tensor, weight: Q8Weight, lib=None, threads: Optional[int] = None) -> torch.Tensor:
    """y = F.linear(x, W) for W = weight.packed.decode(), with x's rows quantized to 8 bits per block of 32."""
    lib = lib or library()
    n, k = weight.shape
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != k:
        raise ValueError(f"q8_linear takes float32 CPU rows of {k}, got {x.dtype} on {x.device.type}, {tuple(x.shape)}")
    rows = x.reshape(-1, k)
    threads = threads or torch.get_num_threads()
    xq = quantize(rows, lib, threads)
    y = torch.empty(rows.shape[0], n, dtype=torch.float32)
    lib.diffspec_q8act_linear(xq.data_ptr(), rows.shape[0], k, weight.codes.data_ptr(), weight.scales.data_ptr(),
                              0 if weight.offsets is None else weight.offsets.data_ptr(), n, y.data_ptr(), threads)
    return y.reshape(*x.shape[:-1], n)


def run_pack(x: torch.Tensor, weight: PackedWeight) -> torch.Tensor:
    """x @ W^T through the kernel the pack is for: float32 products (packed_linear.c), or 8-bit activations
    where the pack has this file's layout (`weight.q8`)."""
    if weight.q8 is not None:
        return q8_linear(x, weight.q8)
    return _run_kernel(x, weight.codes, weight.scales, weight.offsets)


def linear(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, W, bias) with 8-bit activations, W a pack with this file's layout."""
    if torch.compiler.is_compiling():
        raise RuntimeError("--kernels q8 runs eager passes only (its kernel is no torch.compile operator)")
    y = q8_linear(x, weight.q8)
    return y + bias if bias is not None else y


def pack_model_q8(model: torch.nn.Module, quiet: bool = True) -> list:
    """packed_linear.pack_model, then, where every linear layer is packed, each pack also laid out for this kernel
    (`PackedWeight.q8`; a weight shared by two layers, as a tied head, once). Returns the "N x K" shapes of the
    layers left unpacked (not GGUF codes, or codes whose scales are not float16 values; then nothing is laid out)."""
    pack_model(model, quiet=quiet)
    groups = linear_groups(model)
    missing = sorted({f"{n}x{k}" for (n, k), mods in groups.items() for mod in mods
                      if getattr(mod, "packed_weight", None) is None})
    if missing:
        return missing
    laid: dict = {}
    for (n, k), mods in groups.items():
        for mod in mods:
            packed = mod.packed_weight
            if id(packed) not in laid:
                try:
                    laid[id(packed)] = dataclasses.replace(packed, q8=Q8Weight.of(packed))
                except NotHalfScales as e:
                    missing.append(f"{n}x{k} ({e})")
                    laid[id(packed)] = None
    if missing:
        return sorted(set(missing))
    for mods in groups.values():
        for mod in mods:
            mod.packed_weight = laid[id(mod.packed_weight)]
    routing_changed()
    return []
