"""`--kernels q8` (q8_linear.py): GGUF codes against activations quantized to 8 bits per block of 32, llama.cpp's
arithmetic. The kernel computes exactly the quantized product (to float32 rounding), every build gives the same
bits, a row's output never depends on the pass's width (fused layers included), speculation stays equal to plain
decoding under it, and what it cannot serve is refused by name."""

from __future__ import annotations

import pytest
import torch

from diffspec import kernels as K
from diffspec import llama_pass as LP
from diffspec import packed_linear as P
from diffspec import q8_linear as Q
from diffspec.backends import check_backend_settings
from diffspec.cache import new_cache
from diffspec.engine import SpeculativeEngine
from diffspec.errors import DiffspecError
from diffspec.policies import make_policy
from diffspec.target import Target

from conftest import make_model
from helpers import RandomDrafter, ScriptedDrafter
from test_fused_layers import (assert_engine_samples_the_targets_distribution, assert_wide_passes_equal_one_row_steps,
                               packed_target, record_fused_calls)
from test_llama_pass import same_bits
from test_packed_linear import ISAS, coded_model, gguf_weight

pytestmark = pytest.mark.skipif(Q.unavailable() is not None or P.unavailable() is not None,
                                reason=f"q8 kernel: {Q.unavailable() or P.unavailable()}")

#: the AVX2 build with F16C too (what -march=native gives an AVX2 CPU: its float16 scales converted by vcvtph2ps; without
#: it, in plain C)
BUILDS = {"native": P.NATIVE, **ISAS, "avx2+f16c": ("-mavx2", "-mfma", "-mf16c")}
#: input widths: one pair (32), an odd pair (96: three blocks), the most pairs (480: 15 blocks, 8 pairs; 992: a group
#: and 8 pairs), groups of 16 blocks with and without pairs after them
WIDTHS = (32, 96, 480, 512, 544, 576, 992, 1536)


def has_avx2() -> bool:
    return "avx2" in open("/proc/cpuinfo").read()


@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("k", WIDTHS)
def test_it_computes_the_quantized_product_the_same_on_every_build_and_at_every_width(kind, k):
    w = gguf_weight(kind, 37, k, seed=k)
    weight = Q.Q8Weight.of(P.pack(w))
    x = torch.randn(19, k, generator=torch.Generator().manual_seed(k)) * 3
    x[4, :32] = 0.0                                         # a block of zeros: scale 0, no division by it
    x[5, 7] = 1e4                                           # an outlier: its block's other values round to ~0
    x[6, -32:] = 1e-38                                      # so small that 1 / scale overflows: codes 0, no NaN
    exact = Q.dequantized_activations(x).double() @ w.double().T   # what 8-bit activations give, in float64
    outs = {}
    for name, flags in BUILDS.items():
        if name.startswith("avx2") and not has_avx2():
            continue
        lib = Q.library(flags)
        assert name == "native" or lib.diffspec_q8_isa().decode() == name.split("+")[0]
        outs[name] = Q.q8_linear(x, weight, lib=lib)
        one_by_one = torch.cat([Q.q8_linear(x[i:i + 1], weight, lib=lib) for i in range(19)])
        for rows in (2, 3, 8, 9, 16, 19):                   # a row's bits never depend on the pass's width
            assert same_bits(Q.q8_linear(x[:rows], weight, lib=lib), one_by_one[:rows]), (name, rows)
    for name, out in outs.items():
        assert same_bits(out, outs["native"]), name         # the builds agree bitwise
    assert same_bits(Q.q8_linear(x, weight, threads=3), outs["native"])  # and so do any threads' shares
    assert torch.isfinite(outs["native"]).all()
    scale = exact.abs().max().item()
    err = (outs["native"].double() - exact).abs().max().item()
    assert err < 1e-5 * scale                                # float32 rounding of the block sums, no more
    # and it is the quantized product, not the float32 one: that one is ~100x farther away
    assert (w.double() @ x.double().T).T.sub(exact).abs().max().item() > 100 * err


