"""Linear layers that read the weights in the blocks a GGUF quantized them to, exactly (issue 19).

A model converted from a GGUF (the default target: SmolLM2-135M-Instruct, Q4_1 layers and a Q8_0
embedding, tied to the output head) is a float32 model whose every weight is a dequantized code:
Q4_1 `w = (d * q) + m` with q in 0..15, Q8_0 `w = d * q` with q in -128..127, d and m one pair for
each block of 32 inputs. A one-row step streams those 538 MB of float32 from memory; the same
weights as codes are 85 MB. `pack(weight)` finds such codes for a float32 weight (any source: it
reads the values, not the file) and checks that decoding them gives every weight back bitwise;
packed_linear.c then computes `x @ W^T` decoding each block into float32 registers, with the same
roundings as the float32 model's own dequantization. So the layer computes with exactly the float32
model's weights; what changes is only the order a dot product is summed in (as with any other
matmul kernel), and that order is the same for every row whatever the pass's width: a row's output is
bitwise equal in a one-row step and in a verify pass (tested), which no MKL formulation gave past 3 rows.

The C file is compiled once per machine with the system's C compiler (`$CC`, else `cc`) for its own
CPU (`-march=native`), under $DIFFSPEC_CACHE/kernels; without a compiler nothing is packed (kernels.py
then plans float32 kernels only, and says why).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

BLOCK = 32
SOURCE = Path(__file__).with_name("packed_linear.c")
FLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC")
NATIVE = ("-march=native",)  # the machine's own vector width (AVX-512, AVX2); tests also build ("-mavx2", "-mfma") and ()


@dataclass(frozen=True, eq=False)
class PackedWeight:
    """A [N, K] float32 weight as codes: kind 'q4' (codes uint8 [N, K/2], two 4-bit codes a byte: byte j of a
    block holds code j low and code j + 16 high; offsets float32 [N, K/32]) or 'q8' (codes int8 [N, K]; no
    offsets); scales float32 [N, K/32]. `source`: what the weight was when packed (`weight_state`): a pack
    whose weight has since changed (moved, cast, copied, edited in place) is stale (`current_pack`)."""

    kind: str
    codes: torch.Tensor
    scales: torch.Tensor
    offsets: Optional[torch.Tensor]
    source: tuple = ()
    #: the same codes laid out for q8_linear.c (a q8_linear.Q8Weight): where set (`--kernels q8`), every product
    #: with this weight quantizes its activations to 8 bits (llama.cpp's arithmetic; q8_linear.run_pack)
    q8: Optional[object] = None

    @property
    def shape(self):
        n, width = self.codes.shape
        return (n, width * 2 if self.kind == "q4" else width)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.offsets) if t is not None)

    def decode(self) -> torch.Tensor:
        """The float32 weight, decoded as the kernel does (scale times code, rounded; plus the offset, rounded)."""
        n, k = self.shape
        if self.kind == "q4":
            c = self.codes.view(n, k // BLOCK, BLOCK // 2)
            q = torch.cat((c & 15, c >> 4), dim=-1).float()
            return ((self.scales[..., None] * q) + self.offsets[..., None]).reshape(n, k)
        q = self.codes.view(n, k // BLOCK, BLOCK).float()
        return (self.scales[..., None] * q).reshape(n, k)


def weight_state(weight: torch.Tensor) -> tuple:
    """What a pack of `weight` depends on: its storage, dtype, device and in-place version."""
    return (weight.data_ptr(), weight.dtype, weight.device.type, tuple(weight.shape), version_of(weight))


def version_of(t: torch.Tensor) -> Optional[int]:
    """A tensor's in-place version; None for an inference tensor (one made under `torch.inference_mode()`, e.g. a
    model built or loaded there), which keeps no version counter: an in-place edit of it (possible only inside
    inference mode) is not seen, as an edit through `p.data` is not."""
    return None if t.is_inference() else t._version


def module_state(module: torch.nn.Module) -> tuple:
    """What a computation from `module`'s tensors depends on: for each parameter and buffer in its tree, its identity,
    storage, in-place version, dtype, device, shape and strides. An edit in place through `p.data` (`p.data.mul_()`)
    changes none of them: it is not seen; assigning `p.data = t`, a new Parameter or module, an in-place op on a
    Parameter and a dtype change are. The tree is walked by hand (`model.parameters()` took 2.5x as long: 2.8 ms on
    SmolLM2)."""
    state, stack = [], [module]
    while stack:
        m = stack.pop()
        stack.extend(c for c in m._modules.values() if c is not None)
        for t in (*m._parameters.values(), *m._buffers.values()):
            if t is not None:
                state.append((id(t), t.data_ptr(), version_of(t), t.dtype, t.device, t.shape, t.stride()))
    return tuple(state)


# How linear layers are routed (a `forward` of their own, kernels.py) and packed (`packed_weight`), as an epoch: every
# function that sets or removes either on a model's layers calls routing_changed(). A pass that asks the same
# layers the same question every step keeps the answer with the epoch (fused_layers.FusedLayers._packs): checking
# 210 layers' attributes again after a step has streamed the weights through the caches cost ~0.2-0.3 ms a step.
_ROUTING_EPOCH = [0]


def routing_changed() -> None:
    _ROUTING_EPOCH[0] += 1


def routing_epoch() -> int:
    return _ROUTING_EPOCH[0]


def current_pack(mod: torch.nn.Module) -> Optional[PackedWeight]:
    """The layer's pack if it still holds its weight as it is now, else None."""
    packed = getattr(mod, "packed_weight", None)
    return packed if packed is not None and packed.source == weight_state(mod.weight) else None


