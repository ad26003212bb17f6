"""The fixed-capacity cache (cache.new_fixed_cache; `Target(fixed_cache=True)`, the default on CUDA under
`--compile`): passes of fixed shapes, which CUDA graphs need. Rolling back is setting a length; positions
past it hold stale rows that the causal mask keeps out. Checked here on a CPU: the same logits as the
position-indexed cache (eager: to 1e-12 in float64, as attention over the whole capacity under a mask
may round a hidden state's last bit otherwise), through rollbacks, requests and growth; compiled with
static shapes, one graph per width for every context length and request; the engine's output the eager
target's own, greedy and sampled."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from diffspec import cache as dc
from diffspec import compiled as C
from diffspec.engine import SpeculativeEngine
from diffspec.policies import make_policy
from diffspec.types import SamplingParams
from diffspec.target import Target

from conftest import make_model
from helpers import RandomDrafter, ScriptedDrafter


def graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.fixture()
def small(monkeypatch):
    """Widths 1, 2 and 4 (a 3-row pass is padded to 4) and capacities from 64 positions: tiny models, seconds."""
    monkeypatch.setattr(C, "WIDTH_BUCKETS", (1, 2, 4))
    monkeypatch.setattr(dc, "FIXED_CAPACITY_MIN", 64)


def test_capacity_is_a_power_of_two_from_the_minimum_capped_at_the_context():
    assert [dc.fixed_capacity(n, 8192) for n in (0, 2048, 2049, 5000, 9000)] == [2048, 2048, 4096, 8192, 8192]
    assert dc.fixed_capacity(100, 256) == 256


def test_fixed_cache_is_the_default_on_cuda_under_compile_only():
    assert [C.wants_fixed_cache(mode, "cuda") for mode in ("off", "on", "auto")] == [False, True, True]
    assert [C.wants_fixed_cache(mode, "cpu") for mode in ("off", "on", "auto")] == [False, False, False]
    assert C.wants_fixed_cache("on", "cuda", False) is False and C.wants_fixed_cache("off", "cpu", True) is True
    target = Target(make_model(70), compile="off")
    assert not target.fixed_cache and target.runtime()["cache"] == "position-indexed"
    fixed = Target(make_model(70), fixed_cache=True)
    assert fixed.runtime()["cache"] == "fixed capacity (256 positions)"
    assert fixed.fingerprint != target.fingerprint  # other costs: cost tables are not shared
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=70, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=8, max_position_embeddings=128)
    with pytest.raises(Exception, match="full-attention layers only"):
        Target(MistralForCausalLM(cfg).eval(), fixed_cache=True)
    with pytest.raises(Exception, match="use --compile off"):  # under compile: the compile check's own words
        Target(MistralForCausalLM(cfg).eval(), fixed_cache=True, compile="on")
    model = make_model(70)
    model.config._attn_implementation = "flash_attention_2"  # builds its own mask: would read stale rows
    with pytest.raises(Exception, match="needs sdpa or eager attention; this model runs 'flash_attention_2'"):
        Target(model, fixed_cache=True)


def test_a_pass_that_fails_midway_leaves_no_layer_ahead_of_the_length():
    """Each layer counts a pass's rows as it writes them: a pass that fails after the first layer (out of
    memory, an interrupt) must not leave that layer's length ahead of the others and of cache_len, or the
    next passes would write at one position and attend as if at another."""
    ids = torch.arange(1, 40)
    ref, fixed = Target(make_model(70, seed=5)), Target(make_model(70, seed=5), fixed_cache=True)
    for t in (ref, fixed):
        t.forward(ids[:20], logits=False)
    second = fixed.model.model.layers[1]
    original = second.forward

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    second.forward = fail
    with pytest.raises(RuntimeError, match="simulated"):
        fixed.forward(ids[20:23])
    second.forward = original
    assert fixed.cache_len == 20
    assert [int(layer.cumulative_length) for layer in fixed._cache.layers] == [20, 20]
    torch.testing.assert_close(fixed.forward(ids[20:23]).logits, ref.forward(ids[20:23]).logits, rtol=0, atol=1e-12)


def test_eager_passes_equal_the_position_indexed_cache_through_rollbacks_requests_and_growth(small):
    """Stale rows past the length (rejected drafts) are never read, and growing the capacity keeps what
    was held: every logit and hidden state equals the position-indexed cache's to float64 rounding."""
    ids = torch.arange(1, 70)
    ref, fixed = Target(make_model(70, seed=5)), Target(make_model(70, seed=5), fixed_cache=True)
    for t in (ref, fixed):
        t.reserve(40)
        t.forward(ids[:20], logits=False)
    steps = [(ids[20:21], None), (torch.tensor([9, 9, 9, 9]), 21), (ids[21:24], None), (torch.tensor([3, 3]), 23),
             (ids[23:25], None), (torch.tensor([7] * 5), 25), (ids[25:26], None)]
    for tokens, back_to in steps:
        want, got = ref.forward(tokens, hidden_layers=(0, 1)), fixed.forward(tokens, hidden_layers=(0, 1))
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-12)
        torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=0, atol=1e-12)
        if back_to is not None:
            for t in (ref, fixed):
                t.truncate(back_to)
        assert fixed.cache_len == ref.cache_len
    # past the capacity (64): the cache grows to the next power of two, keeping the first positions
    for t in (ref, fixed):
        t.forward(ids[26:60])
    assert dc.fixed_cache_capacity(fixed._cache) == 64
    torch.testing.assert_close(fixed.forward(ids[60:69]).logits, ref.forward(ids[60:69]).logits, rtol=0, atol=1e-12)
    assert dc.fixed_cache_capacity(fixed._cache) == 128 and fixed.cache_len == 69
    # a new request reuses the buffers (a compiled graph holds their addresses)
    buffer = fixed._cache.layers[0].keys
    for t in (ref, fixed):
        t.reset()
        t.forward(ids[30:40], logits=False)
    assert fixed._cache.layers[0].keys is buffer
    torch.testing.assert_close(fixed.forward(ids[40:43]).logits, ref.forward(ids[40:43]).logits, rtol=0, atol=1e-12)