def test_the_layout_keeps_rows_apart_so_stacked_and_sliced_packs_compute_alike():
    """llama_pass stacks q/k/v (and gate/up) packs into one and hands each layer views of its rows."""
    a, b = (P.pack(gguf_weight("q4_1", n, 544, seed=n)) for n in (24, 40))
    a, b = (P.PackedWeight(p.kind, p.codes, p.scales, p.offsets, p.source, Q.Q8Weight.of(p)) for p in (a, b))
    stacked = LP._stacked([a, b])
    x = torch.randn(5, 544, generator=torch.Generator().manual_seed(0))
    together = Q.run_pack(x, stacked)
    assert same_bits(together, torch.cat([Q.run_pack(x, a), Q.run_pack(x, b)], 1))
    assert same_bits(Q.run_pack(x, LP._rows_of(stacked, 24, 64, b.source)), together[:, 24:])
    mixed = P.PackedWeight(b.kind, b.codes, b.scales, b.offsets, b.source)  # one float32 pack among q8 ones
    assert LP._stacked([a, mixed]) is None


def q8_target(fused: bool = True, hidden: int = 64) -> Target:
    """A coded tiny model as `--kernels q8` runs it (plan, packs, direct pass, fused or not)."""
    target = Target(coded_model(hidden=hidden), kernels="q8")  # (scaled by powers of two: float16 scales, as a GGUF's)
    assert target.linear_plan.q8 and "8-bit activations" in target.runtime()["linear_plan"]
    if not fused:
        target.direct_pass = LP.LlamaPass(target.model, target.linear_plan, fused=False)
    assert (target.direct_pass.fused is not None) == fused
    return target


@pytest.mark.parametrize("hidden", [64, 544], ids=["pairs", "groups-and-pairs"])
@pytest.mark.parametrize("isa", ["native", *sorted(ISAS)])
def test_fused_layers_under_q8_keep_a_row_bitwise_the_same_at_every_width(isa, hidden):
    """hidden 64: every layer's input a pair or two of blocks; 544 (17 blocks; the MLP's 1088, 34): groups of 16
    blocks and a pair after them, in every product of the fused call."""
    if isa == "avx2" and not has_avx2():
        pytest.skip("this CPU has no AVX2")
    target = q8_target(hidden=hidden)
    direct = target.direct_pass
    if isa != "native":
        direct.fused = LP.FusedLayers(direct.layers, direct.heads, direct.kv_heads, direct.head_dim,
                                      target.model.config.hidden_size, isa_flags=ISAS[isa])
        assert direct.fused.isa == isa
    ids = torch.randint(3, 96, (90,), generator=torch.Generator().manual_seed(2))
    assert target.kv_storage == torch.float16  # (the cache q8 runs on: float16 keys and values)
    assert_wide_passes_equal_one_row_steps(direct, target.model.config, ids, storage=target.kv_storage)
    K.uninstall(target.model)


