"""Measured matmul formulations for the target's linear layers on a CPU (issue 19).

A decoding step multiplies one row, a verify pass a few (k + 1, k drafted tokens), by every weight
matrix. PyTorch's `F.linear(x, W)` (x @ W^T) hands MKL shapes it serves badly at these sizes:
- one row goes to MKL's GEMV, which streams the weights at ~10-11 GB/s on 2 cores where the memory
  gives ~30 (AVX-512 EPYC: the 49152 x 576 output head 9.9 ms), while the same product asked as a
  two-column `mm(W, [x; x]^T)` runs MKL's GEMM kernel at near full bandwidth (4.2 ms);
- 2-12 rows go to a GEMM path that took 19.7 ms for two rows through that head on an AVX2 EPYC
  (7.7 ms for one), against 4.9 ms as `mm(W, x^T)` (benchmarks/results/issue19_engine/).
A model converted from a GGUF has a third formulation: its weights are the GGUF's codes exactly, and
packed_linear.py reads them as codes (85 instead of 538 MB for SmolLM2), with the same float32 weights.
Which formulation wins, and up to how many rows, depends on the CPU and the shape, so it is measured:

- `measure_plan(model)`: for each distinct weight shape of the model's `nn.Linear` layers and each
  row count in ROW_BUCKETS, both formulations are timed over that shape's own weights in sequence
  (so they stream from memory as in a real pass). One row takes the padded `mm` where it was at
  least 1/MARGIN faster; from 2 rows, `mm(W, x^T)` takes the row counts up to the first bucket where
  it was not. Where a shape's layers are all GGUF codes (`packed_linear.pack_model`, run first), the
  packed kernel is timed too, against the formulation planned for each bucket, and takes the buckets
  where it is at least 1/MARGIN faster (the same prefix rule). Once per machine x shapes (and whether
  they are packed, and the kernel's source) x dtype x torch version, cached beside the cost tables.
- `install(model, plan)`: each linear layer's forward picks the formulation its plan names for the
  pass's row count (a row count between buckets takes the bucket below; past the last, F.linear): the
  packed kernel, else mm(W, x^T), else F.linear.
- `head_rows`: the row buckets whose greedy choice skips the output head's fp32 product for the exact
  screen of greedy_head.py (a bf16 product and a bound, then the few candidates rescored), timed
  against the planned fp32 head where this CPU runs bf16 matmuls natively; the target applies it
  where its own checks pass (`GreedyHead.for_model`).

The modes (`--kernels`):
- `auto` (default): the measured plan for every row count, one row included. Plain decoding then
  runs the padded mm: each logit is the same dot product summed by another kernel, so it may differ
  from transformers' eager forward in the last bits, and a greedy argmax between two near-tied
  tokens can flip (the match rate against transformers' `generate` is measured in the README).
  A linear layer's one-row output equals the rows of its 2- and 3-row outputs bitwise (the same MKL
  kernel; tested), so plain decoding's matmuls and those of short verify passes compute alike.
- `multi-row`: the measured plan for passes of 2 rows or more; one-row passes keep F.linear and the
  fp32 logits' argmax, so plain decoding is bitwise transformers' eager forward.
- `stock`: F.linear everywhere, and greedy choices from the fp32 logits.
- `q8`: llama.cpp's arithmetic for a GGUF target (q8_linear.py): every linear layer's product, at every row
  count, reads the GGUF codes with its input rows quantized to 8 bits per block of 32 (exact integer sums,
  AVX-512 VNNI where the CPU has it). Another target arithmetic, not another kernel for the same one: plain
  decoding uses it too (speculation stays exact against it), and its greedy output is compared with
  transformers' `generate` as a match rate, never promised. Refused for a model whose layers are not all
  GGUF codes. Nothing is timed: the one formulation serves every row count.
Under `auto` and `multi-row` a GQA model's attention on a CPU also shares its key/value heads inside
the kernel instead of copying the cache for every pass of 2+ rows (attention.py; bitwise the same
output). `stock_kernels(model)` runs a block with F.linear everywhere and transformers' own attention
(the bench's `hf-generate` method: what users run today).
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from . import q8_linear
from .defaults import KERNELS  # noqa: F401 (kernels.KERNELS as before; the CLI reads it without torch)
from .errors import DiffspecError
from .packed_linear import current_pack, kernel_key, linear_groups, output_head, pack_model, packed_linear, routing_changed
from .packed_linear import unavailable as packed_unavailable
from .timing import median_seconds

#: row counts timed; a pass of m rows uses the plan of the largest bucket <= m
ROW_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
#: mm(W, x^T), or the packed kernel, is taken only where it was at least this much faster (noise must not flip a choice)
MARGIN = 0.9
FORMAT = 4

Shape = Tuple[int, int]  # (out_features, in_features)


def check_kernels(name: str) -> None:
    if name not in KERNELS:
        raise DiffspecError(f"unknown --kernels '{name}' (choose from: {', '.join(KERNELS)})")


@dataclass(frozen=True)
class LinearPlan:
    """For each weight shape, the row buckets that take `mm(W, x^T)` (bucket 1: the padded two-column
    mm); every other row count, F.linear. `head_rows`: the row buckets whose greedy choice is screened
    (greedy_head.py) instead of read from the fp32 head's logits."""

    mm_rows: Dict[Shape, frozenset] = field(default_factory=dict)
    timings_us: Dict[str, dict] = field(default_factory=dict, compare=False)
    head_rows: frozenset = frozenset()
    #: for each weight shape whose layers are GGUF codes (packed_linear.py), the row buckets that run the packed kernel
    packed_rows: Dict[Shape, frozenset] = field(default_factory=dict)
    #: `--kernels q8`: every packed layer, at every row count, with 8-bit activations (q8_linear.py)
    q8: bool = False

    def uses_mm(self, shape: Shape, rows: int) -> bool:
        return _in_buckets(self.mm_rows.get(shape), rows)

    def uses_packed(self, shape: Shape, rows: int) -> bool:
        return _in_buckets(self.packed_rows.get(shape), rows)

    def screens_head(self, rows: int) -> bool:
        return _in_buckets(self.head_rows, rows)

    def multi_row_only(self) -> "LinearPlan":
        """The same plan with one-row passes left to transformers' own (`--kernels multi-row`)."""
        return LinearPlan({shape: rows - {1} for shape, rows in self.mm_rows.items()}, self.timings_us,
                          self.head_rows - {1}, {shape: rows - {1} for shape, rows in self.packed_rows.items()})

    @property
    def one_row(self) -> bool:
        """Whether any one-row pass leaves F.linear, or its greedy choice the fp32 logits (plain decoding is
        then not transformers' own bitwise)."""
        return any(1 in rows for rows in [*self.mm_rows.values(), *self.packed_rows.values()]) or 1 in self.head_rows

    def describe(self) -> str:
        if self.q8:
            return f"GGUF codes with 8-bit activations (q8_linear.py, {q8_linear.isa()}) for every linear layer, " \
                   f"at every row count"
        if not any(self.mm_rows.values()) and not self.head_rows and not any(self.packed_rows.values()):
            return "stock"

        def listed(rows_by_shape):
            return "; ".join(f"{n}x{k}: rows {','.join(str(r) for r in sorted(rows))}"
                             for (n, k), rows in sorted(rows_by_shape.items()) if rows)

        text = "mm(W,x^T) for " + listed(self.mm_rows) if any(self.mm_rows.values()) else "F.linear"
        if any(self.packed_rows.values()):
            text = "packed GGUF codes for " + listed(self.packed_rows) + "; otherwise " + text
        if self.head_rows:
            text += f"; greedy head screened in bf16 for rows {','.join(str(r) for r in sorted(self.head_rows))}"
        return text

    def to_json(self) -> dict:
        return {"format": FORMAT, "mm_rows": [[n, k, sorted(rows)] for (n, k), rows in sorted(self.mm_rows.items())],
                "packed_rows": [[n, k, sorted(rows)] for (n, k), rows in sorted(self.packed_rows.items())],
                "head_rows": sorted(self.head_rows), "timings_us": self.timings_us, "q8": self.q8}

    @classmethod
    def from_json(cls, d: dict) -> "LinearPlan":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise ValueError("not a linear plan")
        rows = {(int(n), int(k)): frozenset(int(r) for r in rs) for n, k, rs in d["mm_rows"]}
        packed = {(int(n), int(k)): frozenset(int(r) for r in rs) for n, k, rs in d["packed_rows"]}
        head = frozenset(int(r) for r in d["head_rows"])
        if any(r not in ROW_BUCKETS for rs in [*rows.values(), *packed.values(), head] for r in rs):
            raise ValueError("row bucket out of range")
        return cls(rows, d.get("timings_us", {}), head, packed, bool(d.get("q8", False)))


