"""Every decoder layer in one C call (fused_layers.py): rows bitwise invariant to the pass's width (what keeps
speculative output equal to plain decoding), transformers' values to float32 rounding, the cache written as the
torch operations write it, and the call taken only where every layer runs packed at that width."""

from __future__ import annotations

import pytest
import torch

from diffspec import attention
from diffspec import fused_layers as FL
from diffspec import kernels as K
from diffspec import llama_pass as LP
from diffspec import packed_linear as P
from diffspec.cache import new_cache, truncate_cache
from diffspec.engine import SpeculativeEngine
from diffspec.policies import make_policy
from diffspec.target import Target

from helpers import RandomDrafter, ScriptedDrafter
from test_llama_pass import PASSES, same_bits
from test_packed_linear import ISAS, coded_model, every_bucket_packed


pytestmark = pytest.mark.skipif(P.unavailable() is not None, reason=f"packed kernel: {P.unavailable()}")


def passes(model, plan=None, isa_flags=None):
    """(the fused pass, the torch operations' pass) over one packed model."""
    fused = LP.LlamaPass(model, plan)
    if isa_flags is not None:
        fused.fused = FL.FusedLayers(fused.layers, fused.heads, fused.kv_heads, fused.head_dim,
                                     model.config.hidden_size, isa_flags=isa_flags)
    assert fused.fused is not None and fused.fused.fits
    return fused, LP.LlamaPass(model, plan, fused=False)


@pytest.fixture(scope="module", params=[64, 96], ids=["head-dim-16", "head-dim-24"])
def packed(request):
    """Heads of 16 dimensions take the vector-register attention on every build; of 24, its any-width loop on
    AVX-512 (16 lanes) and AVX2 (24 = 3 vectors of 8: not a width it unrolls)."""
    model = coded_model(hidden=request.param, seed=3 if request.param == 64 else 4)
    assert all(P.pack_model(model).values())  # every layer codes: else the torch operations would run some passes
    plan = every_bucket_packed(model)
    K.install(model, plan)
    attention.install(model)
    yield model, plan
    K.uninstall(model)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    """float32 rounding apart: within 1e-4 of the largest magnitude (this model's weights are codes times 30, which
    amplifies roundings to ~2e-5 of the logits' ~200; a wrong rotation, position or norm is off by far more)."""
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4 * max(1.0, b.abs().max().item()))


def test_it_gives_the_torch_operations_values_at_every_width_through_rollbacks(packed):
    model, plan = packed
    fused, ops = passes(model, plan)
    ids = torch.randint(3, 96, (200,), generator=torch.Generator().manual_seed(1))
    ours, theirs = new_cache(model.config), new_cache(model.config)
    pos = 0
    for n, back in PASSES:
        x = ids[pos:pos + n].view(1, n)
        got = fused.forward(x, ours, output_hidden_states=True)
        want = ops.forward(x, theirs, output_hidden_states=True)
        close(got.logits, want.logits)
        assert len(got.hidden_states) == len(want.hidden_states)
        for a, b in zip(got.hidden_states, want.hidden_states):
            close(a, b)
        assert torch.equal(got.logits.argmax(-1), want.logits.argmax(-1))
        for cache in (ours, theirs):
            truncate_cache(cache, pos + n - back)
        for a, b in zip(ours.layers, theirs.layers):  # the cache written where and as the torch operations write it
            assert a.length == b.length
            close(a.keys, b.keys)
            close(a.values, b.values)
        pos += n - back


@pytest.mark.parametrize("isa", ["native", *sorted(ISAS)])
def test_a_row_is_bitwise_the_same_in_a_one_row_step_and_in_any_wider_pass(packed, isa):
    """The property speculation rests on: a verify pass of n rows computes each row as n one-row steps would."""
    if isa == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    model, plan = packed
    fused, _ = passes(model, plan, None if isa == "native" else ISAS[isa])
    if isa != "native":
        assert fused.fused.isa == isa
    ids = torch.randint(3, 96, (120,), generator=torch.Generator().manual_seed(2))
    with pytest.raises(Exception):  # a batch of two rows: not this pass's shape (never half computed)
        fused.forward(ids[:6].view(2, 3), new_cache(model.config))
    assert_wide_passes_equal_one_row_steps(fused, model.config, ids)