@pytest.mark.parametrize("isa", ["native", *sorted(ISAS), "avx2-f16c", "f16c-only"])
def test_keys_and_values_round_to_float16_as_torch_rounds_on_every_build(isa):
    """fused_layers.c's float16 rounding (plain C, and the build's vector form) is torch's (to nearest, ties to
    even): normals, ties, subnormals, the overflow edge, infinities, NaN, zeros. "f16c-only": a CPU with F16C but
    neither AVX2 nor FMA (Ivy Bridge) builds the library too, with the plain C forms (it once did not compile)."""
    from diffspec import fused_layers as FL
    if isa.startswith("avx2") and not has_avx2():
        pytest.skip("this CPU has no AVX2")
    flags = {"native": FL.NATIVE, "avx2-f16c": ("-mavx2", "-mfma", "-mf16c"), "f16c-only": ("-mf16c",)}.get(isa) \
        or ISAS[isa]
    lib = FL.build_library(flags)
    assert not isinstance(lib, Exception), lib
    g = torch.Generator().manual_seed(0)
    halves = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    ties = (halves[:-1] + halves[1:]) / 2  # exactly halfway between neighbouring halves (float32 holds them)
    x = torch.cat([torch.randn(4096, generator=g) * 10.0 ** torch.randint(-9, 6, (4096,), generator=g),
                   halves, ties[torch.isfinite(ties)], torch.tensor([65504.0, 65519.99, 65520.0, 7e4, -7e4, 0.0,
                   -0.0, 2.0 ** -25, 2.0 ** -25 * 1.0001, 2.0 ** -24, 2.0 ** -14, 2.0 ** -14 * 0.99,
                   float("inf"), float("-inf"), float("nan")])]).contiguous()
    scalar, vector = torch.empty(x.numel(), dtype=torch.int16), torch.empty(x.numel(), dtype=torch.int16)
    lib.diffspec_half_round_check(x.data_ptr(), x.numel(), scalar.data_ptr(), vector.data_ptr())
    want = x.half().view(torch.int16)
    finite = ~torch.isnan(x)
    assert torch.equal(scalar[finite], want[finite]) and torch.equal(vector[finite], want[finite])
    assert torch.isnan(scalar.view(torch.float16)[~finite]).all() and torch.isnan(vector.view(torch.float16)[~finite]).all()


def test_a_q8_targets_cache_holds_float16_keys_and_values_rounded_from_its_float32_ones():
    """Under q8 the target's cache holds float16 keys and values (llama.cpp's cache; half the bytes attention
    reads): layer 0's keys are the float32 pass's rounded to nearest even, the logits stay within the rounding's
    reach of a float32 cache's, and the runtime and the cost key say so."""
    target = q8_target()
    assert target.kv_storage == torch.float16 and "float16" in target.runtime()["cache"]
    ids = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(8))
    target.reset()
    half_logits = target.forward(ids).logits
    layer0 = target._cache.layers[0]
    assert layer0._keys.dtype == torch.float16 and layer0.keys.dtype == torch.float16
    f32_cache = new_cache(target.model.config)
    f32_logits = target.direct_pass.forward(ids.view(1, -1), f32_cache).logits[0]
    assert f32_cache.layers[0]._keys.dtype == torch.float32
    assert same_bits(layer0.keys, f32_cache.layers[0].keys.half())
    assert same_bits(layer0.values, f32_cache.layers[0].values.half())
    assert not torch.equal(half_logits, f32_logits)
    torch.testing.assert_close(half_logits, f32_logits, rtol=0, atol=0.05 * f32_logits.abs().max().item())
    float32 = Target(coded_model(), kernels="multi-row")
    assert float32.kv_storage is None and "float16" not in float32.runtime()["cache"]
    keyed = target.base_fingerprint
    target._fingerprint, target.kv_storage = None, None  # the same target keyed as if its cache held float32
    assert target.base_fingerprint != keyed
    K.uninstall(target.model)
    K.uninstall(float32.model)