def _in_buckets(buckets: Optional[frozenset], rows: int) -> bool:
    """Whether `rows` falls in one of `buckets` (a row count takes the largest bucket <= it; none past the last)."""
    if not buckets or rows > ROW_BUCKETS[-1]:
        return False
    return max(b for b in ROW_BUCKETS if b <= rows) in buckets


def mm_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as mm(W, x^T)^T (contiguous, x's leading shape). One row is
    asked as two (the row twice): a one-column mm would go to the GEMV kernel that F.linear uses."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.shape[0] == 1:
        y = torch.mm(weight, torch.cat((rows, rows)).t())[:, :1].t().contiguous()  # a copy: a stride-0 view takes another MKL path
    else:
        y = torch.mm(weight, rows.t()).t().contiguous()
    if bias is not None:
        y += bias
    return y.view(*x.shape[:-1], weight.shape[0])


@torch.inference_mode()
def measure_plan(model: torch.nn.Module, reps: int = 5) -> LinearPlan:
    """Time F.linear against mm(W, x^T), and the packed kernel where a shape's layers are GGUF codes
    (packed_linear.py: `pack_model` first), for every weight shape and row bucket (see the module docstring)."""
    mm_rows, packed_rows, timings = {}, {}, {}
    for shape, mods in linear_groups(model).items():
        weights = [m.weight for m in mods]
        packs = [current_pack(m) for m in mods]
        packable = all(p is not None for p in packs)
        chosen, packed, rows_t, winning, packed_winning = set(), set(), {}, True, packable
        for rows in ROW_BUCKETS:
            x = torch.randn(rows, shape[1], dtype=weights[0].dtype, device=weights[0].device)

            def stock():
                for w in weights:
                    F.linear(x, w)

            def flipped():
                for w in weights:
                    mm_linear(x, w, None)

            def decoded():
                for p in packs:
                    packed_linear(x, p)

            t_stock, t_mm = median_seconds(stock, reps), median_seconds(flipped, reps)
            rows_t[rows] = [round(t_stock / len(weights) * 1e6, 1), round(t_mm / len(weights) * 1e6, 1)]
            wins = t_mm < MARGIN * t_stock
            if rows == 1:  # one row is its own decision (another kernel than the multi-row ones)
                if wins:
                    chosen.add(rows)
            else:
                winning = winning and wins  # from 2 rows up to the first bucket it does not win
                if winning:
                    chosen.add(rows)
            if packed_winning:
                t_packed = median_seconds(decoded, reps)
                rows_t[rows].append(round(t_packed / len(weights) * 1e6, 1))
                packed_wins = t_packed < MARGIN * (t_mm if rows in chosen else t_stock)
                if packed_wins:
                    packed.add(rows)
                elif rows > 1:
                    packed_winning = False
            if not winning and not packed_winning and rows >= 8:
                break  # the formulations converge as rows grow: stop timing
        mm_rows[shape] = frozenset(chosen)
        if packable:
            packed_rows[shape] = frozenset(packed)
        timings[f"{shape[0]}x{shape[1]}"] = rows_t
    head_rows, timings["greedy_head"] = measure_head_screen(model, mm_rows, reps, packed_rows)
    return unscreened_where_packed(LinearPlan(mm_rows, timings, head_rows, packed_rows), model)


def measure_head_screen(model: torch.nn.Module, mm_rows: Dict[Shape, frozenset], reps: int = 5,
                        packed_rows: Optional[Dict[Shape, frozenset]] = None) -> tuple:
    """(the row buckets where greedy_head's screen is at least 1/MARGIN faster than the planned fp32 head
    and its argmax, {bucket: [fp32 us, screened us]}). Nothing where the head is not a float32 bias-free
    linear layer or this CPU has no native bf16 matmul. Timed on rows aimed at some of the head's own
    rows (a peaked distribution, as a language model's usually is: few candidates to rescore)."""
    from .greedy_head import GreedyHead, unscreenable

    head = output_head(model)  # (a drafter's body may be any module)
    if unscreenable(head):
        return frozenset(), {}
    screen, shape = GreedyHead.of(head), tuple(head.weight.shape)
    g = torch.Generator().manual_seed(0)
    chosen, rows_t = set(), {}
    for rows in ROW_BUCKETS:
        picks = torch.randint(0, shape[0], (rows,), generator=g)
        x = head.weight.detach()[picks] * 10 + torch.randn(rows, shape[1], generator=g) * 0.1

        def planned():
            if _in_buckets((packed_rows or {}).get(shape), rows):
                y = packed_linear(x, current_pack(head))
            elif _in_buckets(mm_rows.get(shape), rows):
                y = mm_linear(x, head.weight, None)
            else:
                y = F.linear(x, head.weight)
            y.argmax(dim=-1)

        t_full, t_screen = median_seconds(planned, reps), median_seconds(lambda: screen.tokens(x), reps)
        rows_t[rows] = [round(t_full * 1e6, 1), round(t_screen * 1e6, 1)]
        if t_screen < MARGIN * t_full:
            chosen.add(rows)
    return frozenset(chosen), rows_t


def unscreened_where_packed(plan: LinearPlan, model: torch.nn.Module) -> LinearPlan:
    """The plan without a greedy screen at the row counts where the output head runs packed. The packed kernel's
    logits are bitwise the same at every width, so their argmax is what a one-row step (plain decoding) chooses;
    the screen chooses the argmax of the exact dot products, which can differ from it where two tokens are closer
    than fp32's rounding. Speculation would then emit another token than plain decoding. (On SmolLM2's answers,
    12 of 2,762 one-row steps had more than one token within the fp32 bound, none chose differently: rare, but the
    contract is every token.) Applied to every measured plan, and to plans cached before this rule when read."""
    head = output_head(model)
    if head is None or not plan.head_rows:
        return plan
    packed = plan.packed_rows.get(tuple(head.weight.shape))
    keep = frozenset(r for r in plan.head_rows if not _in_buckets(packed, r))
    return plan if keep == plan.head_rows else dataclasses.replace(plan, head_rows=keep)


def plan_path(model: torch.nn.Module):
    from .machine_keys import cache_key, cost_dir, machine_key

    def kinds(mods):  # the codes a shape's layers are packed as (a Q4 and a Q8 file of one model time apart)
        packs = [current_pack(m) for m in mods]
        return sorted({p.kind for p in packs if p is not None}) if all(packs) else []

    p = next(model.parameters())
    shapes = sorted((list(s), len(m), kinds(m)) for s, m in linear_groups(model).items())
    packed = any(packed_kinds for _, _, packed_kinds in shapes)
    key = cache_key("linear-plan", FORMAT, machine_key(p.device), str(p.dtype), shapes, ROW_BUCKETS, MARGIN,
                    *([kernel_key()] if packed else []))
    return cost_dir() / f"linear-plan-{key}.json"


def plan_reps() -> int:
    """Timings of each formulation when a plan is measured: 5, or $DIFFSPEC_PLAN_REPS. The test suite sets 1: its
    plans go to a cost cache of the run (never the user's), and which kernels win does not change what a test checks
    (every plan keeps speculation equal to plain decoding); timing Gemma 3's 262k-row head five times took ~1 minute."""
    from .machine_keys import reps_from_env

    return reps_from_env("DIFFSPEC_PLAN_REPS", 5, "timings per matmul formulation")


def cached_plan(model: torch.nn.Module, quiet: bool = False) -> LinearPlan:
    """The plan for this machine and model's shapes: read from the cost cache, or measured (seconds)."""
    from .output import read_or_fill, try_write_cache

    where = plan_path(model)

    def cached() -> Optional[LinearPlan]:
        try:
            return LinearPlan.from_json(json.loads(where.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def measured() -> LinearPlan:
        if not quiet:
            print("diffspec: timing the matmul formulations for the target's layers on this machine (once; cached)",
                  file=sys.stderr, flush=True)
        plan = measure_plan(model, reps=plan_reps())
        try_write_cache(where, json.dumps(plan.to_json(), indent=1), "the matmul plan")
        return plan

    return read_or_fill(where, cached, measured)[0]  # another process timing the same plan: its plan, once written


def install(model: torch.nn.Module, plan: LinearPlan) -> int:
    """Route each linear layer's forward through `plan` (and only it: a plan installed before on the same model, say
    q8's, is taken off first); returns how many layers may leave F.linear."""
    uninstall(model)
    routed = 0
    for shape, mods in linear_groups(model).items():
        if not plan.mm_rows.get(shape) and not plan.packed_rows.get(shape):
            continue
        for mod in mods:
            mod.forward = _routed_forward(mod, shape, plan)
            routed += 1
    routing_changed()
    return routed


def uninstall(model: torch.nn.Module) -> None:
    for mods in linear_groups(model).values():
        for mod in mods:
            mod.__dict__.pop("forward", None)
    routing_changed()


@contextmanager
def stock_kernels(model: torch.nn.Module):
    """Within the block, every linear layer of `model` runs F.linear and attention is transformers' own
    sdpa (attention.py); both are put back after."""
    from . import attention

    routed = {mod: mod.__dict__.pop("forward") for mods in linear_groups(model).values() for mod in mods
              if "forward" in mod.__dict__}
    routing_changed()
    gqa = attention.uninstall(model)
    try:
        yield model
    finally:
        for mod, forward in routed.items():
            mod.forward = forward
        routing_changed()
        if gqa:
            attention.install(model)


def plan_for_mode(model: torch.nn.Module, mode: str, quiet: bool = False) -> LinearPlan:
    """The plan `--kernels mode` installs on a CPU model (measured once per machine, then cached)."""
    check_kernels(mode)
    if mode == "stock":
        return LinearPlan()
    if mode == "q8":
        return q8_plan(model, quiet=quiet)
    mods = [m for group in linear_groups(model).values() for m in group]
    if any(not hasattr(m, "packed_weight") or (m.packed_weight is not None and current_pack(m) is None)
           or getattr(m.packed_weight, "q8", None) is not None for m in mods):
        pack_model(model, quiet=quiet)  # never packed, packed before its weights changed (a copy, a cast), or for q8
    plan = unscreened_where_packed(cached_plan(model, quiet=quiet), model)
    return plan if mode == "auto" else plan.multi_row_only()


def check_q8_settings(device: str, compile: str, dtype: torch.dtype) -> None:
    """Refuse, before a model loads, what `--kernels q8` cannot serve: it runs eager float32 passes on the CPU."""
    if not str(device).startswith("cpu"):
        raise DiffspecError(f"--kernels q8 runs on the CPU; --device {device} computes in float32 kernels there")
    if compile != "off":
        raise DiffspecError(f"--kernels q8 runs eager passes; --compile {compile} has no graph for its kernel "
                            f"(leave --compile at off)")
    if dtype != torch.float32:
        raise DiffspecError(f"--kernels q8 reads a float32 GGUF-converted target; --dtype "
                            f"{str(dtype).replace('torch.', '')} is not one")
    check_q8_kernels()


def check_q8_kernels() -> None:
    """Both kernels build here: the packed one (which finds the codes) and the 8-bit one."""
    for name, why in (("the packed GGUF-code kernel", packed_unavailable()), ("the 8-bit activation kernel",
                                                                       q8_linear.unavailable())):
        if why is not None:
            raise DiffspecError(f"--kernels q8: {name} cannot run here ({why})")


def q8_plan(model: torch.nn.Module, quiet: bool = False) -> LinearPlan:
    """`--kernels q8`: every linear layer packed with its q8_linear.c layout, at every row count (refused by name
    where a layer's weight is not GGUF codes: that layer would compute in float32, and rows would not be computed
    alike at every width). The kernels' builds are checked before: check_q8_settings, which Target runs first."""
    missing = q8_linear.pack_model_q8(model, quiet=quiet)
    if missing:
        raise DiffspecError(f"--kernels q8 needs a target whose linear layers are all GGUF codes (a model converted "
                            f"from a GGUF file); these weights are not: {', '.join(missing)}")
    if not quiet:
        print(f"diffspec: --kernels q8: every linear layer reads GGUF codes with 8-bit activations "
              f"({q8_linear.isa()} kernel) and a float16 cache where the fused layers run (llama.cpp's arithmetic, "
              f"not transformers' float32)", file=sys.stderr,
              flush=True)
    every = frozenset(ROW_BUCKETS)
    return LinearPlan(packed_rows={shape: every for shape in linear_groups(model)}, q8=True)


def _routed_forward(mod: torch.nn.Linear, shape: Shape, plan: LinearPlan):
    """The layer's routed forward, bound to it as a method: a deep copy of the model (the drafters' dtype
    trial) rebinds it to the copy, whose own weights it then uses (a closure over `mod` would keep
    computing with the original's)."""
    mm_for = frozenset(r for r in range(1, ROW_BUCKETS[-1] + 1) if plan.uses_mm(shape, r))
    packed_for = frozenset(r for r in range(1, ROW_BUCKETS[-1] + 1) if plan.uses_packed(shape, r))

    def forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        packed = getattr(self, "packed_weight", None)
        if packed is not None and (rows in packed_for or packed.q8 is not None) \
                and x.dtype == torch.float32 and x.device.type == "cpu":  # not a copy cast or moved since
            if packed.q8 is not None:  # --kernels q8: the arithmetic itself, at any row count
                return q8_linear.linear(x, packed, self.bias)
            return packed_linear(x, packed, self.bias)
        if rows in mm_for:
            return mm_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    return types.MethodType(forward, mod)
