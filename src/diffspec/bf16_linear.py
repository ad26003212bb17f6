"""bfloat16 linear layers for the drafters' few-row passes on a CPU (issue 19: the drafters' passes at the
hardware's limit).

A drafter computing in bfloat16 (drafters/dtype_choice.py) runs its matmuls on 1-16 rows. PyTorch hands those
to oneDNN, which on a 2-core AVX-512 EPYC streamed the weights at ~10 GB/s in a real pass (the conditioned
drafter's 8192-row head: 0.96 ms for 7 rows; 0.38 ms when the same weight sat in cache), where the memory gives
~30. bf16_linear.c reads the weight in tiles of 16 output rows laid out in the order it streams them, and
multiplies with AVX512-BF16's pair dot products where the CPU has them (float32 FMAs elsewhere).

- `pack(weight)`: a bf16 [N, K] weight (K even) as the kernel's tiles (N padded to a multiple of 16 with zero
  rows); `Bf16Weight.source` records what it was packed from.
- `linear(x, packed)`: x [.., K] bf16 -> [.., N] bf16 (float32 sums, rounded once, as torch's bf16 matmul);
  through the kernel where it was built here, else `x @ W^T`.
- `available()`: None where the kernel runs here, else why not.

A product of two bfloat16 values is exact in float32, so what the kernel changes against torch's bf16 matmul
is only the order of the float32 sums (and the rounding of subnormals): drafts, never the output, which the
target verifies.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .packed_linear import NATIVE, KernelUnavailable, compile_and_load

SOURCE = Path(__file__).with_name("bf16_linear.c")
TILE = 16


@functools.lru_cache(maxsize=None)
def build_library(isa_flags: tuple = NATIVE):
    lib = compile_and_load(SOURCE, "bf16-linear", isa_flags)
    if isinstance(lib, KernelUnavailable):
        return lib
    lib.diffspec_bf16_isa.restype = ctypes.c_char_p
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.diffspec_bf16_linear.argtypes = [ptr, i64, i64, ptr, i64, ptr, ctypes.c_int]
    lib.diffspec_bf16_linear.restype = None
    return lib


def available() -> Optional[str]:
    """None where the kernel can run here, else why not."""
    lib = build_library()
    return str(lib) if isinstance(lib, KernelUnavailable) else None


def isa(lib=None) -> str:
    lib = lib or build_library()
    if isinstance(lib, KernelUnavailable):
        raise lib
    return lib.diffspec_bf16_isa().decode()


@dataclass(frozen=True, eq=False)
class Bf16Weight:
    """W [n, k] bf16 as tiles [ceil(n/16), k/2, 16, 2] (rows past n zero)."""

    tiles: torch.Tensor
    n: int
    k: int


@torch.no_grad()
def pack(weight: torch.Tensor) -> Optional[Bf16Weight]:
    """The kernel's layout of a bf16 CPU weight [N, K] with K even; None for any other weight."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[1] % 2:
        return None
    n, k = weight.shape
    padded = weight.detach()
    if n % TILE:
        padded = torch.cat([padded, padded.new_zeros(TILE - n % TILE, k)])
    tiles = padded.view(-1, TILE, k // 2, 2).transpose(1, 2).contiguous()
    return Bf16Weight(tiles, n, k)


def run_kernel(x: torch.Tensor, w: Bf16Weight, lib=None) -> torch.Tensor:
    """x [R, K] bf16 -> float32 [R, padded N] through the C kernel."""
    lib = lib or build_library()
    if isinstance(lib, KernelUnavailable):
        raise lib
    if not x.is_contiguous():
        x = x.contiguous()
    rows, padded = x.numel() // w.k, w.tiles.shape[0] * TILE
    y = torch.empty(rows, padded, dtype=torch.float32)
    lib.diffspec_bf16_linear(x.data_ptr(), rows, w.k, w.tiles.data_ptr(), padded, y.data_ptr(),
                             torch.get_num_threads())
    return y


@torch.library.custom_op("diffspec::bf16_linear", mutates_args=())
def _bf16_linear(x: torch.Tensor, tiles: torch.Tensor, n: int) -> torch.Tensor:
    """The kernel as an operator torch.compile can trace a graph around."""
    k = x.shape[-1]
    y = run_kernel(x.reshape(-1, k), Bf16Weight(tiles, n, k))
    return y[:, :n].to(torch.bfloat16).reshape(*x.shape[:-1], n)


@_bf16_linear.register_fake
def _(x, tiles, n):
    return x.new_empty(*x.shape[:-1], n)


def linear(x: torch.Tensor, w: Bf16Weight) -> torch.Tensor:
    """x [.., K] bf16 @ W^T -> [.., N] bf16."""
    if torch.compiler.is_compiling():
        return _bf16_linear(x, w.tiles, w.n)
    y = run_kernel(x.reshape(-1, w.k), w)
    if y.shape[1] != w.n:
        y = y[:, : w.n]
    return y.to(torch.bfloat16).reshape(*x.shape[:-1], w.n)


def install(model: torch.nn.Module) -> int:
    """Route every bf16 `nn.Linear` of a CPU model through the kernel (a drafter's body computing in bf16; the
    block-diffusion drafter). Each layer keeps its pack with the state of the weight it was made from
    (packed_linear.weight_state); a layer whose weight has since changed (moved, cast, edited) runs F.linear.
    Returns how many layers were routed; none where the kernel cannot run here."""
    import types

    from .packed_linear import weight_state

    if available() is not None:
        return 0
    routed = 0
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear) and (packed := pack(mod.weight)) is not None:
            mod.bf16_packed = (packed, weight_state(mod.weight))
            mod.forward = types.MethodType(_routed_forward, mod)
            routed += 1
    return routed


def _routed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    from .packed_linear import weight_state

    packed, source = self.bf16_packed
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or source != weight_state(self.weight):
        return torch.nn.functional.linear(x, self.weight, self.bias)
    y = linear(x, packed)
    return y + self.bias if self.bias is not None else y
