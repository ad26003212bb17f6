"""The packed GGUF-code kernel (packed_linear.py, packed_linear.c): it must compute with exactly the float32
model's weights (the values GGUF's own dequantizer writes), give every row the same bits whatever the
pass's width, refuse weights that are not codes, and leave speculative output equal to plain decoding."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from diffspec import kernels as K
from diffspec import packed_linear as P
from diffspec.engine import SpeculativeEngine
from diffspec.policies import make_policy
from diffspec.target import Target

from conftest import make_model
from helpers import RandomDrafter, ScriptedDrafter

pytestmark = pytest.mark.skipif(P.unavailable() is not None, reason=f"packed kernel: {P.unavailable()}")


def gguf_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF Q4_1 / Q8_0 blocks for an [n, k] tensor, laid out as in a GGUF file (bytes)."""
    rng = np.random.default_rng(seed)
    blocks = n * k // 32
    d = (rng.random(blocks) * 0.02 + 1e-4).astype(np.float16)
    if kind == "q8_0":
        q = rng.integers(-127, 128, (blocks, 32)).astype(np.int8)
        q[:, 0] = 127 * rng.choice([-1, 1], blocks)  # the quantizer's largest magnitude
        return np.concatenate([d.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], axis=1)
    m = (-rng.random(blocks) * 0.1).astype(np.float16)
    q = rng.integers(0, 16, (blocks, 32)).astype(np.uint8)
    q[:, 3], q[:, 17] = 0, 15  # the quantizer's block minimum and maximum
    nibbles = q[:, :16] | (q[:, 16:] << 4)
    return np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2), nibbles], axis=1)


