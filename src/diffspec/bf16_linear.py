"""bfloat16 linear layers for the drafters' few-row passes on a CPU (issue 19: the drafters' passes at the
hardware's limit).

A drafter computing in bfloat16 (drafters/dtype_choice.py) runs its matmuls on 1-16 rows. PyTorch hands those
to oneDNN, which on a 2-core AVX-512 EPYC streamed the weights at ~10 GB/s in a real pass (the conditioned
drafter's 8192-row head: 0.96 ms for 7 rows; 0.38 ms when the same weight sat in cache), where the memory gives
~30. bf16_linear.c reads the weight in tiles of 16 output rows laid out in the order it streams them, and
multiplies with AVX512-BF16's pair dot products where the CPU has them (float32 FMAs elsewhere).

- `pack(weight)`: a bf16 [N, K] weight (K even) as the kernel's tiles (N padded to a multiple of 16 with zero
  rows); `Bf16Weight.source` records what it was packed from.
- `linear(x, packed, bias=None)`: x [.., K] bf16 -> [.., N] bf16 (float32 sums, rounded once, as torch's bf16
  matmul) through the kernel; callers pack only where `available()` (and `faster_here`) said so.
- `available()`: None where the kernel runs here, else why not.
- `faster_here(weights, rows)`: whether the kernel beat torch's bf16 matmul over these weights at this many
  rows on this machine (timed once per machine x shapes x rows, cached beside the cost tables). It won by
  1.5-3x at 1-16 rows on an AVX-512 EPYC; where oneDNN has AMX tiles, or a future torch, it may not: measured,
  not assumed. `install` and the conditioned drafter's pass use the kernel only where it did.

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

from .packed_linear import NATIVE, KernelUnavailable, compile_and_load, routing_changed

SOURCE = Path(__file__).with_name("bf16_linear.c")
TILE = 16
MARGIN = 0.9  # the kernel is taken where it timed at least 1/MARGIN faster than torch's matmul
FORMAT = 1
_decided: dict = {}


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


def _check_rows(x: torch.Tensor, w: Bf16Weight) -> None:
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or x.shape[-1] != w.k \
            or w.tiles.dtype != torch.bfloat16 or w.tiles.device.type != "cpu":
        raise ValueError(f"bf16_linear takes bf16 CPU rows of {w.k} and a bf16 CPU pack, got {x.dtype} rows of "
                         f"{x.shape[-1]} on {x.device.type}")


def run_kernel(x: torch.Tensor, w: Bf16Weight, lib=None) -> torch.Tensor:
    """x [R, K] bf16 on the CPU -> float32 [R, padded N] through the C kernel."""
    lib = lib or build_library()
    if isinstance(lib, KernelUnavailable):
        raise lib
    _check_rows(x, w)
    if not x.is_contiguous():
        x = x.contiguous()
    rows, padded = x.numel() // w.k, w.tiles.shape[0] * TILE
    y = torch.empty(rows, padded, dtype=torch.float32)
    lib.diffspec_bf16_linear(x.data_ptr(), rows, w.k, w.tiles.data_ptr(), padded, y.data_ptr(),
                             torch.get_num_threads())
    return y


@torch.library.custom_op("diffspec::bf16_linear", mutates_args=())
def _bf16_linear(x: torch.Tensor, tiles: torch.Tensor, n: int, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernel as an operator torch.compile can trace a graph around."""
    return _eager_linear(x, Bf16Weight(tiles, n, tiles.shape[1] * 2), bias)


@_bf16_linear.register_fake
def _(x, tiles, n, bias):
    torch._check(x.shape[-1] == tiles.shape[1] * 2)
    return x.new_empty(*x.shape[:-1], n, dtype=torch.bfloat16)


def _eager_linear(x: torch.Tensor, w: Bf16Weight, bias: Optional[torch.Tensor]) -> torch.Tensor:
    _check_rows(x, w)
    y = run_kernel(x.reshape(-1, w.k), w)
    if y.shape[1] != w.n:
        y = y[:, : w.n]
    if bias is not None:  # added to the float32 sums: one rounding, as torch's bf16 linear
        y = y + bias.float()
    return y.to(torch.bfloat16).reshape(*x.shape[:-1], w.n)


