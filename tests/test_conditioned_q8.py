"""The conditioned drafter in 8-bit arithmetic (`--drafter-dtype q8`, drafters/conditioned_fused.py): fused_layers.c's
block and context calls compute what the lean torch pass computes with the same codes and 8-bit activations; the
codes follow the weights; `auto` chooses it by measurement; it is refused where it cannot run. (Greedy equality per
policy and the sampling test: test_diffusion_drafters' and test_engine_sampling's `conditioned-q8` kind.)"""

import pytest
import torch

from conftest import reference_greedy
from diffspec import DiffspecError, FixedPolicy, SpeculativeEngine
from diffspec.drafter_names import make_drafter
from diffspec.drafters import conditioned_fused, conditioned_pass
from diffspec.drafters.conditioned import ConditionedDrafter
from diffspec.q8_linear import dequantized_activations, quantized_pack
from test_diffusion_drafters import PROMPTS, conditioned_for

pytestmark = pytest.mark.skipif(conditioned_fused.unavailable() is not None,
                                reason=f"fused_layers.c does not build here: {conditioned_fused.unavailable()}")


def q8_reference_matmul(x, w):
    """What the fused pass multiplies: x's rows quantized per block of 32, w rounded to its Q8_0 codes (float64 sums)."""
    codes = quantized_pack(w.float()).decode().double()
    return (dequantized_activations(x.float()).double() @ codes.T).to(x.dtype)


def drafter_and_pass(target, seed=4, layers=2, block_size=6):
    drafter = conditioned_for(target, seed=seed, layers=layers, block_size=block_size)
    model = drafter.model.to(torch.float32)
    fused = conditioned_fused.FusedQ8Pass(model)
    head = torch.randn(40, model.cfg.hidden_size) * 0.5
    fused.current(model, head)
    return drafter, model, fused, head


def cache_for(model, capacity=64):
    c = model.cfg
    return conditioned_pass.ContextCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, torch.float32, "cpu",
                                         capacity)


def rel(a, b):
    return float((a - b).norm() / b.norm())


@torch.inference_mode()  # the caches are made there (as the drafter makes them)
def test_fused_context_and_block_compute_the_lean_pass_with_the_same_codes(target, monkeypatch):
    """Every row of the block reads the whole block (a causal mask, a missing q/k norm or a wrong cache position would
    be off by tens of percent); against the same arithmetic in torch the fused call agrees to rounding."""
    drafter, model, fused, head = drafter_and_pass(target)
    rope = conditioned_pass.RopeTable(model.cfg.head_dim, model.cfg.rope_theta)
    torch.manual_seed(0)
    m, n = 23, model.cfg.block_size
    features = torch.randn(m, model.fc.in_features) * 2
    x = torch.randn(n, model.cfg.hidden_size)
    cos, sin = rope.rows(0, m + n, torch.float32, "cpu")
    ref_cache, fused_cache = cache_for(model), cache_for(model)
    monkeypatch.setattr(conditioned_pass, "matmul", q8_reference_matmul)
    weights = conditioned_pass.ServingWeights().current(model)  # float32 matrices (the reference quantizes them)
    conditioned_pass.context_into_cache(model, weights, ref_cache, features, torch.arange(m), cos[:m], sin[:m])
    fused.context(fused_cache, features, 0, cos[:m], sin[:m])
    for a, b in zip(fused_cache.keys + fused_cache.values, ref_cache.keys + ref_cache.values):
        assert rel(a[:, :m], b[:, :m]) < 2e-3
    ref_cache.length = fused_cache.length = m
    ref = conditioned_pass.block_hidden(model, weights, ref_cache, x, cos[m:], sin[m:])
    out = fused.block(fused_cache, x, cos[m:], sin[m:])
    assert out.shape == ref.shape and rel(out, ref) < 2e-3
    for a, b in zip(fused_cache.keys, ref_cache.keys):  # the block's own keys went to the scratch positions too
        assert rel(a[:, m:m + n], b[:, m:m + n]) < 2e-3
    assert rel(fused.head(out), q8_reference_matmul(ref, head)) < 2e-3
    # and against the float pass, the quantization's own error: close, not equal
    monkeypatch.undo()
    exact_cache = cache_for(model)
    conditioned_pass.context_into_cache(model, weights, exact_cache, features, torch.arange(m), cos[:m], sin[:m])
    exact_cache.length = m
    exact = conditioned_pass.block_hidden(model, weights, exact_cache, x, cos[m:], sin[m:])
    assert 1e-4 < rel(out, exact) < 0.1


def test_codes_follow_the_weights(target):
    drafter, model, fused, head = drafter_and_pass(target)
    before = fused.weights
    assert fused.current(model, head) is before  # nothing changed: the same codes
    with torch.no_grad():
        model.layers[0].mlp.down_proj.weight.mul_(2.0)  # in place: the version counter moves
    after = fused.current(model, head)
    assert after is not before
    assert torch.equal(after.layers[0][3].packed.decode(), quantized_pack(model.layers[0].mlp.down_proj.weight).decode())
    assert fused.current(model, head.clone()) is not after  # another head