def assert_wide_passes_equal_one_row_steps(direct, config, ids: torch.Tensor, start: int = 40, storage=None) -> None:
    """After a prefill of `start` tokens, passes of 2-24 rows give bitwise what as many one-row steps give: the
    logits, a layer's output (what a conditioned drafter reads), the last layer's, and the cache's keys (held as
    `storage` where given)."""
    steps_cache = new_cache(config, storage=storage)
    direct.forward(ids[:start].view(1, start), steps_cache)
    steps = [direct.forward(ids[start + i:start + i + 1].view(1, 1), steps_cache, output_hidden_states=True)
             for i in range(24)]
    for n in (2, 3, 5, 8, 9, 16, 24):
        cache = new_cache(config, storage=storage)
        direct.forward(ids[:start].view(1, start), cache)
        wide = direct.forward(ids[start:start + n].view(1, n), cache, output_hidden_states=True)
        assert same_bits(wide.logits[0], torch.cat([s.logits[0] for s in steps[:n]])), n
        for layer in (1, len(wide.hidden_states) - 1):
            assert same_bits(wide.hidden_states[layer][0], torch.cat([s.hidden_states[layer][0] for s in steps[:n]]))
        for a, b in zip(cache.layers, steps_cache.layers):
            assert same_bits(a.keys[:, :, :start + n], b.keys[:, :, :start + n])


def test_the_final_norm_runs_in_the_call_and_the_head_reads_its_rows(packed, monkeypatch):
    """The model's final RMSNorm runs at the end of the fused call (no torch call for it): the last hidden state is
    its rows, within float32 rounding of torch's norm of the last layer's output, and the logits are the head of
    exactly those rows. Where the norm's weight is not a contiguous float32 one the torch norm runs instead."""
    model, plan = packed
    fused, _ = passes(model, plan)
    assert fused.fused.final_norm is model.model.norm
    norm_calls = []
    original = LP._rms_norm
    monkeypatch.setattr(LP, "_rms_norm", lambda x, norm: norm_calls.append(norm) or original(x, norm))
    ids = torch.randint(3, 96, (30,), generator=torch.Generator().manual_seed(5))
    cache = new_cache(model.config)
    for lo, hi in ((0, 20), (20, 21), (21, 24)):
        out = fused.forward(ids[lo:hi].view(1, -1), cache, output_hidden_states=True)
        last_layer, normed = out.hidden_states.outputs[-1].unsqueeze(0), out.hidden_states[-1]  # (the call's buffer)
        close(normed, original(last_layer, model.model.norm))
        assert same_bits(out.logits, model.lm_head(normed))
    assert model.model.norm not in norm_calls
    weight = model.model.norm.weight.data
    model.model.norm.weight.data = weight.repeat_interleave(2)[::2]  # the same values, not contiguous: not the call's
    try:
        out = fused.forward(ids[24:25].view(1, 1), cache, output_hidden_states=True)
        assert model.model.norm in norm_calls
        close(out.hidden_states[-1], original(out.hidden_states.outputs[-1].unsqueeze(0), model.model.norm))
    finally:
        model.model.norm.weight.data = weight


