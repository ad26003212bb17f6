"""Compiled target passes (`--compile`, compiled.py): the same tokens as eager, one graph per pass
shape whatever the context, auto's decision measured and cached, bad settings refused by name."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch._dynamo

from diffspec import compiled as C
from diffspec.engine import SpeculativeEngine
from diffspec.errors import DiffspecError
from diffspec.policies import make_policy
from diffspec.target import Target

from conftest import make_model
from helpers import RandomDrafter, ScriptedDrafter


def graphs() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


@pytest.fixture()
def narrow(monkeypatch):
    """`on` compiles widths 1, 2 and 4 (a 3-row pass is padded to 4): tiny models, seconds."""
    monkeypatch.setattr(C, "WIDTH_BUCKETS", (1, 2, 4))


def test_on_compiles_every_width_at_start_and_then_never_again(narrow):
    """Logits of compiled passes equal eager ones to rounding, for one row and several (padded to a
    bucket or not), as the context grows, whatever the storage offset of the ids (torch specialises
    offsets 0 and 1: the engine's ids are views at any offset) and across requests with other cache
    capacities: no pass compiles after the start. Rounding here is float32's even in a float64 model:
    the rotary angles are computed in float32 (transformers' rotary embedding), and inductor's cos/sin
    kernels round them otherwise (measured: 5e-7)."""
    torch._dynamo.reset()
    ids = torch.arange(4, 60)
    eager, comp = Target(make_model(70, seed=5)), Target(make_model(70, seed=5), compile="on")
    assert set(comp.compiled.compile_s) == {"1 rows", "2 rows", "4 rows"}
    assert comp.cache_len == 0 and comp.forward_passes == 0
    assert comp.compiled.describe().startswith("compiled") and eager.compiled.describe() == "eager"
    assert [comp.compiled.graph_rows((n, True)) for n in range(1, 6)] == [1, 2, 4, 4, None]
    assert not comp.compiled.runs((2, False))  # a prefill: eager
    before = graphs()
    for target in (eager, comp):
        target.reserve(40)
        target.forward(ids[:20], logits=False)
    for start, width in ((20, 1), (21, 1), (22, 3), (25, 1), (26, 4), (30, 2)):
        want, got = (t.forward(ids[start:start + width]).logits for t in (eager, comp))
        assert got.shape == (width, 70) and comp.cache_len == eager.cache_len == start + width
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for view in (ids[0:1], ids[1:2], ids[0:2], ids[1:4], torch.tensor([9, 8, 7, 6])):  # storage offsets 0 and 1
        want, got = (t.forward(view).logits for t in (eager, comp))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    # a pass that reads hidden states (the conditioned drafter's) runs the same graph
    want, got = (t.forward(ids[32:35], hidden_layers=(0, 1)) for t in (eager, comp))
    torch.testing.assert_close(got.hidden_states, want.hidden_states, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)
    for t in (eager, comp):  # another request, another cache capacity
        t.reset()
        t.reserve(90)
        t.forward(ids[:7], logits=False)
    torch.testing.assert_close(comp.forward(ids[7:8]).logits, eager.forward(ids[7:8]).logits, rtol=0, atol=1e-5)
    assert graphs() == before
    # every pass above after the start ran with dynamo's guards skipped (CompiledPasses.run): each key's
    # guards were evaluated once, by compile_widths
    assert comp.compiled.skips_steady_guards and {key[:2] for key in comp.compiled.guarded} == {(1, False), (2, False), (4, False)}


def test_guards_skipped_in_steady_state_still_tell_models_and_widths_apart(narrow, monkeypatch):
    """CompiledPasses.run skips a pass key's guards after its first call, keeping only those that tell
    the function's graphs apart. Two compiled targets of different shapes share transformers' forward
    (one code object, one dynamo cache): interleaved passes of every width must each run their own
    graph, equal to their eager twins, with every steady-state call under the skipping stance."""
    torch._dynamo.reset()
    stances = []
    real = torch.compiler.set_stance
    monkeypatch.setattr(torch.compiler, "set_stance", lambda *a, **k: stances.append(k) or real(*a, **k))
    pairs = [(Target(make_model(v, seed=s, hidden=h)), Target(make_model(v, seed=s, hidden=h), compile="on"))
             for v, s, h in ((70, 5, 32), (90, 6, 48))]
    ids = torch.arange(4, 60)
    for pair in pairs:
        for t in pair:
            t.reserve(48)
            t.forward(ids[:20], logits=False)
    stances.clear()
    start = 20
    for width in (1, 3, 2, 4, 1, 2):
        for eager, comp in pairs:
            want, got = (t.forward(ids[start:start + width]).logits for t in (eager, comp))
            assert got.shape == want.shape == (width, eager.vocab_size)
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        start += width
    assert len(stances) == 12 and all(k.get("skip_guard_eval_unsafe") for k in stances)



def test_greedy_output_with_compiled_passes_equals_plain_eager(narrow):
    """The lossless contract with compiled passes: plain and speculative decoding (accepted and rejected
    drafts, rollback) give the eager target's own greedy tokens."""
    torch._dynamo.reset()
    tok_ids = list(range(5, 17))
    plain = SpeculativeEngine(Target(make_model(70, seed=3)), None).generate(
        tok_ids, max_new_tokens=30, stop_token_ids=[]).token_ids
    compiled = Target(make_model(70, seed=3), compile="on")
    widths, graph = [], compiled.compiled.fn
    compiled.compiled.fn = lambda **kw: widths.append(kw["input_ids"].shape[1]) or graph(**kw)
    assert SpeculativeEngine(compiled, None).generate(tok_ids, max_new_tokens=30, stop_token_ids=[]).token_ids == plain
    for drafter in (ScriptedDrafter(tok_ids + plain), RandomDrafter(70, seed=4)):
        for gamma in (2, 3):  # verify passes of 3 rows (padded to 4) and of 4
            engine = SpeculativeEngine(compiled, drafter, make_policy("fixed", gamma=gamma))
            assert engine.generate(tok_ids, max_new_tokens=30, stop_token_ids=[]).token_ids == plain
    assert set(widths) == {1, 2, 4}  # plain steps and verify passes ran compiled, 3 rows as 4


def test_auto_measures_once_and_a_cached_loss_skips_the_compile(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFSPEC_COST_CACHE", str(tmp_path))
    torch._dynamo.reset()
    target = Target(make_model(70, seed=6), compile="auto")
    d = target.compiled.decision
    assert d["origin"] == "measured" and d["eager_ms"] > 0 and d["compiled_ms"] > 0
    assert d["keep"] == (d["compiled_ms"] < C.AUTO_MARGIN * d["eager_ms"])
    assert target.compiled.one_row == d["keep"] and not target.compiled.runs((2, True))
    assert "1 rows" in target.compiled.compile_s
    assert target.cache_len == 0 and target.forward_passes == 0  # the measurement leaves no trace
    # where eager won, the next start reads that and compiles nothing
    where = C.decision_path(target)
    where.write_text(json.dumps({**d, "keep": False}))
    again = Target(make_model(70, seed=6), compile="auto")
    assert again.compiled.decision["origin"] == "cache" and not again.compiled.one_row
    assert again.compiled.compile_s == {}
    assert again.fingerprint == Target(make_model(70, seed=6)).fingerprint  # eager: the eager cost table
    assert target.fingerprint != again.fingerprint or not d["keep"]


def test_compile_settings_refused_by_name():
    from diffspec.backends import check_backend_settings

    with pytest.raises(DiffspecError, match="unknown --compile 'fast'"):
        Target(make_model(70), compile="fast")
    with pytest.raises(DiffspecError, match="unknown --compile 'yes'"):
        check_backend_settings("transformers", None, torch.float32, "cpu", "auto", "yes")
    proc = subprocess.run([sys.executable, "-m", "diffspec", "generate", "hi", "--compile", "fast"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--compile: invalid choice: 'fast'" in proc.stderr


def test_compile_refused_for_sliding_window_models():
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(vocab_size=70, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=8, max_position_embeddings=128)
    with pytest.raises(DiffspecError, match="sliding_attention layers"):
        Target(MistralForCausalLM(cfg).eval(), compile="on")


def test_compile_refused_on_llama_cpp_and_decides_auto_for_transformers(monkeypatch):
    from diffspec import backends

    pytest.importorskip("llama_cpp")
    with pytest.raises(DiffspecError, match="--compile on applies to the transformers backend"):
        backends.check_backend_settings("llama.cpp", None, torch.float32, "cpu", "auto", "on")
    asked = {}

    def fake_choose(spec, dtype, device, max_context, quiet, drafters, needs_transformers=False):
        asked["needs_transformers"] = needs_transformers
        raise RuntimeError("stop here")

    monkeypatch.setattr(backends, "choose_backend", fake_choose)
    with pytest.raises(RuntimeError, match="stop here"):
        backends.load_target("some.gguf", compile="auto")
    assert asked["needs_transformers"] is True  # --compile is never silently dropped by auto choosing llama.cpp


def test_verify_costs_are_timed_at_both_ends_of_each_bucket(monkeypatch):
    """Every k of a bucket runs one graph, so a compiled target's verify cost is a step function of k:
    the cost table is timed at both ends of each bucket, and its interpolation then gives every k its
    graph's cost (timed at VERIFY_KS alone, k = 9 would read 12.5 for a graph costing 10)."""
    from types import SimpleNamespace

    from diffspec import costs

    monkeypatch.setattr(C, "WIDTH_BUCKETS", (1, 2, 4, 10, 20))
    ks = costs.verify_ks_for(SimpleNamespace(compiled=C.CompiledPasses("on", fn=object(), shapes=None)))
    assert set(costs.VERIFY_KS) <= set(ks) and {4, 9, 10, 19} <= set(ks)
    for eager in (C.CompiledPasses("off"), C.CompiledPasses("auto", fn=object(), shapes={(1, True)})):
        assert costs.verify_ks_for(SimpleNamespace(compiled=eager)) == costs.VERIFY_KS
    assert costs.verify_ks_for(SimpleNamespace()) == costs.VERIFY_KS  # a backend without compiled passes

    def graph_cost(k):  # seconds of the graph that runs k drafts; eager (linear) past the widest
        return float(C.bucket(k + 1) or 2 * (k + 1))

    table = costs.CostTable(ks=ks, contexts=(64,), verify_s=(tuple(graph_cost(k) for k in ks),))
    assert [table.verify(k, 64) for k in range(20)] == [graph_cost(k) for k in range(20)]
    # a table timed at VERIFY_KS alone (before the buckets) is not read back for such a target
    plain = SimpleNamespace(device=torch.device("cpu"), name="m", dtype=torch.float32, backend="transformers",
                            fingerprint="f", compiled=C.CompiledPasses("off"))
    bucketed = SimpleNamespace(**{**vars(plain), "compiled": C.CompiledPasses("on", fn=object(), shapes=None)})
    assert costs.verify_key(plain) != costs.verify_key(bucketed)


def test_a_compiled_pass_on_a_full_cache_and_after_a_dynamo_reset(narrow):
    """Two cases where a pass key that already ran meets a guard torch still checks while skipping the
    others: a pass on a cache filled to its capacity exactly (a compiled pass must not grow the cache inside
    its graph: Target reserves the room first), and graphs dropped by torch._dynamo.reset() (a call under the
    skipping stance that matches no graph raises; CompiledPasses.run then evaluates the guards again and
    compiles). Both equal eager."""
    torch._dynamo.reset()
    ids = torch.arange(3, 63)
    eager, comp = (Target(make_model(70, seed=5, max_pos=512), compile=mode) for mode in ("off", "on"))
    assert comp.compiled.guarded  # compile_widths ran every width once
    cap = comp._cache.layers[0].capacity  # the default capacity: no request reserved more
    fill = torch.arange(cap).remainder(60) + 3
    for t in (eager, comp):
        t.reset()
        t.forward(fill, logits=False)  # an eager prefill to the capacity exactly
    assert comp.cache_len == cap == comp._cache.layers[0].capacity
    want, got = (t.forward(ids[40:42]).logits for t in (eager, comp))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch._dynamo.reset()
    for part in (ids[42:43], ids[43:46]):  # the refused call ran nothing: the cache moved once
        want, got = (t.forward(part).logits for t in (eager, comp))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        assert comp.cache_len == eager.cache_len


def test_every_call_of_a_cuda_graph_targets_passes_runs_under_the_math_attention_backend():
    """On an H200 a one-row pass over the fixed-capacity cache spent 6.8 of its 8 ms in SDPA's
    memory-efficient kernel (float32, 64-query tiles, the whole capacity under a mask); traced under the
    math backend it took 2.5 ms (benchmarks/results/issue19_engine/gpu_h200/). The backend is fixed when
    a graph is traced (the first call of a shape), so every call of a CUDA-graph target's compiled passes
    runs under math_attention, the flags restored after it; other targets keep the dispatcher's choice."""
    seen = []

    def fn(**kwargs):
        seen.append((torch.backends.cuda.math_sdp_enabled(), torch.backends.cuda.mem_efficient_sdp_enabled(),
                     torch.backends.cuda.flash_sdp_enabled()))
        return kwargs["x"]

    graphs = C.CompiledPasses("on", fn=fn, shapes=None, fixed_shapes=True, cuda_graphs=True)
    static = C.CompiledPasses("on", fn=fn, shapes=None, fixed_shapes=True)
    assert graphs.run((1, True), x=3) == 3 and static.run((1, True), x=4) == 4
    assert seen == [(True, False, False), (True, True, True)]
    assert torch.backends.cuda.mem_efficient_sdp_enabled()  # restored after the call
