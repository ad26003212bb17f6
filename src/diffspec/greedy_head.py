"""The target's greedy choice without the output head's full fp32 product (issue 19).

A verify pass of k + 1 rows multiplies them by the output head (SmolLM2: 49152 x 576, 113 MB of
fp32). On a 2-core AVX-512 EPYC that product runs at MKL's small-N GEMM speed: 13-22 ms for 8-17
rows, a sixth of the pass (benchmarks/results/issue19_engine/gemm_small_n_avx512.txt). Greedy
decoding reads one thing from those logits: each row's argmax. `screened_argmax` finds it exactly
from a bf16 product, which CPUs with avx512_bf16 or AMX run 2-3x faster, and a bound on that
product's error:

1. approx = bf16(h) @ bf16(W)^T: products of two bf16 numbers are exact in fp32, summed in fp32,
   the result rounded to bf16.
2. For every token v, |h.w_v - approx_v| <= B_v, where
       B_v = ||h|| ||w_v|| ((2u + u^2)(1 + g) + g + g64) + u / (1 - u) max_v' |approx_v'| + tiny
   with u = 2^-8 (bf16's unit roundoff: rounding h and w_v), g = the fp32 summation's gamma over
   2H terms, g64 the float64 rescoring's; sum_i |h_i w_vi| <= ||h|| ||w_v|| (Cauchy-Schwarz).
3. A token whose upper bound approx_v + B_v is below the lower bound approx_t - B_t of the token t
   with the largest approx cannot win. The others (the candidates; on SmolLM2's own answers 1.5-4 a
   row on average, at most 24; ~50 on a context of random tokens, a flat distribution) are rescored
   in float64, where the products of two fp32 numbers are exact and a sum of H of them is off by at
   most g64 * sum_i |h_i w_vi|. Where a pass has more than MAX_CANDIDATES_PER_ROW a row, the fp32
   product (error g * sum_i |h_i w_vi|) narrows them first: never wrong, only slower.
4. Each row's choice: its largest rescored candidate; on a tie the lowest token id (torch.argmax's
   rule).

So the choice is the argmax of the exact dot products of the fp32 hidden state with the fp32 head
(to float64's rounding), and it does not depend on how many rows the pass had: a candidate set
always holds that argmax, and any set that holds it gives the same answer. fp32 GEMMs do not have
that property (their rows differ in the last bits with the row count, README "Exactness").

Where it applies (`GreedyHead.for_model`): a float32 model on a CPU whose bf16 matmuls are native
(`torch.ops.mkldnn._is_mkldnn_bf16_supported`), whose logits are exactly its output head applied to
its last hidden state (no soft-capping or scaling after the head; checked on a pass), and where the
bound held on the model's own head for random rows (`bound_holds`). Which row counts take it is
measured with the other matmuls (kernels.py: `LinearPlan.head_rows`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

#: bf16's unit roundoff (8 significant bits, round to nearest)
BF16_U = 2.0 ** -8
FP32_U = 2.0 ** -24
FP64_U = 2.0 ** -53


def gamma(n: int, u: float) -> float:
    """The classic bound on the relative error of a sum of n terms in a format of unit roundoff u."""
    return n * u / (1 - n * u)


def fp32_bound_factors(hidden_size: int) -> tuple:
    """The same for an fp32 product (F.linear in any summation order) rescored in float64."""
    return gamma(hidden_size, FP32_U) + gamma(hidden_size, FP64_U), 0.0, hidden_size * 2.0 ** -126 + 1e-30


def row_bound_factors(hidden_size: int) -> tuple:
    """(per ||h|| ||w_v||, per max|approx|, absolute) of the bound B_v in the module docstring."""
    g32 = gamma(2 * hidden_size, FP32_U)  # 2H: a bf16 dot-product instruction may round pair sums too
    g64 = gamma(hidden_size, FP64_U)
    per_norm = (2 * BF16_U + BF16_U ** 2) * (1 + g32) + g32 + g64
    per_value = BF16_U / (1 - BF16_U)
    absolute = 2 * hidden_size * 2.0 ** -126 + 1e-30  # products flushed to zero (denormals) by bf16 units
    return per_norm, per_value, absolute


#: more candidates than this a row (a flat distribution) and the fp32 product narrows them first
MAX_CANDIDATES_PER_ROW = 256


@torch.inference_mode()
def screened_argmax(hidden: torch.Tensor, weight: torch.Tensor, weight_bf16: torch.Tensor,
                    row_norms: torch.Tensor, slack: float = 1.0) -> torch.Tensor:
    """argmax_v hidden[r] . weight[v] for every row r of hidden [n, H] (fp32) -> [n] int64, exactly
    (module docstring). weight [V, H] fp32, weight_bf16 its bf16 copy, row_norms [V] = ||weight[v]||.
    `slack` scales the bound (1: the proven one; the tests show that a tenth of it fails)."""
    n, hdim = hidden.shape
    norms = hidden.norm(dim=-1)
    if not bool(torch.isfinite(norms).all()):  # inf or nan in a row: no bound to screen with
        return F.linear(hidden, weight).argmax(dim=-1)
    rows, tokens = candidates(F.linear(hidden.to(torch.bfloat16), weight_bf16), norms, row_norms,
                              *row_bound_factors(hdim), slack)
    if tokens.shape[0] > MAX_CANDIDATES_PER_ROW * n:  # flat rows: narrow them with the fp32 product
        rows, tokens = candidates(F.linear(hidden, weight), norms, row_norms, *fp32_bound_factors(hdim), slack)
    exact = (hidden.double()[rows] * weight[tokens].double()).sum(dim=-1)  # [candidates] float64
    best = torch.full((n,), -math.inf, dtype=torch.float64).scatter_reduce(0, rows, exact, "amax")
    if not bool(torch.isfinite(best).all()):  # a row without a finite candidate (an overflowing product)
        return F.linear(hidden, weight).argmax(dim=-1)
    won = exact == best[rows]
    return torch.full((n,), weight.shape[0], dtype=torch.long).scatter_reduce(0, rows[won], tokens[won], "amin")


def candidates(approx: torch.Tensor, norms: torch.Tensor, row_norms: torch.Tensor, per_norm: float,
               per_value: float, absolute: float, slack: float = 1.0) -> tuple:
    """(rows, tokens) that may hold each row's exact argmax, given approx [n, V] whose error is at most
    B_v = norms[r] * row_norms[v] * per_norm + max_v |approx[r, v]| * per_value + absolute:
    every token whose upper bound approx_v + B_v reaches the largest lower bound approx_t - B_t."""
    approx = approx.float()  # (argmax and comparisons on bf16 run several times slower)
    spread = norms * (per_norm * slack)  # [n]
    high, low = approx.amax(dim=-1), approx.amin(dim=-1)
    value_term = (torch.maximum(high.abs(), low.abs()) * per_value + absolute) * slack
    lower = torch.addr(approx, spread, row_norms, alpha=-1).amax(dim=-1) - value_term  # the best exact product is above
    # the candidates' upper bounds are approx_v + spread * ||w_v|| + value_term; the threshold is widened by
    # 1e-5 relative for the fp32 rounding of this arithmetic itself
    threshold = lower - value_term - 1e-5 * slack * (high.abs() + spread * row_norms.max() + value_term)
    upper = torch.addr(approx, spread, row_norms)
    return torch.nonzero(upper >= threshold.unsqueeze(-1), as_tuple=True)


def exact_argmax(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The reference: every product in float64 (slow; for tests and checks)."""
    return (hidden.double() @ weight.double().t()).argmax(dim=-1)