@pytest.mark.parametrize("isa", ["native", *sorted(ISAS)])
def test_scores_summed_a_block_at_a_time_are_the_one_at_a_time_sums_bitwise(isa):
    """Attention's scores taken SCORE_BLOCK positions a step through vsum_lanes (one transposing sum for the block)
    against the build that sums each position alone (-DATTEND_TRANSPOSED=0): bitwise the same outputs, at head widths
    of 8-256 dimensions (1-16 vectors of either build) and 24, over runs of positions that end inside and on a block's
    edge (float32 keys; the float16 keys' path: test_q8_linear.py)."""
    if isa == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    flags = P.NATIVE if isa == "native" else ISAS[isa]
    g = torch.Generator().manual_seed(9)
    for hd in (8, 16, 24, 32, 64, 128, 256):
        keys, values = torch.randn(3, 2, 300, hd, generator=g), torch.randn(3, 2, 300, hd, generator=g)
        q = torch.randn(3, 6, hd, generator=g) * 2
        for last in (0, 7, 15, 16, 17, 31, 32, 100, 255, 299):
            first = torch.tensor([0, 3, 7]).clamp(max=last)
            a = FL.batch_attend(q, keys, values, first, last, 0.2, flags)
            b = FL.batch_attend(q, keys, values, first, last, 0.2, flags + ("-DATTEND_TRANSPOSED=0",))
            assert a is not None and same_bits(a, b), (hd, last)


def record_fused_calls(monkeypatch) -> list:
    """From now on (until monkeypatch undoes it), each FusedLayers.run call appends (its rows, whether it ran)."""
    calls = []
    original = FL.FusedLayers.run

    def counted(self, h, *args):
        out = original(self, h, *args)
        calls.append((h.shape[0], out is not None))
        return out

    monkeypatch.setattr(FL.FusedLayers, "run", counted)
    return calls


def test_it_runs_only_the_widths_where_every_layer_runs_packed(packed, monkeypatch):
    model, _ = packed
    some = K.LinearPlan(packed_rows={shape: frozenset({1, 2, 3}) for shape in K.linear_groups(model)})
    K.install(model, some)
    try:
        fused, ops = passes(model, some)
        calls = record_fused_calls(monkeypatch)
        cache, theirs = new_cache(model.config), new_cache(model.config)
        for n in (5, 1, 3, 4):
            x = torch.arange(3, 3 + n).view(1, n)
            close(fused.forward(x, cache).logits, ops.forward(x, theirs).logits)
        monkeypatch.undo()
        assert calls == [(5, False), (1, True), (3, True), (4, False)]  # widths not packed: the torch operations
        # a layer packed again (its weight changed): the table follows the new pack, values as the torch operations
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
        P.pack_model(model)
        K.install(model, some)
        a, b = new_cache(model.config), new_cache(model.config)
        close(fused.forward(torch.tensor([[5, 6, 7]]), a).logits, ops.forward(torch.tensor([[5, 6, 7]]), b).logits)
        close(fused.forward(torch.tensor([[8]]), a).logits, ops.forward(torch.tensor([[8]]), b).logits)
    finally:
        with torch.no_grad():
            model.model.layers[0].mlp.down_proj.weight.mul_(0.5)
        P.pack_model(model)
        K.install(model, every_bucket_packed(model))


def test_a_change_of_routing_between_steps_is_seen_by_the_very_next_pass(packed, monkeypatch):
    """The fused call keeps each width's packs with packed_linear's routing epoch (FusedLayers._packs), so every
    way of routing or packing a model's linear layers must move it: stock kernels (F.linear, as transformers)
    entered and left, the routing taken off and put back, the layers packed again. (Only the fused pass runs until
    the end: a second LlamaPass over the same layers stacks their packs its own way, which moves the epoch too.)"""
    model, plan = packed
    fused, ops = passes(model, plan)
    calls = record_fused_calls(monkeypatch)
    cache = new_cache(model.config)
    ids = [[3, 4, 5], [6], [7], [8], [9], [10], [11]]
    logits = []
    try:
        step = iter(ids)
        logits.append(fused.forward(torch.tensor([next(step)]), cache).logits)
        logits.append(fused.forward(torch.tensor([next(step)]), cache).logits)  # packs of 3 rows and of 1 kept
        with K.stock_kernels(model):
            logits.append(fused.forward(torch.tensor([next(step)]), cache).logits)
        logits.append(fused.forward(torch.tensor([next(step)]), cache).logits)
        K.uninstall(model)
        logits.append(fused.forward(torch.tensor([next(step)]), cache).logits)
        K.install(model, plan)
        logits.append(fused.forward(torch.tensor([next(step)]), cache).logits)
        P.pack_model(model)  # new packs, the same values (a weight changed and packed again: the test above)
        logits.append(fused.forward(torch.tensor([next(step)]), cache).logits)
    finally:
        K.install(model, plan)
    assert [used for _, used in calls] == [True, True, False, True, False, True, True]
    theirs = new_cache(model.config)
    for x, got in zip(ids, logits):
        close(got, ops.forward(torch.tensor([x]), theirs).logits)