def linear(x: torch.Tensor, w: Bf16Weight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x [.., K] bf16 on the CPU @ W^T (+ bias) -> [.., N] bf16 (float32 sums, rounded once), through the kernel;
    raises where it is not built (`available()` says why) or x is not bf16 CPU rows of K."""
    if torch.compiler.is_compiling():
        return _bf16_linear(x, w.tiles, w.n, bias)
    return _eager_linear(x, w, bias)


def _choice_path(shapes: list, rows: int):
    import hashlib

    from .machine_keys import cache_key, cost_dir, machine_key

    source = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    key = cache_key("bf16-linear-choice", FORMAT, machine_key(torch.device("cpu")), shapes, rows, MARGIN, source,
                    torch.__version__)
    return cost_dir() / f"bf16-linear-choice-{key}.json"


@torch.inference_mode()
def faster_here(weights: list, rows: int, reps: int = 7) -> bool:
    """Whether the kernel computes `rows` rows through `weights` (bf16 CPU matrices, in sequence, as a pass streams
    them) at least 1/MARGIN faster than torch's F.linear on this machine. Timed interleaved (min over turns of each
    turn's time) once per machine x shapes x rows, then read from the cost cache."""
    import json
    import time

    from .output import try_write_cache

    if available() is not None or not weights:
        return False
    shapes = sorted([list(w.shape) for w in weights])
    memo = (tuple(map(tuple, shapes)), rows)
    if memo in _decided:
        return _decided[memo]
    path = _choice_path(shapes, rows)
    try:
        record = json.loads(path.read_text())
        if record.get("format") == FORMAT:
            _decided[memo] = bool(record["kernel"])
            return _decided[memo]
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    packs = [pack(w) for w in weights]
    if any(p is None for p in packs):
        return False
    xs = {w.shape[1]: torch.randn(rows, w.shape[1]).bfloat16() for w in weights}

    def by_torch():
        for w in weights:
            torch.nn.functional.linear(xs[w.shape[1]], w)

    def by_kernel():
        for p in packs:
            linear(xs[p.k], p)

    best = {"torch": float("inf"), "kernel": float("inf")}
    for _ in range(reps):
        for name, run in (("torch", by_torch), ("kernel", by_kernel)):
            start = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - start)
    kernel = best["kernel"] < MARGIN * best["torch"]
    _decided[memo] = kernel
    try_write_cache(path, json.dumps({"format": FORMAT, "kernel": kernel, "shapes": shapes, "rows": rows,
                                      "torch_us": round(best["torch"] * 1e6, 1),
                                      "kernel_us": round(best["kernel"] * 1e6, 1)}), "the bf16 kernel choice")
    return kernel


def install(model: torch.nn.Module, rows: int = 16) -> int:
    """Route every bf16 `nn.Linear` of a CPU model through the kernel (a drafter's body computing in bf16; the
    block-diffusion drafter), where it measured faster here at `rows` rows (`faster_here`). Each layer keeps its
    pack with the state of the weight it was made from (packed_linear.weight_state); a layer whose weight has
    since changed (moved, cast, edited) runs F.linear. Returns how many layers were routed."""
    import types

    from .packed_linear import output_head, weight_state

    if available() is not None:
        return 0
    head = output_head(model)
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16
              and m.weight.device.type == "cpu" and m is not head]  # the body's (a vocabulary-wide head: a copy
    #                                                               as large as the embeddings, for a head a drafter
    #                                                               with a draft vocabulary never calls)
    if not faster_here([m.weight for m in layers], rows):
        return 0
    routed = 0
    for mod in layers:
        # a layer routed before keeps its pack while its weight is unchanged (the block drafter routes again after
        # kernels.install has replaced the forwards: no second copy of the weights)
        state = weight_state(mod.weight)
        previous = mod.__dict__.get("bf16_packed")
        packed = previous[0] if previous is not None and previous[1] == state else pack(mod.weight)
        if packed is not None:
            mod.bf16_packed = (packed, state)
            mod.forward = types.MethodType(_routed_forward, mod)
            routed += 1
    routing_changed()  # (a bf16 model's layers: never a fused float32 target's, but the epoch is the rule)
    return routed


def _routed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    from .packed_linear import weight_state

    packed, source = self.bf16_packed
    if x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return torch.nn.functional.linear(x, self.weight, self.bias)
    # a compiled graph is valid for one model and dtype (compile_choice._valid); the storage check (data_ptr, which
    # dynamo cannot trace: a graph break at every layer) runs in eager passes
    if not torch.compiler.is_compiling() and source != weight_state(self.weight):
        return torch.nn.functional.linear(x, self.weight, self.bias)
    return linear(x, packed, self.bias)