def bf16_matmul_native() -> bool:
    """Whether this CPU runs bf16 matmuls in hardware (avx512_bf16 / AMX), as oneDNN reports it."""
    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def unscreenable(head: Optional[torch.nn.Module]) -> str:
    """Why this output head cannot be screened on this machine ("" where it can): what the kernel plan
    checks before timing the screen and the target before building it."""
    if head is None or not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return "the output head is not a bias-free linear layer"
    w = head.weight
    if w.dtype != torch.float32 or w.device.type != "cpu":
        return f"a {w.dtype} model on {w.device.type} (screening serves float32 on a CPU)"
    if not bf16_matmul_native():
        return "this CPU has no native bf16 matmul"
    return ""


@dataclass(frozen=True, eq=False)
class GreedyHead:
    """A model's output head for greedy choices: its weight, a bf16 copy, its rows' norms."""

    module: torch.nn.Module
    weight: torch.Tensor
    weight_bf16: torch.Tensor
    row_norms: torch.Tensor  # [V] fp32: ||w_v||

    @classmethod
    def of(cls, module: torch.nn.Module) -> "GreedyHead":
        w = module.weight.detach()
        return cls(module, w, w.to(torch.bfloat16), w.norm(dim=-1))

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> tuple:
        """(GreedyHead, "") where screening applies to this model on this machine, else (None, why not)."""
        head = model.get_output_embeddings()
        why_not = unscreenable(head)
        if why_not:
            return None, why_not
        if not logits_are_the_head_of_the_last_hidden_state(model):
            return None, "the model's logits are not its head applied to its last hidden state"
        built = cls.of(head)
        if not bound_holds(built):
            return None, "the bf16 product's error exceeded the bound on this machine"
        return built, ""

    def tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """The greedy choice for each row of hidden [n, H] (the model's last, normed, hidden state)."""
        return screened_argmax(hidden, self.weight, self.weight_bf16, self.row_norms)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The full logits [n, V], through the head module as the model's own pass would run it."""
        return self.module(hidden.unsqueeze(0))[0]