def test_compiled_with_static_shapes_one_graph_per_width_for_every_length_and_request(small):
    """Under `--compile on` the widths are compiled at start, and then no pass compiles again: not as the
    context grows, not after rollbacks or in a new request (the same buffers). The logits equal eager's
    to float32 rounding (the rotary angles are float32; see test_compiled). A larger capacity is another
    shape: its widths compile when first run, and the compile is recorded with the capacity."""
    torch._dynamo.reset()
    ids = torch.arange(4, 69)
    eager, comp = Target(make_model(70, seed=5)), Target(make_model(70, seed=5), compile="on", fixed_cache=True)
    assert set(comp.compiled.compile_s) == {f"{w} rows at 64 positions" for w in (1, 2, 4)}
    assert comp.cache_len == 0 and comp.forward_passes == 0
    assert comp.compiled.describe().endswith("static shapes)")
    before = graphs()
    for t in (eager, comp):
        t.forward(ids[:20], logits=False)
    for start, width in ((20, 1), (21, 1), (22, 3), (25, 1), (26, 4), (30, 2)):
        want, got = (t.forward(ids[start:start + width], hidden_layers=(1,)) for t in (eager, comp))
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=0, atol=1e-5)
        assert comp.cache_len == start + width
    for t in (eager, comp):  # a rejected draft rolled back, then the right tokens
        t.forward(torch.tensor([9, 9, 9]))
        t.truncate(32)
    torch.testing.assert_close(comp.forward(ids[32:35]).logits, eager.forward(ids[32:35]).logits, rtol=0, atol=1e-5)
    for t in (eager, comp):
        t.reset()
        t.forward(ids[:7], logits=False)
    torch.testing.assert_close(comp.forward(ids[7:8]).logits, eager.forward(ids[7:8]).logits, rtol=0, atol=1e-5)
    assert graphs() == before
    comp.reserve(100)  # a longer request: capacity 128, its graphs compiled when first run, then as exact
    torch.testing.assert_close(comp.forward(ids[8:9]).logits, eager.forward(ids[8:9]).logits, rtol=0, atol=1e-5)
    assert "1 rows at 128 positions" in comp.compiled.compile_s and graphs() == before + 1
    for t in (eager, comp):
        t.forward(ids[9:9 + 53], logits=False)  # eager prefill to 62 positions
    torch.testing.assert_close(comp.forward(ids[62:64]).logits, eager.forward(ids[62:64]).logits, rtol=0, atol=1e-5)
    # the capacity is a shape: the guards that sent the longer request to its own graphs are never skipped
    # (CompiledPasses.run; skipping them, this test fails at the 128-position pass)
    assert not comp.compiled.skips_steady_guards and comp.compiled.guarded == set()