def test_models_it_cannot_take_keep_the_torch_operations():
    model = coded_model()
    P.pack_model(model)
    plan = every_bucket_packed(model)
    direct = LP.LlamaPass(model, plan)
    assert direct.fused is not None
    from transformers import DynamicCache
    concatenating = DynamicCache(config=model.config)  # not position-indexed buffers: never written by the call
    assert direct.fused.run(torch.zeros(1, 64), torch.ones(1, 16), torch.ones(1, 16), concatenating.layers, 0,
                            False) is None
    assert LP.LlamaPass(model, plan, fused=False).fused is None
    assert LP.LlamaPass(model, None).fused is None  # nothing packed
    model.model.layers[1].post_attention_layernorm.variance_epsilon = 1e-3  # one eps for all layers, or none
    assert LP.LlamaPass(model, plan).fused is None
    with pytest.raises(ValueError, match="no decoder layers"):
        FL.FusedLayers([], 4, 2, 16, 64)


def packed_target(model, fused: bool = True) -> Target:
    """A target over a coded model with every layer packed at every width, through the direct pass (fused or not)."""
    target = Target(model, kernels="stock")
    P.pack_model(target.model)
    target.linear_plan = every_bucket_packed(target.model)
    K.install(target.model, target.linear_plan)
    target.direct_pass = LP.LlamaPass(target.model, target.linear_plan, fused=fused)
    assert (target.direct_pass.fused is not None) == fused
    return target


def test_a_target_uses_it_says_so_and_keys_its_costs_apart():
    target = packed_target(coded_model(), fused=False)
    unfused = target.base_fingerprint
    target.direct_pass, target._fingerprint = LP.LlamaPass(target.model, target.linear_plan), None
    assert target.base_fingerprint != unfused  # other roundings, other costs: other cost tables
    assert "fused_layers.c" in target.runtime()["forward"]
    K.uninstall(target.model)


@pytest.fixture()
def fused_target():
    target = packed_target(coded_model())
    yield target
    K.uninstall(target.model)


@pytest.mark.parametrize("gamma", [1, 4, 12])
def test_greedy_speculation_through_the_fused_layers_equals_plain(fused_target, gamma):
    prompt = list(range(5, 17))
    plain = SpeculativeEngine(fused_target, None).generate(prompt, max_new_tokens=40, stop_token_ids=[]).token_ids
    for drafter in (ScriptedDrafter(prompt + plain), RandomDrafter(96, seed=4)):
        engine = SpeculativeEngine(fused_target, drafter, make_policy("fixed", gamma=gamma))
        result = engine.generate(prompt, max_new_tokens=40, stop_token_ids=[])
        assert result.token_ids == plain
    assert result.mean_accepted_length < 2  # the random drafter was rejected too: the check compared something


def test_sampled_speculation_through_the_fused_layers_samples_the_targets_distribution():
    target = packed_target(coded_model(vocab=8, scale=1.0, head_scale=0.1))
    assert_engine_samples_the_targets_distribution(target)
    K.uninstall(target.model)