@torch.inference_mode()
def logits_are_the_head_of_the_last_hidden_state(model: torch.nn.Module) -> bool:
    """One short pass: the model's logits must equal its output head applied to the last entry of its
    hidden states, bitwise (a final soft-capping, scaling or bias would make the screen unsound)."""
    p = next(model.parameters())
    vocab = int(model.get_output_embeddings().weight.shape[0])
    ids = torch.arange(3, 3 + 6, device=p.device).remainder(vocab).view(1, -1)
    out = model(input_ids=ids, use_cache=False, output_hidden_states=True)
    if out.hidden_states is None:
        return False
    last = out.hidden_states[-1]
    if last.shape[-1] != model.get_output_embeddings().weight.shape[1]:
        return False
    return bool(torch.equal(model.get_output_embeddings()(last), out.logits))


@torch.inference_mode()
def bound_holds(head: GreedyHead, rows: int = 16, seed: int = 0) -> bool:
    """The bound against the measured error of this machine's bf16 product, for random rows at the scale
    of the head's own weights and for rows aligned with some of its weights (large logits)."""
    g = torch.Generator().manual_seed(seed)
    w = head.weight
    scale = float(w.norm(dim=-1).mean()) / math.sqrt(w.shape[1])
    picks = torch.randint(0, w.shape[0], (rows // 2,), generator=g)
    h = torch.cat([torch.randn(rows - rows // 2, w.shape[1], generator=g) * scale * 40, w[picks] * 10])
    approx = F.linear(h.to(torch.bfloat16), head.weight_bf16).double()
    truth = h.double() @ w.double().t()
    per_norm, per_value, absolute = row_bound_factors(w.shape[1])
    bound = (torch.outer(h.double().norm(dim=-1), head.row_norms.double()) * per_norm
             + approx.abs().amax(dim=-1, keepdim=True) * per_value + absolute)
    return bool(((approx - truth).abs() <= bound).all())