def gguf_weight(kind: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """The float32 weight GGUF's reference dequantizer (gguf-py) writes for random blocks: what a converted model holds."""
    from gguf import GGMLQuantizationType, quants

    qtype = GGMLQuantizationType.Q8_0 if kind == "q8_0" else GGMLQuantizationType.Q4_1
    return torch.from_numpy(quants.dequantize(gguf_blocks(kind, n, k, seed), qtype).reshape(n, k).astype(np.float32))


def coded_model(vocab: int = 96, seed: int = 3, scale: float = 32.0, head_scale: float = 8.0,
                hidden: int = 64) -> torch.nn.Module:
    """A tiny float32 Llama whose linear layers are Q4_1 codes and whose head is Q8_0 codes (as the default target).
    Scaled by powers of two, the codes' scales stay float16 values, as a GGUF's are (what `--kernels q8` reads)."""
    model = make_model(vocab, seed=seed, hidden=hidden, dtype=torch.float32)
    with torch.no_grad():
        for i, (name, mod) in enumerate(model.named_modules()):
            if isinstance(mod, torch.nn.Linear):
                n, k = mod.weight.shape
                w = gguf_weight("q8_0" if name == "lm_head" else "q4_1", n, k, seed=seed * 100 + i)
                mod.weight.copy_(w * (scale if name != "lm_head" else head_scale))  # scaled codes are codes too
    return model


def bits(t: torch.Tensor) -> torch.Tensor:
    """The float32 bit patterns (torch.equal would take -0.0 for +0.0)."""
    return t.contiguous().view(torch.int32)


def every_bucket_packed(model) -> K.LinearPlan:
    return K.LinearPlan(packed_rows={shape: frozenset(K.ROW_BUCKETS) for shape in K.linear_groups(model)})


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_pack_finds_the_codes_of_gguf_dequantized_weights_bitwise(kind):
    w = gguf_weight(kind, 40, 96)
    packed = P.pack(w)
    assert packed is not None and packed.kind == kind[:2] and packed.shape == (40, 96)
    assert torch.equal(bits(packed.decode()), bits(w))
    assert packed.nbytes < w.numel() * w.element_size() / (2.5 if kind == "q8_0" else 4)


def test_pack_refuses_weights_that_are_not_codes():
    w = gguf_weight("q4_1", 8, 64)
    assert P.pack(torch.randn(8, 64)) is None  # trained float32
    assert P.pack(w.bfloat16()) is None and P.pack(w.double()) is None  # not float32
    assert P.pack(gguf_weight("q4_1", 8, 96)[:, :80].contiguous()) is None  # inputs not a multiple of 32
    nudged = w.clone()
    nudged[5, 40] = torch.nextafter(nudged[5, 40], torch.tensor(1.0))  # one weight off its code by one ulp
    assert P.pack(nudged) is None


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_the_kernel_computes_with_the_float32_weights_exactly(kind):
    """One-hot rows read back every weight bitwise (the kernel decodes to the float32 model's values), and
    any rows give F.linear's products to float32 rounding."""
    w = gguf_weight(kind, 70, 128, seed=1)
    packed = P.pack(w)
    assert torch.equal(bits(P.packed_linear(torch.eye(128), packed)), bits(w.t()))
    x = torch.randn(3, 5, 128, generator=torch.Generator().manual_seed(0))
    bias = torch.randn(70)
    y = P.packed_linear(x, packed, bias)
    assert y.shape == (3, 5, 70)
    torch.testing.assert_close(y, F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    assert torch.allclose(y.double(), F.linear(x.double(), w.double(), bias.double()), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_a_row_gets_the_same_bits_in_every_pass_width(kind):
    w = gguf_weight(kind, 51, 96, seed=2)  # an odd count: the last weight row goes alone where the others go in pairs
    packed = P.pack(w)
    x = torch.randn(40, 96, generator=torch.Generator().manual_seed(1))
    one_by_one = torch.cat([P.packed_linear(x[i:i + 1], packed) for i in range(40)])
    for rows in (2, 3, 7, 8, 9, 17, 40):
        assert torch.equal(P.packed_linear(x[:rows], packed), one_by_one[:rows]), rows



@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_rows_of_a_long_weight_row_keep_their_bits_where_narrow_passes_take_pairs(kind):
    """Rows of 1536 inputs: from 5 rows the x rows of a group outgrow the L1 cache and the kernel takes weight rows
    in pairs (TAKES_PAIRS in packed_linear.c); each row's output must stay a one-row step's, bitwise."""
    lib = P._library()
    if lib.diffspec_packed_isa().decode() == "avx512f":  # the builds with pairs: the rule takes them here
        assert [lib.diffspec_takes_pairs(r, 1536) for r in range(1, 10)] == [0, 0, 0, 0, 1, 1, 1, 1, 1]
        assert [lib.diffspec_takes_pairs(r, 96) for r in range(1, 10)] == [0] * 8 + [1]
    w = gguf_weight(kind, 33, 1536, seed=4)  # odd: the last weight row goes alone
    packed = P.pack(w)
    x = torch.randn(9, 1536, generator=torch.Generator().manual_seed(3))
    one_by_one = torch.cat([P.packed_linear(x[i:i + 1], packed) for i in range(9)])
    for rows in range(2, 10):
        assert torch.equal(P.packed_linear(x[:rows], packed), one_by_one[:rows]), rows
    torch.testing.assert_close(one_by_one, F.linear(x, w), rtol=1e-4, atol=1e-4)

ISAS = {"avx2": ("-mavx2", "-mfma"), "scalar": ()}


@pytest.mark.parametrize("isa", sorted(ISAS))
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_every_vector_width_decodes_exactly_and_keeps_rows_invariant(isa, kind):
    """The narrower builds other CPUs run (AVX2 on the AVX2-only kind; scalar without either), built here too."""
    if isa == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    lib = P.build_library(ISAS[isa])
    assert not isinstance(lib, P.KernelUnavailable), lib
    assert lib.diffspec_packed_isa().decode() == isa
    w = gguf_weight(kind, 37, 96, seed=5)
    packed = P.pack(w)

    def run(x):
        return P._run_kernel(x, packed.codes, packed.scales, packed.offsets, lib=lib)

    assert torch.equal(run(torch.eye(96)), w.t())
    x = torch.randn(19, 96, generator=torch.Generator().manual_seed(2))
    one_by_one = torch.cat([run(x[i:i + 1]) for i in range(19)])
    for rows in (3, 4, 5, 9, 19):
        assert torch.equal(run(x[:rows]), one_by_one[:rows]), rows
    torch.testing.assert_close(one_by_one, F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_the_decode_rounds_the_scale_product_and_the_offset_apart():
    """With float32 scales (not GGUF's float16 ones) d * q is inexact, and a fused multiply-add decode would give
    other weights than the dequantizer's (d * q) + m: every build must decode as `PackedWeight.decode` does."""
    g = torch.Generator().manual_seed(7)
    n, k = 64, 128
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.rand(n, k // 32, generator=g) * 0.3 + 0.01
    offsets = -torch.rand(n, k // 32, generator=g)
    packed = P.PackedWeight("q4", codes, scales, offsets)
    want = packed.decode()
    q = torch.cat((codes.view(n, -1, 16) & 15, codes.view(n, -1, 16) >> 4), -1).double()
    fused = (scales.double()[..., None] * q + offsets.double()[..., None]).float().reshape(n, k)  # one rounding
    assert (bits(fused) != bits(want)).sum() > 100  # the case tells the two decodes apart
    for isa in [P.NATIVE, *ISAS.values()]:
        lib = P.build_library(isa)
        got = P._run_kernel(torch.eye(k), codes, scales, offsets, lib=lib)
        assert torch.equal(bits(got), bits(want.t())), isa


def test_a_pack_goes_stale_when_its_weight_changes_and_layers_then_fall_back():
    model = coded_model()
    P.pack_model(model)
    layer = model.model.layers[0].mlp.up_proj
    assert P.current_pack(layer) is layer.packed_weight
    K.install(model, every_bucket_packed(model))
    x = torch.randn(1, 3, 64)
    import copy
    cast = copy.deepcopy(model).to(torch.bfloat16)  # what a drafter's dtype trial does with its copy
    layer_bf16 = cast.model.layers[0].mlp.up_proj
    assert P.current_pack(layer_bf16) is None  # copied with the module, but not its weight's pack any more
    with torch.no_grad():
        torch.testing.assert_close(layer_bf16(x.bfloat16()), F.linear(x.bfloat16(), layer_bf16.weight))  # F.linear
        layer.weight.mul_(2)  # edited in place
    assert P.current_pack(layer) is None
    assert K.plan_path(model) != K.plan_path(coded_model())  # ... so the plan is not the packed model's
    K.uninstall(model)


def test_planning_packs_again_a_model_whose_weights_changed(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFSPEC_COST_CACHE", str(tmp_path))
    model = coded_model()
    K.plan_for_mode(model, "auto")
    layer = model.model.layers[1].self_attn.o_proj
    with torch.no_grad():
        layer.weight.mul_(2)  # twice a code block is a code block
    assert P.current_pack(layer) is None
    K.plan_for_mode(model, "auto")
    assert P.current_pack(layer) is not None and torch.equal(bits(layer.packed_weight.decode()), bits(layer.weight))


def test_packed_linear_refuses_rows_it_cannot_take():
    packed = P.pack(gguf_weight("q4_1", 8, 64))
    with pytest.raises(ValueError, match="float32 CPU rows of 64"):
        P.packed_linear(torch.randn(2, 32), packed)
    with pytest.raises(ValueError, match="float32 CPU rows of 64"):
        P.packed_linear(torch.randn(2, 64, dtype=torch.float64), packed)


def test_pack_model_packs_a_tied_head_once_and_only_coded_layers():
    model = coded_model()
    model.model.layers[1].mlp.down_proj.weight.data.add_(1e-3)  # no longer codes
    found = P.pack_model(model)
    assert found[(64, 128)] is False and found[(128, 64)] is True and found[(96, 64)] is True
    assert model.model.layers[1].mlp.down_proj.packed_weight is None
    assert model.model.layers[0].mlp.down_proj.packed_weight is not None
    assert model.lm_head.packed_weight.kind == "q8"


def test_without_a_compiler_nothing_is_packed_and_the_user_is_told(monkeypatch, capsys):
    monkeypatch.setattr(P, "_library", lambda: P.KernelUnavailable("no C compiler found (set $CC)"))
    model = coded_model()
    found = P.pack_model(model, quiet=False)
    assert found and not any(found.values())
    assert all(m.packed_weight is None for ms in K.linear_groups(model).values() for m in ms)
    assert "cannot run here (no C compiler found (set $CC)): float32 kernels only" in capsys.readouterr().err
    plan = K.measure_plan(model, reps=1)
    assert not plan.packed_rows  # and the plan routes nothing to it


def test_measured_plan_times_the_packed_kernel_where_layers_are_codes(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFSPEC_COST_CACHE", str(tmp_path))
    model = coded_model()
    plan = K.plan_for_mode(model, "auto")
    assert set(plan.packed_rows) == set(K.linear_groups(model))
    for shape, rows in plan.packed_rows.items():
        timed = plan.timings_us[f"{shape[0]}x{shape[1]}"]
        assert len(timed[1]) == 3  # F.linear, mm, packed
        multi = sorted(rows - {1})
        assert multi == list(K.ROW_BUCKETS[1:1 + len(multi)])  # a prefix from 2 rows, as for mm
    assert K.LinearPlan.from_json(plan.to_json()) == plan
    assert K.plan_for_mode(model, "multi-row").packed_rows == {s: r - {1} for s, r in plan.packed_rows.items()}
    plain = make_model(96, seed=3, hidden=64, dtype=torch.float32)  # same shapes, trained-like weights: another plan
    assert K.plan_path(plain) != K.plan_path(model) and not K.plan_for_mode(plain, "auto").packed_rows


def test_routed_packed_layers_give_float32_logits_and_stock_kernels_undo_them(monkeypatch):
    calls, original = [], P._run_kernel
    monkeypatch.setattr(P, "_run_kernel", lambda *a: calls.append(1) or original(*a))
    model = coded_model()
    ids = torch.randint(5, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = coded_model().double()(ids).logits  # the same weights in float64
        want = model(ids).logits
        P.pack_model(model)
        K.install(model, every_bucket_packed(model))
        got = model(ids).logits
        assert len(calls) == 2 * 7 + 1  # every linear layer of both blocks and the head
        # float32 rounding apart from F.linear's, of the size of F.linear's own distance from float64
        assert (got.double() - exact).abs().mean() <= 3 * (want.double() - exact).abs().mean()
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
        with K.stock_kernels(model):
            assert torch.equal(model(ids).logits, want) and len(calls) == 15
    K.uninstall(model)


@pytest.mark.parametrize("gamma", [1, 4, 12])
def test_greedy_speculation_with_packed_kernels_equals_plain(gamma):
    tok_ids = list(range(5, 17))
    routed = Target(coded_model())
    P.pack_model(routed.model)
    K.install(routed.model, every_bucket_packed(routed.model))
    plain = SpeculativeEngine(routed, None).generate(tok_ids, max_new_tokens=40, stop_token_ids=[]).token_ids
    for drafter in (ScriptedDrafter(tok_ids + plain), RandomDrafter(96, seed=4)):
        engine = SpeculativeEngine(routed, drafter, make_policy("fixed", gamma=gamma))
        assert engine.generate(tok_ids, max_new_tokens=40, stop_token_ids=[]).token_ids == plain


def test_packed_layers_compile():
    """The kernel is a torch custom op: the whole forward compiles as one graph around it (fullgraph), and gives
    the eager logits to float32 rounding (inductor fuses the other operations its own way, as for any model)."""
    model = coded_model()
    P.pack_model(model)
    K.install(model, every_bucket_packed(model))
    ids = torch.randint(5, 96, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        eager = model(ids).logits
        compiled = torch.compile(model, dynamic=False, fullgraph=True)(ids).logits
    torch._dynamo.reset()
    K.uninstall(model)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


def _argmax_cases():
    g = torch.Generator().manual_seed(7)
    rows = [torch.randn(49152, generator=g), torch.randn(37, generator=g)]  # a width with a tail past the vectors
    tie = torch.randn(100, generator=g)
    tie[[17, 40, 99]] = tie.max() + 1  # equal largest values: the first
    zeros = torch.full((35,), -1.0)
    zeros[[5, 20]] = torch.tensor([-0.0, 0.0])  # -0.0 == 0.0: the first of them
    nan = torch.randn(70, generator=g)
    nan[[3, 50]] = float("nan")  # NaN wins, the first one (torch.argmax's rule)
    late_nan = torch.randn(67, generator=g)
    late_nan[66] = float("nan")  # only in the scalar tail
    inf = torch.full((48,), float("-inf"))
    pos_inf = torch.randn(33, generator=g)
    pos_inf[[9, 31]] = float("inf")
    return rows + [tie, zeros, nan, late_nan, inf, pos_inf, torch.tensor([2.5])]


@pytest.mark.parametrize("isa", ["native"] + sorted(ISAS))
def test_argmax_rows_gives_torchs_argmax(isa):
    """The greedy choice read from a pass's logits in C (packed_linear.argmax_rows): the same index as torch.argmax
    for ties, signed zeros, NaNs (anywhere, the tail included), infinities, any width and several rows at once."""
    if isa == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    lib = P._library() if isa == "native" else P.build_library(ISAS[isa])
    assert not isinstance(lib, P.KernelUnavailable), lib
    for row in _argmax_cases():
        for stack in (row[None], row.repeat(3, 1)):
            out = torch.empty(stack.shape[0], dtype=torch.int64)
            lib.diffspec_argmax_rows(stack.data_ptr(), stack.shape[0], stack.shape[1], out.data_ptr())
            assert torch.equal(out, stack.argmax(dim=-1)), (row.shape, out, stack.argmax(dim=-1))
    logits = torch.randn(1, 5, 4097)
    assert torch.equal(P.argmax_rows(logits), logits.argmax(dim=-1))
    assert P.argmax_rows(logits.double()).dtype == torch.int64  # other dtypes: torch's own
    assert torch.equal(P.argmax_rows(logits[..., ::2]), logits[..., ::2].argmax(dim=-1))  # not contiguous: torch's