def test_a_padded_pass_that_would_not_fit_the_capacity_runs_eager(small):
    """A 3-row pass at 61 positions fits a 64-position capacity, but its graph's padding row would not:
    it runs eager (no growth, no write past the capacity) and gives eager's logits."""
    ids = torch.arange(1, 70)
    eager, comp = Target(make_model(70, seed=5)), Target(make_model(70, seed=5), compile="on", fixed_cache=True)
    widths, graph = [], comp.compiled.fn
    comp.compiled.fn = lambda **kw: widths.append(kw["input_ids"].shape[1]) or graph(**kw)
    for t in (eager, comp):
        t.forward(ids[:61], logits=False)
    torch.testing.assert_close(comp.forward(ids[61:64]).logits, eager.forward(ids[61:64]).logits, rtol=0, atol=1e-5)
    assert widths == [] and comp.cache_len == 64 and dc.fixed_cache_capacity(comp._cache) == 64


def test_auto_where_eager_wins_goes_back_to_the_position_indexed_cache(small, monkeypatch, tmp_path):
    """Under `--compile auto` on CUDA (here: the rule patched to say yes on a CPU) a compiled one-row pass
    measured slower is dropped, and with it the fixed capacity: eager passes attending over a whole
    capacity would only cost more. The decision is cached apart from the position-indexed target's."""
    monkeypatch.setenv("DIFFSPEC_COST_CACHE", str(tmp_path))
    monkeypatch.setattr(C, "wants_fixed_cache", lambda mode, device_type, requested=None: requested is not False)
    torch._dynamo.reset()
    target = Target(make_model(70, seed=6), compile="auto")
    d = target.compiled.decision
    assert d["origin"] == "measured" and target.fixed_cache == d["keep"]
    assert target.runtime()["cache"].startswith("fixed capacity" if d["keep"] else "position-indexed")
    plain = Target(make_model(70, seed=6), compile="off", fixed_cache=False)
    C.decision_path(target).write_text(__import__("json").dumps({**d, "keep": False}))
    again = Target(make_model(70, seed=6), compile="auto")
    assert again.compiled.decision["origin"] == "cache" and not again.fixed_cache
    assert again.runtime()["cache"] == "position-indexed" and again.compiled.describe().startswith("eager")
    ids = torch.arange(1, 30)
    for t in (plain, again):
        t.forward(ids[:20], logits=False)
    torch.testing.assert_close(again.forward(ids[20:22]).logits, plain.forward(ids[20:22]).logits, rtol=0, atol=0)