def _nonzero_divisor(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d > 0, d, torch.ones_like(d))


def _q4_codes(v: torch.Tensor):
    """(codes [.., 32] uint8, scales, offsets) for blocks v [.., 32] if (scale * code) + offset gives each back, else None.
    The offset is the block's least value (the quantizer's code 0); the scale, the span over 15, as float16
    (where GGUF's Q4_1 and Q4_0's scales live) or as computed."""
    low = v.amin(-1, keepdim=True)
    span = (v.amax(-1, keepdim=True) - low) / 15
    for d in (span.half().float(), span):
        q = torch.round((v - low) / _nonzero_divisor(d)).clamp_(0, 15)
        if torch.equal((d * q) + low, v):
            return q.to(torch.uint8), d, low
    return None


def _q8_codes(v: torch.Tensor):
    """(codes [.., 32] int8, scales) for blocks v [.., 32] if scale * code gives each back, else None (Q8_0: the
    largest magnitude is code +-127, the scale a float16)."""
    span = v.abs().amax(-1, keepdim=True) / 127
    for d in (span.half().float(), span):
        q = torch.round(v / _nonzero_divisor(d)).clamp_(-128, 127)
        if torch.equal(d * q, v):
            return q.to(torch.int8), d
    return None


#: rows checked at a time (the checks hold a few float32 copies of what they check)
PACK_ROWS = 4096


def _codes_by_chunk(find, blocks: torch.Tensor):
    """`find` over row chunks of `blocks`, the parts concatenated; None as soon as a chunk is not codes."""
    parts = []
    for start in range(0, blocks.shape[0], PACK_ROWS):
        found = find(blocks[start:start + PACK_ROWS])
        if found is None:
            return None
        parts.append(found)
    return [torch.cat(p) for p in zip(*parts)]


