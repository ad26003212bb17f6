"""Compiled drafter passes (drafters/compile_choice.py): a drafter follows the target's `--compile`, its
steady-state pass runs one graph whatever the context and across requests, its drafts are eager's to
rounding and the output stays the target's own greedy output; auto's decision is measured and cached;
a head the compiled split cannot reproduce keeps the drafter eager, by name."""

from __future__ import annotations

import json

import pytest
import torch
import torch._dynamo

from conftest import make_model, reference_greedy
from diffspec import compiled as C
from diffspec.drafters import BlockDiffusionConfig, BlockDiffusionDrafter
from diffspec.drafters import compile_choice
from diffspec.engine import SpeculativeEngine
from diffspec.policies import FixedPolicy
from diffspec.target import Target
from diffspec.types import SamplingParams

from test_compiled import graphs
from test_diffusion_drafters import conditioned_for, dllm

V = 70
PROMPTS = [list(range(5, 17)), [9, 4, 30, 31, 32, 9, 4], list(range(40, 66))]


def target_saying(mode: str) -> Target:
    """A tiny eager target whose --compile mode reads `mode` (no graph of its own: its passes stay eager,
    so what compiles here is the drafter's alone)."""
    target = Target(make_model(V, seed=7))
    target.compiled = C.CompiledPasses(mode)
    return target


def drafter_of(kind: str, target):
    if kind == "block":
        return BlockDiffusionDrafter(dllm(V), BlockDiffusionConfig(mask_token_id=V, block_size=8, sub_block_size=4))
    if kind == "block-draft-vocab":
        return BlockDiffusionDrafter(dllm(V), BlockDiffusionConfig(mask_token_id=V, block_size=8, sub_block_size=4),
                                     draft_token_ids=torch.arange(3, V, 2))
    return conditioned_for(target, block_size=6, layers=2)


class CountingCalls:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


@pytest.mark.parametrize("kind", ["block", "block-draft-vocab", "conditioned"])
def test_compiled_drafter_drafts_as_eager_and_keeps_the_output(kind):
    torch._dynamo.reset()
    target = target_saying("on")
    eager_target = target_saying("off")
    drafter, eager = drafter_of(kind, target), drafter_of(kind, eager_target)
    drafter.compute_dtype = "float64"  # every attach converts (to the same dtype): the graph must survive that
    engine, eager_engine = (SpeculativeEngine(t, d, FixedPolicy(5)) for t, d in ((target, drafter),
                                                                                  (eager_target, eager)))
    assert drafter.runs_compiled and not eager.runs_compiled
    assert drafter.compile_record["compile_s"] > 0 and "compiled" in drafter.describe()
    assert "compiled" not in eager.describe()
    drafter._compiled_fn = spy = CountingCalls(drafter._compiled_fn)
    extras = {name: CountingCalls(fn) for name, fn in drafter._compiled_extras.items()}
    drafter._compiled_extras = dict(extras)
    assert set(extras) == ({"context"} if kind == "conditioned" else set())  # its context keys/values too
    before = graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):  # no request compiles anything
        for prompt in PROMPTS[:2]:
            got = engine.generate(prompt, max_new_tokens=20, stop_token_ids=[]).token_ids
            assert got == reference_greedy(target.model, prompt, 20, stop_ids=())
        assert spy.calls > 0 and all(e.calls > 0 for e in extras.values())
        SpeculativeEngine(target, drafter, FixedPolicy(5))  # attached again (the auto policy's calibration)
        assert drafter.runs_compiled and drafter._compiled_fn is spy  # nothing compiled again
        for prompt in PROMPTS[2:] + PROMPTS[:1]:  # other context lengths, another request
            got = engine.generate(prompt, max_new_tokens=20, stop_token_ids=[])
            want = eager_engine.generate(prompt, max_new_tokens=20, stop_token_ids=[])
            assert got.token_ids == want.token_ids == reference_greedy(target.model, prompt, 20, stop_ids=())
            assert [r.drafted for r in got.rounds] == [r.drafted for r in want.rounds]
    assert graphs() == before
    # the drafter's logits themselves, compiled against eager (the q that sampling hands over): to rounding
    for compiled_logits, eager_logits in zip(*(step_logits(kind, d) for d in (drafter, eager))):
        torch.testing.assert_close(compiled_logits, eager_logits, rtol=0, atol=1e-5)


def step_logits(kind: str, drafter) -> list:
    """A steady-state draft step's logits after a 24-token context, twice (the second on a longer context)."""
    out = []
    if kind == "conditioned":
        features = torch.randn(40, drafter.model.fc.in_features, generator=torch.Generator().manual_seed(2),
                               dtype=torch.float64)
        drafter.begin(None)
        for n in (24, 31):
            drafter.observe(features[drafter._context_len:n - 1], drafter._context_len)
            out.append(drafter.block_logits(torch.arange(5, 5 + n)))
        return out
    drafter.begin(None)
    for n in (24, 32):
        context = list(range(5, 5 + n))
        drafter._sync(context)
        out.append(drafter._block_logits([V] * 8, range(8)))
    return out