@pytest.mark.parametrize("hidden", [64, 128, 256], ids=["head-16", "head-32", "head-64"])
@pytest.mark.parametrize("isa", ["native", "avx2-f16c"])
def test_scores_a_block_at_a_time_leave_a_q8_pass_on_the_float16_cache_bitwise_unchanged(isa, hidden):
    """The fused call's attention on the float16 cache, scores summed a block at a time (the default) or one position
    at a time (-DATTEND_TRANSPOSED=0): the same logits bitwise, at 1-9 rows past a 100-token context, at heads of 1-4
    vectors on AVX-512 and 2-8 on AVX2 (there 8-vector heads keep the per-position sums: the same either way)."""
    from diffspec import fused_layers as FL
    if isa != "native" and not has_avx2():
        pytest.skip("this CPU has no AVX2")
    flags = FL.NATIVE if isa == "native" else ("-mavx2", "-mfma", "-mf16c")
    target = q8_target(hidden=hidden)
    fused = target.direct_pass.fused
    libs = (FL.build_library(flags), FL.build_library(flags + ("-DATTEND_TRANSPOSED=0",)))
    ids = torch.randint(3, 96, (110,), generator=torch.Generator().manual_seed(10))
    for n in (1, 2, 5, 9):
        got = []
        for lib in libs:
            fused.lib = lib
            target.reset()
            target.forward(ids[:100])
            got.append(target.forward(ids[100:100 + n]).logits)
        fused.lib = libs[0]
        assert target._cache.layers[0]._keys.dtype == torch.float16
        assert same_bits(got[0], got[1]), n
    K.uninstall(target.model)


def test_a_q8_target_runs_the_fused_call_at_any_width_a_long_prefill_included(monkeypatch):
    """Under q8 the packed kernel is the arithmetic, not a choice per width: a pass wider than the plan's last
    bucket (64 rows) runs the fused call too, and its rows equal one-row steps bitwise."""
    target = q8_target()
    widths = record_fused_calls(monkeypatch)
    ids = torch.randint(3, 96, (90,), generator=torch.Generator().manual_seed(7))
    target.reset()
    wide = target.forward(ids[:80]).logits
    target.reset()
    target.forward(ids[:10])
    steps = torch.cat([target.forward(ids[i:i + 1]).logits for i in range(10, 80)], dim=-2)
    assert widths[0] == (80, True) and all(ran for _, ran in widths)
    assert same_bits(wide[..., 10:, :], steps)
    K.uninstall(target.model)


def test_fused_and_torch_operation_passes_under_q8_agree_and_differ_from_float32():
    fused, ops, f32 = q8_target(), q8_target(fused=False), packed_target(coded_model())
    ids = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(5)).view(1, 30)
    got = fused.direct_pass.forward(ids, new_cache(fused.model.config)).logits
    want = ops.direct_pass.forward(ids, new_cache(ops.model.config)).logits
    other = f32.direct_pass.forward(ids, new_cache(f32.model.config)).logits
    # the same arithmetic up to the norms' and attention's last bits; such a bit can move an activation across a
    # rounding boundary of its 8-bit code (one code step, which this model's weights, codes times 30, amplify), so
    # the check is on the rows: at most one of 30 rows off by more than 1e-3, and far closer than float32's
    diff, far = (got - want).abs(), (other - want).abs()
    assert (diff.amax(-1) > 1e-3).sum().item() <= 1
    assert diff.mean().item() < far.mean().item() / 50 and diff.max().item() < far.max().item() / 10
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert not torch.equal(other.argmax(-1), want.argmax(-1))  # float32 is another target: its argmax moved here
    for t in (fused, ops, f32):
        K.uninstall(t.model)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch-ops"])
@pytest.mark.parametrize("gamma", [1, 4, 12])
def test_greedy_speculation_under_q8_equals_plain_decoding_under_q8(fused, gamma):
    target = q8_target(fused)
    prompt = list(range(5, 17))
    plain = SpeculativeEngine(target, None).generate(prompt, max_new_tokens=40, stop_token_ids=[]).token_ids
    for drafter in (ScriptedDrafter(prompt + plain), RandomDrafter(96, seed=4)):
        result = SpeculativeEngine(target, drafter, make_policy("fixed", gamma=gamma)).generate(
            prompt, max_new_tokens=40, stop_token_ids=[])
        assert result.token_ids == plain
    assert result.mean_accepted_length < 2  # the random drafter was rejected too: the check compared something
    K.uninstall(target.model)


def test_sampled_speculation_under_q8_samples_the_q8_targets_distribution():
    target = Target(coded_model(vocab=8, scale=1.0, head_scale=0.125), kernels="q8")  # 2^-3: the head stays codes
    assert target.direct_pass.fused is not None
    assert_engine_samples_the_targets_distribution(target)
    K.uninstall(target.model)


