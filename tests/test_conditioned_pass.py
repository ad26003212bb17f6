"""The conditioned drafter's lean serving pass (drafters/conditioned_pass.py) against the reference module pass
(ConditionedDraftModel.forward over context_keys_values, which the DFlash tests hold equal to z-lab's): equal in
float64 round after round (the position-indexed cache growing past its first capacity), current after its
weights change, and in bf16 through bf16_linear's kernel close to the reference and lossless."""

from __future__ import annotations

import pytest
import torch

from conftest import reference_greedy
from test_diffusion_drafters import conditioned_for
from diffspec import FixedPolicy, SpeculativeEngine
from diffspec.drafters import ConditionedConfig, ConditionedDrafter, ConditionedDraftModel
from diffspec.drafters import conditioned_pass as CP
from diffspec.target import Target


def reference_logits(drafter, features: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """The block after `context` through the reference module pass, from the features of every position but the
    last (what ConditionedDrafter.block_logits computed before the lean pass)."""
    model, cfg = drafter.model, drafter.cfg
    n = context.shape[0] - 1
    with torch.inference_mode():
        dtype = next(model.parameters()).dtype
        kv = model.context_keys_values(features[:n].to(dtype), torch.arange(n))
        block = torch.full((cfg.block_size,), cfg.mask_token_id)
        block[0] = context[-1]
        hidden = model(drafter._embed(block).to(dtype), torch.arange(n, n + cfg.block_size), kv)
        return hidden[1:].to(drafter._head_weight.dtype) @ drafter._head_weight.T


def test_lean_pass_equals_the_reference_pass_in_float64_as_the_cache_grows(target, monkeypatch):
    monkeypatch.setattr(CP.ContextCache.__init__, "__defaults__", (8,))  # a first capacity of 8: it grows 4 times
    drafter = conditioned_for(target, layers=2, block_size=5)
    drafter.attach(target)
    drafter.begin(None)
    g = torch.Generator().manual_seed(0)
    features = torch.randn(120, drafter.model.fc.in_features, generator=g, dtype=torch.float64)
    tokens = torch.randint(4, 50, (121,), generator=g)
    n = 0
    for step in (7, 1, 2, 1, 30, 3, 1, 60):  # what rounds feed: a prompt's features at once, then 1 + accepted
        drafter.observe(features[n:n + step], n)
        n += step
        got = drafter.block_logits(tokens[: n + 1])
        torch.testing.assert_close(got, reference_logits(drafter, features, tokens[: n + 1]), rtol=0, atol=1e-12)
    assert drafter._cache.capacity >= n + drafter.cfg.block_size and drafter._cache.length == n


def test_a_weight_changed_after_a_pass_is_read_by_the_next(target):
    drafter = conditioned_for(target, layers=1, block_size=4)
    drafter.attach(target)
    features = torch.randn(10, drafter.model.fc.in_features, dtype=torch.float64)
    tokens = torch.arange(5, 16)
    layer = drafter.model.layers[0]

    def draft():
        drafter.begin(None)
        drafter.observe(features[:10], 0)
        return drafter.block_logits(tokens)

    before = draft()
    with torch.no_grad():
        layer.mlp.gate_proj.weight.mul_(3)  # in place: the stacked gate/up copy would be stale
    after_in_place = draft()
    with torch.no_grad():
        layer.self_attn.q_proj.weight = torch.nn.Parameter(layer.self_attn.q_proj.weight * 0.5)  # a new tensor
    after_replaced = draft()
    assert not torch.allclose(before, after_in_place) and not torch.allclose(after_in_place, after_replaced)
    torch.testing.assert_close(after_replaced, reference_logits(drafter, features, tokens), rtol=0, atol=1e-12)
    layer.self_attn.q_proj.weight = torch.nn.Parameter(layer.self_attn.q_proj.weight * 2)
    with torch.no_grad():
        layer.mlp.gate_proj.weight.div_(3)
    torch.testing.assert_close(draft(), before, rtol=0, atol=1e-12)


@pytest.mark.skipif(not CP.uses_kernel(torch.zeros(1, dtype=torch.bfloat16)), reason="bf16 kernel unavailable")
def test_bf16_drafter_through_the_kernel_drafts_close_to_the_reference_and_stays_lossless(target, tiny_model,
                                                                                         monkeypatch):
    monkeypatch.setattr(CP.bf16_linear, "faster_here", lambda weights, rows: True)  # timed elsewhere (test_bf16_linear)
    whole = conditioned_for(target, layers=1, block_size=5)
    whole.compute_dtype = "bfloat16"
    whole.attach(target)  # a whole-vocabulary head stays torch's (packing it would copy the embeddings again)
    assert isinstance(whole._weights.current(whole.model).fc, CP.bf16_linear.Bf16Weight)
    assert isinstance(whole._head_matrix, torch.Tensor)
    with torch.random.fork_rng():
        torch.manual_seed(4)
        cfg = ConditionedConfig.for_target(target.model.config, mask_token_id=3, num_hidden_layers=2, block_size=5,
                                           num_features=2, draft_vocab=40)
        model = ConditionedDraftModel(cfg).double()
        for p in model.parameters():
            p.data.normal_(0, 0.3) if p.dim() > 1 else None
    drafter = ConditionedDrafter(model)
    drafter.compute_dtype = "bfloat16"
    drafter.attach(target)
    weights = drafter._weights.current(drafter.model)
    assert isinstance(weights.layers[0].qkv, CP.bf16_linear.Bf16Weight)
    assert isinstance(drafter._head_matrix, CP.bf16_linear.Bf16Weight)
    g = torch.Generator().manual_seed(1)
    features = torch.randn(40, drafter.model.fc.in_features, generator=g)
    tokens = torch.randint(4, 50, (41,), generator=g)
    drafter.begin(None)
    drafter.observe(features[:40], 0)
    got = drafter.block_logits(tokens).float()
    want = reference_logits(drafter, features, tokens).float()
    assert (got - want).abs().max() <= 0.05 * want.abs().max()  # bf16 roundings in another order
    for prompt in ([5, 6, 7, 8, 9, 10], [30, 31, 30, 31]):
        out = SpeculativeEngine(target, drafter, FixedPolicy(4)).generate(prompt, max_new_tokens=30, stop_token_ids=[])
        assert out.token_ids == reference_greedy(tiny_model, prompt, 30, stop_ids=())


def test_a_cached_draft_cost_of_the_old_pass_is_not_reused(target, monkeypatch):
    """The auto policy plans by cached draft costs (costs.drafter_calibration): a drafter whose pass changed
    must be timed again, not planned by the old pass's costs, for the same weights."""
    from diffspec import costs

    drafter = conditioned_for(target)
    drafter.attach(target)
    key = costs.drafter_key(target, drafter)
    assert drafter.cost_signature().startswith("lean pass")
    monkeypatch.setattr(type(drafter), "cost_signature", lambda self: "")  # what the key was before the lean pass
    assert costs.drafter_key(target, drafter) != key


def test_where_the_kernel_timed_slower_the_bf16_pass_keeps_torch_matmuls(target, monkeypatch):
    monkeypatch.setattr(CP.bf16_linear, "faster_here", lambda weights, rows: False)
    drafter = conditioned_for(target, layers=1, block_size=4)
    drafter.compute_dtype = "bfloat16"
    drafter.attach(target)
    weights = drafter._weights.current(drafter.model)
    assert isinstance(weights.layers[0].qkv, torch.Tensor) and isinstance(drafter._head_matrix, torch.Tensor)
    assert drafter.cost_signature() == "lean pass 4 (torch matmuls)"


def test_a_bf16_drafter_keeps_its_context_in_float32_and_runs_no_bf16_attention_product(target, monkeypatch):
    """On a CPU a bf16 bmm goes to oneDNN, which builds a kernel for each new shape, and the context grows every
    round (~0.3-1 ms a call where the float32 product takes ~0.14): the keys and values are kept in float32, as
    the bf16 values the pass computed (so no score changes), and attention multiplies in float32."""
    monkeypatch.setattr(CP.bf16_linear, "faster_here", lambda weights, rows: False)
    drafter = conditioned_for(target, layers=2, block_size=4)
    drafter.compute_dtype = "bfloat16"
    drafter.attach(target)
    assert next(drafter.model.parameters()).dtype == torch.bfloat16
    products = []
    bmm = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: products.append((a.dtype, b.dtype)) or bmm(a, b))
    g = torch.Generator().manual_seed(2)
    features = torch.randn(30, drafter.model.fc.in_features, generator=g)
    tokens = torch.randint(4, 50, (31,), generator=g)
    drafter.begin(None)
    n = 0
    for step in (20, 1, 3, 6):
        drafter.observe(features[n:n + step], n)
        n += step
        logits = drafter.block_logits(tokens[: n + 1])
        assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    cache = drafter._cache
    assert cache.dtype == torch.float32 and cache.length == n
    for stored in cache.keys + cache.values:
        held = stored[:, :n]
        assert torch.equal(held, held.bfloat16().float())  # bf16 values, stored wider
    assert products and all(dtypes == (torch.float32, torch.float32) for dtypes in products)
    assert CP.cache_dtype(torch.float64) == torch.float64 and CP.cache_dtype(torch.float32) == torch.float32