def assert_engine_samples_the_targets_distribution(target: Target) -> None:
    """Seeded chi-square test on the first two sampled tokens of an 8-token vocabulary: their exact joint
    distribution from the target's own one-row passes, against the engine with a random drafter."""
    from test_engine_sampling import PROMPT, V, chi_square_pvalue, sample_counts
    from diffspec import SamplingParams
    from diffspec.sampling import probs_from_logits

    params = SamplingParams(temperature=0.9)

    def next_probs(ids):
        target.reset()
        return probs_from_logits(target.forward(torch.tensor(ids)).logits[-1:], params)[0]

    p1 = next_probs(PROMPT)
    assert p1.shape == (V,)
    joint = torch.stack([p1[a].double() * next_probs(PROMPT + [a]).double() for a in range(V)]).flatten()
    joint = (joint / joint.sum()).numpy()  # float32 probabilities sum to 1 within ~1e-7; scipy asks 1.5e-8
    assert joint.max() < 0.5  # a spread distribution: a wrong rule would show
    engine = SpeculativeEngine(target, RandomDrafter(V, seed=3), make_policy("fixed", gamma=2))
    counts = sample_counts(engine, params, 2500)
    assert chi_square_pvalue(counts, joint) > 1e-3


@pytest.mark.parametrize("isa", ["native", *sorted(ISAS)])
def test_vector_exp_and_silu_are_the_scalar_codes_values_bitwise(isa):
    """Softmax's exponentials and SiLU run vector code (GCC did not vectorize exp_poly's loops: its clamps are control
    flow to it, and SiLU ran one value at a time, ~2/3 of a 64-row pass's work outside the products and attention on
    Zen 1). Each lane must be exactly exp_poly's value, on every build: else a row's logits would depend on whether
    it sat in a vector or in the tail, and on the CPU. Values across the clamps, at them, zeros, subnormals, huge,
    infinite and NaN; lengths that leave a tail."""
    if isa == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("no AVX2 on this CPU")
    lib = FL.build_library(FL.NATIVE if isa == "native" else ISAS[isa])
    assert not isinstance(lib, P.KernelUnavailable), str(lib)
    special = torch.tensor([0.0, -0.0, 1e-45, -1e-45, 1e-38, 87.0, -87.0, 88.0, -88.0, 87.5, -87.5, 88.7, -103.0,
                            89.0, 1e30, -1e30, float("inf"), float("-inf"), float("nan"), 0.5, -0.5, 0.3466, 12.0])
    g = torch.Generator().manual_seed(0)
    x = torch.cat([special, torch.randn(4000, generator=g) * 8, torch.rand(1000, generator=g) * 200 - 100])
    for n in (x.numel(), x.numel() - 3, 7, 1):
        xs, up = x[:n].contiguous(), (torch.randn(n, generator=g) * 3).contiguous()
        outs = [torch.empty(n) for _ in range(4)]
        lib.diffspec_fused_elementwise_check(xs.data_ptr(), up.data_ptr(), n, *(o.data_ptr() for o in outs))
        exp_pass, exp_scalar, silu_pass, silu_scalar = (o.view(torch.int32) for o in outs)  # bits, NaNs included
        assert torch.equal(exp_pass, exp_scalar)
        assert torch.equal(silu_pass, silu_scalar)
        if n == x.numel():  # and they are the exponential and SiLU they say (to float32 rounding, ~1 ulp)
            ok = torch.isfinite(xs) & (xs.abs() < 80)
            assert torch.allclose(outs[1][ok], torch.exp(xs[ok]), rtol=4e-7, atol=0)
            assert torch.allclose(outs[3][ok], torch.nn.functional.silu(xs[ok]) * up[ok], rtol=1e-6, atol=1e-30)
            at = {v: i for i, v in enumerate(special.tolist()) if v == v}
            assert torch.isnan(outs[1][18]) and outs[1][at[float("-inf")]] == outs[1][at[-87.0]] > 0  # clamped
            assert outs[1][at[float("inf")]] == outs[1][at[88.0]] < float("inf")