def test_engine_output_with_a_fixed_cache_is_the_eager_targets_own(small):
    """The lossless contract over the fixed-capacity cache: greedy plain and speculative decoding
    (accepted and rejected drafts, rolled back) give the eager target's greedy tokens, compiled or not;
    and sampled output at the same seed is token for token the position-indexed cache's (the logits agree
    to float64 rounding, so any difference would be in the cache's handling)."""
    torch._dynamo.reset()
    prompt = list(range(5, 17))
    plain = SpeculativeEngine(Target(make_model(70, seed=3)), None).generate(
        prompt, max_new_tokens=30, stop_token_ids=[]).token_ids
    compiled = Target(make_model(70, seed=3), compile="on", fixed_cache=True)
    widths, graph = [], compiled.compiled.fn
    compiled.compiled.fn = lambda **kw: widths.append(kw["input_ids"].shape[1]) or graph(**kw)
    for target in (Target(make_model(70, seed=3), fixed_cache=True), compiled):
        assert SpeculativeEngine(target, None).generate(prompt, max_new_tokens=30, stop_token_ids=[]).token_ids == plain
        for drafter in (ScriptedDrafter(prompt + plain), RandomDrafter(70, seed=4)):
            for gamma in (2, 3):  # verify passes of 3 rows (padded to 4 when compiled) and of 4
                engine = SpeculativeEngine(target, drafter, make_policy("fixed", gamma=gamma))
                assert engine.generate(prompt, max_new_tokens=30, stop_token_ids=[]).token_ids == plain
    assert set(widths) == {1, 2, 4}  # plain steps and verify passes ran compiled, 3 rows as 4
    sampling = SamplingParams(temperature=1.0, seed=11)
    outputs = []
    for fixed in (False, True):
        engine = SpeculativeEngine(Target(make_model(70, seed=3), fixed_cache=fixed),
                                   RandomDrafter(70, seed=4, with_probs=True), make_policy("fixed", gamma=3))
        outputs.append(engine.generate(prompt, max_new_tokens=40, stop_token_ids=[], sampling=sampling).token_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 40


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run by scripts/gpu_engine_run.sh on a lent GPU")
def test_cuda_graphs_replay_the_eager_passes_and_never_hand_out_replayed_memory(small):
    """On CUDA, `--compile on` runs the passes as CUDA graphs (inductor's graph trees, none skipped): their
    logits and hidden states equal eager ones through rollbacks and a new request; rows returned by a pass
    keep their values after the next replay (a graph's outputs are overwritten then); and the engine's
    greedy output, plain and speculative, is the eager target's own."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ids = torch.arange(1, 70)
    eager = Target(make_model(70, seed=5).cuda())
    comp = Target(make_model(70, seed=5).cuda(), compile="on")
    assert comp.fixed_cache and comp.compiled.cuda_graphs and comp.compiled.describe().endswith("CUDA graphs)")
    for t in (eager, comp):
        t.forward(ids[:20], logits=False)
    kept = comp.forward(ids[20:21], hidden_layers=(0, 1))
    snapshot = (kept.logits.clone(), kept.hidden_states.clone())
    torch.testing.assert_close(kept.logits, eager.forward(ids[20:21]).logits, rtol=0, atol=1e-5)
    for start, width in ((21, 1), (22, 3), (25, 1), (26, 4), (30, 2)):
        want, got = (t.forward(ids[start:start + width], hidden_layers=(1,)) for t in (eager, comp))
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
        torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=0, atol=1e-5)
    assert torch.equal(kept.logits, snapshot[0]) and torch.equal(kept.hidden_states, snapshot[1])
    for t in (eager, comp):
        t.forward(torch.tensor([9, 9, 9]))
        t.truncate(32)
    torch.testing.assert_close(comp.forward(ids[32:35]).logits, eager.forward(ids[32:35]).logits, rtol=0, atol=1e-5)
    prompt = list(range(5, 17))
    plain = SpeculativeEngine(eager, None).generate(prompt, max_new_tokens=30, stop_token_ids=[]).token_ids
    assert SpeculativeEngine(comp, None).generate(prompt, max_new_tokens=30, stop_token_ids=[]).token_ids == plain
    for drafter in (ScriptedDrafter(prompt + plain), RandomDrafter(70, seed=4)):
        engine = SpeculativeEngine(comp, drafter, make_policy("fixed", gamma=2))
        assert engine.generate(prompt, max_new_tokens=30, stop_token_ids=[]).token_ids == plain
    # drafts built on the CPU (these drafters' default) against a CUDA target, sampled too: q rows and ids
    # meet the target's rows on its device (a greedy round crashed on an H200 before Draft.to)
    sampled = SpeculativeEngine(comp, RandomDrafter(70, seed=4, with_probs=True), make_policy("fixed", gamma=2))
    out = sampled.generate(prompt, max_new_tokens=30, stop_token_ids=[], sampling=SamplingParams(temperature=1.0, seed=3))
    assert len(out.token_ids) == 30 and out.drafted_tokens > 0
    assert int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"]) == 0