def test_a_q8_target_keys_its_costs_apart_from_float32_over_the_same_packs():
    q8 = q8_target()
    f32 = packed_target(coded_model())  # every layer packed at every width too: the same plan but for q8
    assert f32.linear_plan.packed_rows == q8.linear_plan.packed_rows
    assert q8.base_fingerprint != f32.base_fingerprint
    for t in (q8, f32):
        K.uninstall(t.model)


def test_what_q8_cannot_serve_is_refused_by_name():
    with pytest.raises(DiffspecError, match="not: .*64x64"):  # a float32 model: its layers would not be q8
        Target(make_model(96, seed=1, hidden=64, dtype=torch.float32), kernels="q8")
    with pytest.raises(DiffspecError, match="--compile on"):
        check_backend_settings("transformers", None, torch.float32, "cpu", "q8", "on")
    with pytest.raises(DiffspecError, match="runs on the CPU"):
        check_backend_settings("transformers", None, torch.float32, "cuda", "q8", "off")
    with pytest.raises(DiffspecError, match="--dtype bfloat16"):
        check_backend_settings("transformers", None, torch.bfloat16, "cpu", "q8", "off")
    with pytest.raises(DiffspecError, match="applies to the transformers backend"):
        check_backend_settings("llama.cpp", None, torch.float32, "cpu", "q8", "off")


def test_the_weight_prefetch_is_only_a_hint_both_kernels_compute_the_same_bits_without_it():
    """q8_linear.c and packed_linear.c ask for weight rows ahead (non-temporal prefetch): built without it
    (-DQ8_PREFETCH=0 -DPACKED_PREFETCH=0), every output is bitwise the same, at one row and at many."""
    off = P.NATIVE + ("-DQ8_PREFETCH=0", "-DPACKED_PREFETCH=0")
    x = torch.randn(19, 576, generator=torch.Generator().manual_seed(2))
    for kind in ("q4_1", "q8_0"):
        packed = P.pack(gguf_weight(kind, 300, 576, seed=7))  # more rows than the prefetch distance, a tile's tail
        weight = Q.Q8Weight.of(packed)
        for rows in (1, 3, 19):
            assert torch.equal(Q.q8_linear(x[:rows], weight, lib=Q.library(off)).view(torch.int32),
                               Q.q8_linear(x[:rows], weight).view(torch.int32))
            with_it = P._run_kernel(x[:rows], packed.codes, packed.scales, packed.offsets)
            without = P._run_kernel(x[:rows], packed.codes, packed.scales, packed.offsets, lib=P.build_library(off))
            assert torch.equal(with_it.view(torch.int32), without.view(torch.int32))


def test_a_row_streams_the_bytes_the_gguf_holds():
    """A one-row step is bound by the bytes it streams: the layout holds the GGUF's float16 scales and offsets, not
    float32 ones padded to 16 a group (a Q4_1 row of 576 took 544 bytes, 360 in the file)."""
    for kind, block_bytes in (("q4_1", 20), ("q8_0", 34)):        # 2 + 2 + 16 / 2 + 32 bytes a block of 32
        weight = Q.Q8Weight.of(P.pack(gguf_weight(kind, 8, 576)))
        parts = (weight.codes, weight.scales) + ((weight.offsets,) if kind == "q4_1" else ())
        assert sum(t.numel() * t.element_size() for t in parts) == 8 * 18 * block_bytes
        assert weight.scales.dtype == torch.float16 and weight.scales.shape == (8, 18)