def test_auto_measures_once_and_a_cached_loss_skips_the_compile(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFSPEC_COST_CACHE", str(tmp_path))
    torch._dynamo.reset()
    target = target_saying("auto")
    drafter = drafter_of("block", target)
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    r = drafter.compile_record
    assert r["origin"] == "measured" and r["eager_ms"] > 0 and r["compiled_ms"] > 0 and r["compile_s"] > 0
    assert r["keep"] == (r["compiled_ms"] < compile_choice.AUTO_MARGIN * r["eager_ms"]) == drafter.runs_compiled
    assert drafter._passes == 0 and drafter._cached_ids == []  # the measurement leaves no trace
    # where eager won, the next start reads that and compiles nothing
    drafter._decision_path().write_text(json.dumps({**r, "keep": False}))
    again = drafter_of("block", target)
    before = graphs()
    SpeculativeEngine(target, again, FixedPolicy(4))
    assert again.compile_record["origin"] == "cache" and not again.runs_compiled
    assert graphs() == before and "cached" in again.describe()


def test_a_head_the_split_does_not_reproduce_stays_eager_by_name():
    """A compiled block-drafter pass runs the body and applies the head itself (`reduced_head`): a model
    whose head transforms its logits otherwise (Cohere's logit_scale) keeps its eager passes, and says why."""
    from transformers import CohereConfig, CohereForCausalLM

    torch._dynamo.reset()
    small = dict(vocab_size=V + 1, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    cohere = CohereForCausalLM(CohereConfig(**small, logit_scale=0.0625, tie_word_embeddings=False)).double().eval()
    drafter = BlockDiffusionDrafter(cohere, BlockDiffusionConfig(mask_token_id=V, block_size=8, sub_block_size=4))
    target = target_saying("on")
    before = graphs()
    engine = SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert not drafter.runs_compiled and graphs() == before
    assert "eager: " in drafter.describe() and "transforms its logits" in drafter.describe()
    prompt = PROMPTS[0]
    assert engine.generate(prompt, max_new_tokens=12, stop_token_ids=[]).token_ids == \
        reference_greedy(target.model, prompt, 12, stop_ids=())


def test_a_compile_that_fails_leaves_the_drafter_eager_and_says_why(monkeypatch):
    """Inductor or dynamo failing (no C compiler, an untraceable model) must not fail the engine's start
    or leave a broken graph behind: the drafter drafts eagerly, with the reason in describe() and a warning."""
    tries = []

    def broken(fn, **kwargs):
        tries.append(fn)

        def run(*args, **kw):
            raise RuntimeError("no C compiler here")
        return run

    monkeypatch.setattr(compile_choice.torch, "compile", broken)
    target = target_saying("on")
    drafter = drafter_of("block", target)
    with pytest.warns(UserWarning, match="compiling failed"):
        engine = SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert not drafter.runs_compiled and "eager: compiling failed (RuntimeError: no C compiler here)" in \
        drafter.describe()
    SpeculativeEngine(target, drafter, FixedPolicy(4))  # attached again: no second try, no second warning
    assert len(tries) == 1
    monkeypatch.undo()  # a working compiler again, and the drafter in another dtype: decided anew, compiled
    drafter._use_dtype(torch.float32)
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert drafter.runs_compiled and "compiled" in drafter.describe()
    prompt = PROMPTS[1]
    assert engine.generate(prompt, max_new_tokens=12, stop_token_ids=[]).token_ids == \
        reference_greedy(target.model, prompt, 12, stop_ids=())


def test_compiled_through_the_measured_matmul_kernels_and_attached_again(monkeypatch, tmp_path):
    """With the target's --kernels auto the drafter's linear layers are routed (kernels.py, bound methods):
    its graph is traced through them, and neither a re-attach nor requests at other lengths compile again."""
    from diffspec import kernels as K

    def route_every_row(model, mode, quiet=False):  # whatever this machine would measure
        return K.LinearPlan({shape: frozenset(K.ROW_BUCKETS) for shape in K.linear_groups(model)})

    monkeypatch.setenv("DIFFSPEC_COST_CACHE", str(tmp_path))
    monkeypatch.setattr(K, "plan_for_mode", route_every_row)
    torch._dynamo.reset()
    target = Target(make_model(V, seed=7), kernels="auto")
    target.compiled = C.CompiledPasses("on")
    drafter = drafter_of("block", target)
    engine = SpeculativeEngine(target, drafter, FixedPolicy(5))
    assert drafter.runs_compiled and drafter._kernels_for is not None
    assert sum("forward" in m.__dict__ for m in drafter.model.modules()) >= 7  # 7 linears a layer, 2 layers
    before = graphs()
    with torch._dynamo.config.patch(error_on_recompile=True):
        for prompt in PROMPTS:
            SpeculativeEngine(target, drafter, FixedPolicy(5))
            got = engine.generate(prompt, max_new_tokens=16, stop_token_ids=[]).token_ids
            assert got == reference_greedy(target.model, prompt, 16, stop_ids=())
    assert graphs() == before