@torch.no_grad()
def pack(weight: torch.Tensor) -> Optional[PackedWeight]:
    """The weight's codes, if every block of 32 inputs is a Q8_0 or Q4_1 block exactly (checked on a sample of
    rows first, then on all, a chunk of rows at a time); None for any other weight (not float32 on a CPU, K not
    a multiple of 32, or values that are not such codes, as in a model trained in float32 or bf16)."""
    if weight.dtype != torch.float32 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    n, k = weight.shape
    if k == 0 or k % BLOCK or n == 0:
        return None
    source = weight_state(weight)
    blocks = weight.detach().reshape(n, k // BLOCK, BLOCK)
    sample = blocks[: min(n, 64)]
    if _q8_codes(sample) is not None and (found := _codes_by_chunk(_q8_codes, blocks)) is not None:
        q, d = found
        return PackedWeight("q8", q.reshape(n, k).contiguous(), d.reshape(n, -1).contiguous(), None, source)
    if _q4_codes(sample) is not None and (found := _codes_by_chunk(_q4_codes, blocks)) is not None:
        q, d, m = found
        packed = q[..., : BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
        return PackedWeight("q4", packed.reshape(n, k // 2).contiguous(), d.reshape(n, -1).contiguous(),
                            m.reshape(n, -1).contiguous(), source)
    return None


# --- the compiled kernel -------------------------------------------------------------------------

class KernelUnavailable(RuntimeError):
    pass


def _compiler() -> Optional[list]:
    """The C compiler's command ($CC may carry arguments, e.g. 'ccache gcc'), or None."""
    if os.environ.get("CC"):
        return shlex.split(os.environ["CC"])
    found = shutil.which("cc") or shutil.which("gcc")
    return [found] if found else None


def _library():
    return build_library(NATIVE)


@functools.lru_cache(maxsize=None)
def build_library(isa_flags: tuple):
    """The C library compiled with `isa_flags` (cached per machine under $DIFFSPEC_CACHE/kernels) and loaded, or a
    KernelUnavailable that says why not."""
    lib = compile_and_load(SOURCE, "packed-linear", isa_flags)
    if isinstance(lib, KernelUnavailable):
        return lib
    lib.diffspec_packed_isa.restype = ctypes.c_char_p
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.diffspec_q4_linear.argtypes = [ptr, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.diffspec_q8_linear.argtypes = [ptr, i64, i64, ptr, ptr, i64, ptr, ctypes.c_int]
    lib.diffspec_q4_linear.restype = lib.diffspec_q8_linear.restype = None
    lib.diffspec_takes_pairs.argtypes = [i64, i64]
    lib.diffspec_takes_pairs.restype = ctypes.c_int
    lib.diffspec_argmax_rows.argtypes = [ptr, i64, i64, ptr]
    lib.diffspec_argmax_rows.restype = None
    return lib


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(dim=-1), the same indices (the first of equal values; the first NaN where a row holds one),
    from the C library where it builds and the logits are contiguous float32 on the CPU (torch's own argmax took
    ~45-90 us a 49152-wide row on a 2-core AVX-512 EPYC: ~1-2% of a plain step); else torch's."""
    lib = _library() if logits.dtype == torch.float32 and logits.device.type == "cpu" and logits.shape[-1] > 0 \
        and logits.is_contiguous() and not torch.compiler.is_compiling() else None
    if lib is None or isinstance(lib, KernelUnavailable):
        return logits.argmax(dim=-1)
    out = torch.empty(logits.shape[:-1], dtype=torch.int64)
    lib.diffspec_argmax_rows(logits.data_ptr(), out.numel(), logits.shape[-1], out.data_ptr())
    return out


def compile_and_load(source_file: Path, name: str, isa_flags: tuple, includes: tuple = ()):
    """A C file of ours compiled with FLAGS + `isa_flags` by the system's compiler, once per machine (cached under
    $DIFFSPEC_CACHE/kernels, keyed by the source and the files it `includes` (beside it), compiler, flags and CPU
    flags), and loaded; or a KernelUnavailable that says why not."""
    from .machine_keys import cache_key, machine_key
    from .models import cache_root

    cc = _compiler()
    if cc is None:
        return KernelUnavailable("no C compiler found (set $CC)")
    source = b"".join(f.read_bytes() for f in (source_file, *includes))
    flags = (*FLAGS, *isa_flags)
    key = cache_key(name, hashlib.sha256(source).hexdigest(), cc, flags, machine_key("cpu")["cpu_flags"])
    where = cache_root() / "kernels" / f"{name.replace('-', '_')}-{key}.so"
    if not where.exists():
        try:
            where.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=where.parent) as tmp:
                out = Path(tmp) / where.name
                run = subprocess.run([*cc, *flags, str(source_file), "-o", str(out)], capture_output=True, text=True,
                                     timeout=600)
                if run.returncode != 0:
                    return KernelUnavailable(f"{' '.join(cc)} could not compile {source_file.name}: "
                                             f"{run.stderr.strip()[-400:]}")
                os.replace(out, where)
        except (OSError, subprocess.TimeoutExpired) as e:
            return KernelUnavailable(f"could not build {source_file.name} under {where.parent}: {e}")
    try:
        return ctypes.CDLL(str(where))
    except OSError as e:
        return KernelUnavailable(f"could not load {where}: {e}")


def kernel_key() -> str:
    """What identifies the kernel's timings: its source and build flags (a changed kernel is timed again)."""
    return hashlib.sha256(SOURCE.read_bytes() + repr((FLAGS, NATIVE)).encode()).hexdigest()[:16]


def unavailable() -> Optional[str]:
    """Why the kernel cannot run here (None: it can)."""
    lib = _library()
    return str(lib) if isinstance(lib, KernelUnavailable) else None


def isa() -> str:
    """The vector instructions the kernel was compiled for on this machine ('avx512f', 'avx2' or 'scalar')."""
    lib = _library()
    if isinstance(lib, KernelUnavailable):
        raise lib
    return lib.diffspec_packed_isa().decode()


def _run_kernel(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                offsets: Optional[torch.Tensor], lib=None) -> torch.Tensor:
    """y = x @ W^T through the C kernel (kept lean: a call of a small layer is ~13 us, ~7 of them ctypes, OpenMP and the kernel)."""
    lib = lib or _library()
    if isinstance(lib, KernelUnavailable):
        raise lib
    if not x.is_contiguous():
        x = x.contiguous()
    k, n = x.shape[-1], codes.shape[0]
    y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
    if codes.dtype == torch.uint8:
        lib.diffspec_q4_linear(x.data_ptr(), x.numel() // k, k, codes.data_ptr(), scales.data_ptr(),
                               offsets.data_ptr(), n, y.data_ptr(), torch.get_num_threads())
    else:
        lib.diffspec_q8_linear(x.data_ptr(), x.numel() // k, k, codes.data_ptr(), scales.data_ptr(), n, y.data_ptr(),
                               torch.get_num_threads())
    return y


@torch.library.custom_op("diffspec::packed_linear", mutates_args=())
def _packed_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor,
                   offsets: Optional[torch.Tensor]) -> torch.Tensor:
    """The kernel as an operator torch.compile can trace a graph around (its dispatch costs ~16 us a call,
    so eager passes call the kernel directly)."""
    return _run_kernel(x, codes, scales, offsets)


@_packed_linear.register_fake
def _(x, codes, scales, offsets):
    return x.new_empty(*x.shape[:-1], codes.shape[0])


def packed_linear(x: torch.Tensor, weight: PackedWeight, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear(x, W, bias) for W = weight.decode(), x float32 on the CPU."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"packed_linear takes float32 CPU rows of {weight.shape[1]}, got {x.dtype} on "
                         f"{x.device.type}, {tuple(x.shape)}")
    run = _packed_linear if torch.compiler.is_compiling() else _run_kernel
    y = run(x, weight.codes, weight.scales, weight.offsets)
    return y + bias if bias is not None else y


def output_head(model: torch.nn.Module) -> Optional[torch.nn.Module]:
    """The model's output head, or None for a module that has none to give (a drafter's body may be any module)."""
    get = getattr(model, "get_output_embeddings", None)
    return get() if callable(get) else None


def linear_groups(model: torch.nn.Module) -> dict:
    """{(out, in): [the model's nn.Linear layers of that weight shape]} (kernels.py plans by these groups)."""
    groups: dict = {}
    for mod in model.modules():
        if isinstance(mod, torch.nn.Linear):
            groups.setdefault(tuple(mod.weight.shape), []).append(mod)
    return groups


def pack_model(model: torch.nn.Module, quiet: bool = True) -> dict:
    """Pack every linear layer of `model` whose weight is GGUF codes exactly (PackedWeight on the module as
    `packed_weight`, else None; a weight shared by two layers, as a tied head, is packed once). Returns
    {(out, in): whether every layer of that shape was packed}. Where layers are codes but the kernel cannot
    run here (no C compiler), nothing is packed, and unless `quiet` stderr says why."""
    packed, seen = {}, {}
    for shape, mods in linear_groups(model).items():
        ok = True
        for mod in mods:
            key = (mod.weight.data_ptr(), tuple(mod.weight.shape))
            if key not in seen:
                seen[key] = pack(mod.weight)
            mod.packed_weight = seen[key]
            ok = ok and seen[key] is not None
        packed[shape] = ok
    routing_changed()
    found = [p for p in seen.values() if p is not None]
    if found and (why := unavailable()) is not None:
        for mods in linear_groups(model).values():
            for mod in mods:
                mod.packed_weight = None
        routing_changed()
        if not quiet:
            print(f"diffspec: the target's weights are GGUF codes, but the packed kernel cannot run here ({why}): "
                  f"float32 kernels only", file=sys.stderr, flush=True)
        return {shape: False for shape in packed}
    if not quiet and found:
        total = sum(p.nbytes for p in found)
        print(f"diffspec: the target's GGUF-coded weights packed for the {isa()} kernel ({total / 2**20:.0f} MiB)",
              file=sys.stderr, flush=True)
    return packed