def test_codes_whose_scales_are_not_float16_are_refused_by_name():
    w = gguf_weight("q4_1", 8, 64) * 30.0       # codes still (scale d * 30, offset m * 30), but no longer float16
    packed = P.pack(w)
    assert packed is not None and not torch.equal(packed.scales.half().float(), packed.scales)
    with pytest.raises(Q.NotHalfScales, match="scales are not all float16"):
        Q.Q8Weight.of(packed)
    with pytest.raises(DiffspecError, match=r"not: .*\(the scales are not all float16"):
        Target(coded_model(scale=30.0), kernels="q8")


def test_a_drafters_q8_codes_take_float16_scales_and_stay_within_half_a_step():
    w = torch.randn(24, 96, generator=torch.Generator().manual_seed(5)) * 0.05
    w[3, :32] = 0.0                                   # a block of zeros: scale 0, codes 0
    w[4, 32:64] = 1e-7                                # under float16's least scale: scale 0, codes 0 (no division by 0)
    packed = Q.quantized_pack(w)
    assert torch.equal(packed.scales.half().float(), packed.scales)
    assert packed.codes.abs().max() <= 127 and packed.q8.scales.dtype == torch.float16
    step = packed.scales.repeat_interleave(32, dim=1)
    err = (packed.decode() - w).abs()
    assert (err <= step / 2 * (1 + 1e-3) + 1e-6).all()
    assert torch.equal(packed.decode()[3, :32], torch.zeros(32)) and torch.equal(packed.decode()[4, 32:64], torch.zeros(32))
    with pytest.raises(ValueError, match="float16 scales"):
        Q.quantized_pack(torch.full((2, 32), 1e7))
    with pytest.raises(ValueError, match="finite"):
        Q.quantized_pack(torch.full((2, 32), float("nan")))


def test_the_fused_calls_work_buffer_holds_the_widest_quantized_row():
    """A quantized row's bytes do not grow with its width (480 inputs take more than 512): the buffer is sized by
    the largest of the three inputs' rows, not by the widest input's."""
    lib = LP.FusedLayers(q8_target().direct_pass.layers, 4, 2, 16, 64).lib
    n, D, H, KV, hd, F, positions, threads = 5, 480, 4, 2, 120, 512, 100, 2
    rest = n * D + n * (H + 2 * KV) * hd + n * H * hd + n * 2 * F + n * F + threads * positions
    assert lib.diffspec_q8_xrow_bytes(480) > lib.diffspec_q8_xrow_bytes(512)
    room = lib.diffspec_fused_work_floats(n, D, H, KV, hd, F, positions, threads) - rest
    assert 4 * room >= n * lib.diffspec_q8_xrow_bytes(480) + 63


@pytest.mark.parametrize("then", ["auto", "stock"])
def test_a_model_loaded_for_q8_then_for_float32_computes_in_float32_again(then):
    ids = torch.tensor([5, 9, 11, 3, 7, 30, 2, 44])
    fresh = Target(coded_model(), kernels=then).forward(ids).logits
    model = coded_model()
    q8 = Target(model, kernels="q8").forward(ids).logits
    again = Target(model, kernels=then)
    assert not again.linear_plan.q8
    got = again.forward(ids).logits
    assert same_bits(got, fresh) and not torch.equal(got, q8)
    K.uninstall(model)


@pytest.mark.slow
def test_the_real_target_under_q8_decodes_speculatively_as_it_decodes_plainly():
    from diffspec.api import load_engine

    plain = load_engine(drafter=None, backend="transformers", kernels="q8", quiet=True)
    fast = load_engine(drafter="auto", policy="fixed", gamma=6, backend="transformers", kernels="q8", quiet=True)
    assert "8-bit activations" in plain.target.runtime()["linear_plan"]
    assert "fused_layers.c" in plain.target.runtime()["forward"]
    for prompt in ("Write a Python function that checks whether a number is prime.", "What is 17 * 23?"):
        want = plain.generate(prompt, max_new_tokens=64)
        got = fast.generate(prompt, max_new_tokens=64)
        assert got.token_ids == want.token_ids
    assert got.accepted_tokens > 0  # drafts were verified and kept: wide passes ran