def test_q8_drafter_is_lossless_and_says_what_it_runs(target, tiny_model):
    drafter = conditioned_for(target)
    drafter.compute_dtype = "q8"
    engine = SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert drafter.computes_q8 and "q8" in drafter.describe() and "q8" in drafter.cost_signature()
    assert next(drafter.model.parameters()).dtype == torch.float32
    assert drafter.runs_compiled is False
    drafted = 0
    for prompt in PROMPTS:
        r = engine.generate(prompt, max_new_tokens=30, stop_token_ids=[])
        assert r.token_ids == reference_greedy(tiny_model, prompt, 30, stop_ids=())
        drafted += r.drafted_tokens
    assert drafted > 0


@pytest.mark.parametrize("timings, chosen", [((10.0, 9.0, 5.0), "q8"), ((10.0, 5.0, 4.5), "bfloat16"),
                                             ((10.0, 9.5, 9.0), "float32"), ((10.0, 20.0, 8.0), "q8")])
def test_auto_chooses_the_measured_fastest_by_1_2x(target, tiny_model, monkeypatch, timings, chosen):
    drafter = conditioned_for(target)
    drafter.model.to(torch.float32)
    measured = iter(timings)  # float32, bfloat16, q8, in that order
    monkeypatch.setattr(ConditionedDrafter, "_time_step", lambda self, *a, **k: next(measured))
    drafter.compute_dtype = "auto"
    engine = SpeculativeEngine(target, drafter, FixedPolicy(4))
    dtype = next(drafter.model.parameters()).dtype
    assert drafter.computes_q8 == (chosen == "q8")
    assert dtype == (torch.bfloat16 if chosen == "bfloat16" else torch.float32)
    assert drafter.describe().count(" in ") >= 2 and drafter.dtype_note.startswith(chosen)
    r = engine.generate(PROMPTS[1], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(tiny_model, PROMPTS[1], 20, stop_ids=())


def test_auto_leaves_q8_out_where_it_cannot_run(target, monkeypatch):
    drafter = conditioned_for(target)
    drafter.model.to(torch.float32)
    measured = iter((10.0, 9.0))
    monkeypatch.setattr(ConditionedDrafter, "_time_step", lambda self, *a, **k: next(measured))
    monkeypatch.setattr(conditioned_fused, "unavailable", lambda device="cpu", cfg=None: "no C compiler")
    drafter.compute_dtype = "auto"
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert not drafter.computes_q8 and "q8" not in drafter.dtype_note
    drafter = conditioned_for(target)
    drafter.compute_dtype = "q8"
    with pytest.raises(DiffspecError, match="drafter dtype q8: no C compiler"):
        SpeculativeEngine(target, drafter, FixedPolicy(4))


def test_q8_is_refused_for_drafters_without_an_8bit_pass(target, tokenizer):
    with pytest.raises(DiffspecError, match="q8 .* applies to the conditioned drafter; 'block-diffusion'"):
        make_drafter("block-diffusion", target, compute_dtype="q8")
    with pytest.raises(DiffspecError, match="applies to the conditioned and block-diffusion drafters"):
        make_drafter("prompt-lookup", target, compute_dtype="q8")
    with pytest.raises(DiffspecError, match="unknown drafter dtype 'q4'.*auto, q8"):
        make_drafter("conditioned", target, compute_dtype="q4")


def test_q8_is_refused_for_widths_the_codes_cannot_hold(target):
    from dataclasses import replace

    from diffspec.drafters import ConditionedDraftModel

    cfg = replace(conditioned_for(target).cfg, intermediate_size=48)  # not a multiple of the codes' 32
    drafter = ConditionedDrafter(ConditionedDraftModel(cfg).float())
    drafter.compute_dtype = "q8"
    with pytest.raises(DiffspecError, match="multiples of 32; this drafter has intermediate size 48"):
        SpeculativeEngine(target, drafter, FixedPolicy(4))
    drafter = ConditionedDrafter(ConditionedDraftModel(cfg).float())
    drafter.compute_dtype = "auto"  # q8 left out, with no error: float32 or bfloat16 as measured
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert not drafter.computes_q8 and "q8" not in drafter.dtype_note


def test_q8_after_an_explicit_q8_attach_is_left_when_asked_for_another(target, monkeypatch):
    drafter = conditioned_for(target)
    drafter.compute_dtype = "q8"
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert drafter.computes_q8
    measured, timed_in_q8 = iter((10.0, 9.5, 9.0)), []  # float32, bfloat16, q8: none 1.2x faster

    def time_step(self, *a, **k):
        timed_in_q8.append(self.computes_q8)
        return next(measured)
    monkeypatch.setattr(ConditionedDrafter, "_time_step", time_step)
    drafter.compute_dtype = "auto"
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert timed_in_q8 == [False, False, True]  # float32's baseline is the float model, not the q8 one left
    assert not drafter.computes_q8 and drafter.dtype_note.startswith("float32: 10.0 ms")
    drafter.compute_dtype = "q8"
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert drafter.computes_q8
    drafter.compute_dtype = None  # as loaded: the float model again
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert not drafter.computes_q8