def test_the_cache_buffers_are_inference_tensors_when_made_and_when_grown():
    """A compiled pass guards on the kind of tensor: buffers made outside inference mode (begin at attach) and
    grown inside it (a long request) would differ, and the graph would compile again mid-request."""
    cache = CP.ContextCache(1, 2, 4, torch.float32, "cpu", capacity=4)
    assert cache.keys[0].is_inference() and cache.values[0].is_inference()
    with torch.inference_mode():  # as the drafter writes it (observe/block_logits run in inference mode)
        cache.keys[0][:, :3] = 1.0
    cache.length = 3
    cache.reserve(20)
    assert cache.capacity >= 20 and cache.keys[0].is_inference() and cache.values[0].is_inference()
    assert torch.equal(cache.keys[0][:, :3], torch.ones(2, 3, 4))


def test_features_out_of_step_with_the_cache_are_refused(target):
    drafter = conditioned_for(target, layers=1, block_size=4)
    drafter.attach(target)
    features = torch.randn(10, drafter.model.fc.in_features, dtype=torch.float64)
    drafter.begin(None)
    drafter.observe(features[:6], 0)
    drafter.block_logits(torch.arange(5, 12))
    drafter._cache.length = 4  # a hand-made rollback that skipped positions 4-5
    drafter.observe(features[6:8], 6)
    with pytest.raises(RuntimeError, match="from position 6, its cache holds 4"):
        drafter.block_logits(torch.arange(5, 14))
