"""The direct Llama pass (llama_pass.py): transformers' arithmetic with fewer calls. It must give transformers'
own logits and hidden states bitwise, at every pass width, fresh and on a cache, after a rollback, with float32
and packed (GGUF-code) kernels, and take only the models and caches where that is so."""

from __future__ import annotations

import pytest
import torch

from diffspec import attention
from diffspec import kernels as K
from diffspec import llama_pass as LP
from diffspec import packed_linear as P
from diffspec.cache import new_cache, reserve_cache, truncate_cache
from diffspec.engine import SpeculativeEngine
from diffspec.policies import make_policy
from diffspec.target import Target

from conftest import make_model
from helpers import RandomDrafter, ScriptedDrafter
from test_packed_linear import coded_model, every_bucket_packed, gguf_weight

#: pass widths in order (a prefill, one-row steps, verify passes of several widths), and rollbacks after some
PASSES = [(7, 0), (1, 0), (1, 0), (2, 0), (5, 2), (9, 0), (1, 0), (16, 5), (3, 0), (70, 4), (1, 0)]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float64: torch.int64, torch.float32: torch.int32}.get(t.dtype, torch.int16))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def assert_transformers_bitwise(model, direct, vocab: int, hidden_states: bool = True):
    ids = torch.randint(3, vocab, (200,), generator=torch.Generator().manual_seed(1))
    theirs, ours = new_cache(model.config), new_cache(model.config)
    for cache in (theirs, ours):
        reserve_cache(cache, 200)
    pos = 0
    for n, back in PASSES:
        x = ids[pos:pos + n].view(1, n)
        for keep in (0, 1, torch.zeros(0, dtype=torch.long)):
            with torch.inference_mode():
                want = model(input_ids=x, past_key_values=theirs, use_cache=True, output_hidden_states=hidden_states,
                             logits_to_keep=keep)
            got = direct.forward(x, ours, output_hidden_states=hidden_states, logits_to_keep=keep)
            assert same_bits(got.logits, want.logits), (n, keep)
            if hidden_states:
                assert len(got.hidden_states) == len(want.hidden_states)
                assert all(same_bits(a, b) for a, b in zip(got.hidden_states, want.hidden_states)), (n, keep)
            for cache in (theirs, ours):  # the same pass again next time round
                truncate_cache(cache, pos)
        with torch.inference_mode():  # keep the last pass, then roll back
            model(input_ids=x, past_key_values=theirs, use_cache=True)
        direct.forward(x, ours)
        for cache in (theirs, ours):
            truncate_cache(cache, pos + n - back)
        for a, b in zip(theirs.layers, ours.layers):
            assert a.length == b.length and same_bits(a.keys, b.keys) and same_bits(a.values, b.values)
        pos += n - back


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gqa", [False, True])
def test_the_direct_pass_equals_transformers_bitwise(dtype, gqa):
    model = make_model(70, seed=2, dtype=dtype)
    if gqa:
        assert attention.install(model)
    assert LP.applies(model)
    assert_transformers_bitwise(model, LP.LlamaPass(model), 70)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_table_cuts_the_modules_own_rows_bitwise_and_grows(dtype):
    """The table (made once, cut per pass) gives what the rotary module gives the pass, past its first size too,
    and is made anew when the module's frequencies change."""
    model = make_model(70, seed=2, dtype=dtype, max_pos=8192)
    rotary = model.model.rotary_emb
    table = LP.RotaryTable(rotary)
    assert table.applies
    h = torch.zeros(1, 1, 32, dtype=dtype)
    rng = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(200):
            n = int(torch.randint(1, 34, (1,), generator=rng))
            start = int(torch.randint(0, 3000, (1,), generator=rng))
            cos, sin = table.rows(h, start, n)
            want_cos, want_sin = rotary(h, position_ids=torch.arange(start, start + n).unsqueeze(0))
            assert same_bits(cos, want_cos) and same_bits(sin, want_sin), (start, n)
        assert table._cos.shape[1] >= 3033  # grown past MIN_POSITIONS
        before = table.rows(h, 5, 1)[0].clone()
        rotary.inv_freq.mul_(2)  # new frequencies (in place: the same storage)
        cos, _ = table.rows(h, 5, 1)
        assert same_bits(cos, rotary(h, position_ids=torch.tensor([[5]]))[0]) and not torch.equal(cos, before)
    rotary.inv_freq = rotary.inv_freq * 3  # another tensor (made outside inference mode: a version of its own, 0)
    with torch.inference_mode():
        cos, _ = table.rows(h, 7, 2)
        assert same_bits(cos, rotary(h, position_ids=torch.tensor([[7, 8]]))[0])


def test_rotary_kinds_that_rescale_with_the_length_keep_calling_the_module(monkeypatch):
    model = make_model(70, seed=2, dtype=torch.float32)
    rotary = model.model.rotary_emb
    monkeypatch.setattr(rotary, "rope_type", "dynamic")
    assert LP.RotaryTable(rotary).rows(torch.zeros(1, 1, 32), 0, 1) is None
    calls = []
    original = rotary.forward
    monkeypatch.setattr(rotary, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    direct = LP.LlamaPass(model)
    direct.forward(torch.tensor([[3, 4]]), new_cache(model.config))
    assert calls  # the module itself ran


def test_rms_norm_rows_as_wide_as_smollm2s_equal_transformers_bitwise():
    model = make_model(70, seed=4, layers=1, hidden=576, dtype=torch.float32)  # torch's rms_norm on 576-wide rows
    assert_transformers_bitwise(model, LP.LlamaPass(model), 70)


def test_with_packed_kernels_one_call_runs_q_k_v_one_gate_up_bitwise(monkeypatch):
    model = coded_model()
    P.pack_model(model)
    plan = every_bucket_packed(model)
    K.install(model, plan)
    attention.install(model)
    calls, original = [], LP.run_pack
    monkeypatch.setattr(LP, "run_pack", lambda x, pack: calls.append(pack.codes.shape[0]) or original(x, pack))
    direct = LP.LlamaPass(model, plan, fused=False)  # the torch operations (fused_layers.py: tested on its own)
    direct.forward(torch.tensor([[5, 6, 7]]), new_cache(model.config))
    layers = model.config.num_hidden_layers
    q, kv, ff = 64, model.config.num_key_value_heads * 16, model.config.intermediate_size
    assert calls == [q + 2 * kv, q, 2 * ff, model.config.hidden_size] * layers  # the head: its routed forward
    assert_transformers_bitwise(model, direct, 96)
    with K.stock_kernels(model):  # F.linear, as transformers: no packed call of the direct pass's own
        calls.clear()
        assert_transformers_bitwise(model, direct, 96, hidden_states=False)
        assert calls == []
    K.uninstall(model)


def test_layers_packed_for_some_widths_or_in_other_kinds_fall_back_bitwise():
    model = coded_model()
    P.pack_model(model)
    layer = model.model.layers[0].self_attn
    with torch.no_grad():  # v as Q8 codes: q/k/v cannot be one call in this layer
        layer.v_proj.weight.copy_(gguf_weight("q8_0", 32, 64, seed=9))
    P.pack_model(model)
    assert layer.v_proj.packed_weight.kind == "q8" and layer.q_proj.packed_weight.kind == "q4"
    plan = K.LinearPlan(packed_rows={(64, 64): frozenset({1, 2, 16}), (32, 64): frozenset({1}),
                                     (128, 64): frozenset(K.ROW_BUCKETS), (96, 64): frozenset({1, 2})})
    K.install(model, plan)
    direct = LP.LlamaPass(model, plan, fused=False)
    assert_transformers_bitwise(model, direct, 96)
    stacked = model.model.layers[1].mlp  # gate/up share one buffer of codes, each layer views of its rows
    gate, up = stacked.gate_proj.packed_weight, stacked.up_proj.packed_weight
    assert gate.codes.untyped_storage().data_ptr() == up.codes.untyped_storage().data_ptr()
    assert P.current_pack(stacked.gate_proj) is gate and P.current_pack(stacked.up_proj) is up
    assert torch.equal(bits(gate.decode()), bits(stacked.gate_proj.weight))
    K.uninstall(model)


def test_it_takes_only_the_models_it_equals():
    assert LP.applies(make_model(70))
    biased = make_model(70)
    biased.config.attention_bias = True
    hooked = make_model(70)
    hooked.model.layers[0].mlp.register_forward_hook(lambda *a: None)  # a user's hook, which it would skip
    eager = make_model(70)
    eager.config._attn_implementation = "eager"
    training = make_model(70).train()
    wide_heads = make_model(70)
    wide_heads.config.head_dim = 288  # shared key/value heads over 256 dimensions: transformers packs or repeats
    offloaded = make_model(70)
    offloaded.model.layers[1].mlp._hf_hook = object()  # accelerate wraps forwards and marks the module so
    gelu = make_model(70)
    gelu.config.hidden_act = "gelu"
    split = make_model(70)
    split.config.pretraining_tp = 2
    for model in (biased, hooked, eager, training, wide_heads, offloaded, gelu, split):
        assert not LP.applies(model)
    full = new_cache(make_model(70).config)
    assert LP.cache_applies(full, 2) and not LP.cache_applies(full, 3)
    from transformers import DynamicCache
    assert not LP.cache_applies(DynamicCache(config=make_model(70).config), 2)  # transformers' concatenating cache


def test_a_target_takes_it_where_it_applies_and_decodes_as_transformers():
    direct = Target(make_model(70, seed=5, dtype=torch.float32), kernels="auto")
    stock = Target(make_model(70, seed=5, dtype=torch.float32), kernels="stock")
    assert direct.runtime()["forward"] == "direct (llama_pass.py)" and stock.runtime()["forward"] == "transformers"
    other = Target(make_model(70, seed=5, dtype=torch.float32), kernels="auto")
    other.direct_pass, other._fingerprint = None, None
    assert direct.base_fingerprint != other.base_fingerprint  # the same outputs, other costs: cost tables apart
    calls = []
    original = direct.direct_pass.forward
    direct.direct_pass.forward = lambda *a, **kw: calls.append(1) or original(*a, **kw)
    prompt = list(range(5, 17))
    plain = SpeculativeEngine(direct, None).generate(prompt, max_new_tokens=30, stop_token_ids=[]).token_ids
    assert calls  # the target's passes went through it
    direct.model.train()  # changed after the target was built: transformers' forward (bitwise the same)
    calls.clear()
    assert SpeculativeEngine(direct, None).generate(prompt, max_new_tokens=30, stop_token_ids=[]).token_ids == plain
    assert not calls
    direct.model.eval()
    for drafter in (ScriptedDrafter(prompt + plain), RandomDrafter(70, seed=4)):
        engine = SpeculativeEngine(direct, drafter, make_policy("fixed", gamma=5))
        assert engine.generate(prompt, max_new_tokens=30, stop_token_ids=[]).token_ids == plain


@pytest.mark.parametrize("gamma", [1, 4, 12])
def test_greedy_speculation_through_the_direct_pass_with_packed_kernels_equals_plain(gamma):
    target = Target(coded_model(), kernels="stock")
    P.pack_model(target.model)
    target.linear_plan = every_bucket_packed(target.model)
    K.install(target.model, target.linear_plan)
    target.direct_pass = LP.LlamaPass(target.model, target.linear_plan, fused=False)  # fused: test_fused_layers.py
    prompt = list(range(5, 17))
    plain = SpeculativeEngine(target, None).generate(prompt, max_new_tokens=40, stop_token_ids=[]).token_ids
    for drafter in (ScriptedDrafter(prompt + plain), RandomDrafter(96, seed=4)):
        engine = SpeculativeEngine(target, drafter, make_policy("fixed", gamma=gamma))
        assert engine.generate(prompt, max_new_tokens=40, stop_token_ids=[]).token_ids == plain
    K.uninstall(target.model)


def test_layer_outputs_read_as_transformers_hidden_states_and_gather_the_layers_asked():
    """The fused call's hidden states (LP.LayerOutputs) index, slice and iterate as the tuple transformers gives (the
    embeddings, each layer's output, the last one normed), and rows_of gathers chosen layers as the target's cat did."""
    g = torch.Generator().manual_seed(0)
    emb, outputs, normed = torch.randn(1, 3, 8, generator=g), torch.randn(5, 3, 8, generator=g), torch.randn(1, 3, 8)
    hs = LP.LayerOutputs(emb, outputs)
    hs[-1] = normed
    want = (emb, *(outputs[i].unsqueeze(0) for i in range(4)), normed)
    assert len(hs) == len(want) == 6
    assert all(torch.equal(a, b) for a, b in zip(hs, want))
    assert torch.equal(hs[-2], want[-2]) and all(torch.equal(a, b) for a, b in zip(hs[1:4], want[1:4]))
    with pytest.raises(IndexError):
        hs[6]
    for layers, n in (((0, 2, 3), 3), ((1,), 2)):
        got = hs.rows_of(layers, n)
        assert torch.equal(got, torch.cat([want[i + 1][0, :n] for i in layers], dim=-1))
    assert hs.rows_of((4,), 3) is None  # the last layer's entry is the final norm's output, not the buffer's


# --- drafters' passes: their own masks, a cache of layers made on first use, no cache at all ---------------------

@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_drafters_masked_passes_equal_transformers_bitwise(dtype):
    """The block-diffusion drafter's passes (a block-causal mask over committed blocks, then bidirectional
    denoising steps rolled back) on cache.full_cache(), and the masked-diffusion drafter's (a bidirectional mask,
    no cache, explicit positions): logits and hidden states bitwise transformers' own."""
    from diffspec.cache import full_cache
    from diffspec.drafters.denoising import block_causal_mask, full_mask

    model = make_model(71, seed=3, dtype=dtype)
    direct = LP.LlamaPass(model)
    ids = torch.randint(3, 71, (64,), generator=torch.Generator().manual_seed(2))
    theirs, ours = full_cache(), full_cache()
    assert LP.cache_ready(ours, model.config.num_hidden_layers) and not theirs.layers  # ours made up front
    B, pos = 4, 0
    for n_commit in (8, 4, 12):  # commits of whole blocks (kept), each followed by two denoising steps (rolled back)
        steps = [(ids[pos:pos + n_commit], block_causal_mask(n_commit, pos, B), True)]
        steps += [(ids[pos + n_commit + j:pos + n_commit + j + B], full_mask(B, pos + n_commit + B), False)
                  for j in (0, 1)]
        for x, mask, commit in steps:
            start = theirs.get_seq_length()
            for keep in (0, 1, torch.tensor([0, 2])):
                with torch.inference_mode():
                    want = model(input_ids=x[None], attention_mask=mask, past_key_values=theirs, use_cache=True,
                                 output_hidden_states=True, logits_to_keep=keep)
                got = direct.forward(x[None], ours, attention_mask=mask, output_hidden_states=True,
                                     logits_to_keep=keep)
                assert same_bits(got.logits, want.logits), (n_commit, keep)
                assert all(same_bits(a, b) for a, b in zip(got.hidden_states, want.hidden_states))
                for cache in (theirs, ours):
                    truncate_cache(cache, start)
            if commit:
                with torch.inference_mode():
                    model(input_ids=x[None], attention_mask=mask, past_key_values=theirs, use_cache=True)
                direct.forward(x[None], ours, attention_mask=mask)
        pos += n_commit
    for a, b in zip(theirs.layers, ours.layers):
        assert a.length == b.length and same_bits(a.keys, b.keys) and same_bits(a.values, b.values)
    # no cache: a bidirectional pass at explicit positions (the masked-diffusion drafter's)
    x, pos = ids[:20][None], torch.arange(30, 50)[None]
    for keep in (0, torch.tensor([3, 7, 19])):
        with torch.inference_mode():
            want = model(input_ids=x, attention_mask=full_mask(20, 20), position_ids=pos, use_cache=False,
                         logits_to_keep=keep)
        got = direct.forward(x, None, use_cache=False, attention_mask=full_mask(20, 20), position_ids=pos,
                             logits_to_keep=keep)
        assert same_bits(got.logits, want.logits)


def test_a_mask_of_the_wrong_shape_or_kind_is_refused_by_name():
    model = make_model(70, seed=2)
    direct = LP.LlamaPass(model)
    x = torch.tensor([[5, 6, 7]])
    for bad in (torch.ones(1, 1, 3, 4, dtype=torch.bool), torch.ones(1, 1, 3, 3), torch.ones(3, 3, dtype=torch.bool)):
        with pytest.raises(ValueError, match="boolean attention mask of shape"):
            direct.forward(x, new_cache(model.config), attention_mask=bad)


def drafter_attached(make, target):
    d = make()
    d.attach(target)
    return d


@pytest.mark.parametrize("kind", ["block", "block-draft-vocab", "masked", "ar"])
def test_drafters_take_the_direct_pass_with_measured_kernels_and_draft_the_same(kind, monkeypatch):
    """Attached to a target with measured kernels, a Llama-bodied drafter runs its passes through the direct pass
    (not transformers' forward), and drafts what the same drafter drafts through transformers' forward bitwise: the
    same tokens, the same q. Both are attached to the one target, so both run the same measured matmul plan (a
    drafter attached to a `--kernels stock` target runs F.linear, which may differ in the last bits from the plan's
    mm(W, x^T) in the last bits, seen: comparing across the two failed once under load, when the timed plan chose mm
    for a shape, and fails whenever the plan is all mm). Attached
    to a `stock` target, no direct pass."""
    from diffspec import AutoregressiveDrafter
    from diffspec.drafters import (BlockDiffusionConfig, BlockDiffusionDrafter, MaskedDiffusionConfig,
                                   MaskedDiffusionDrafter)
    from diffspec.policies import FixedPolicy
    from diffspec.types import SamplingParams

    V = 40

    def drafter():
        body = make_model(V + 1, seed=8, std=0.6)
        if kind == "block":
            return BlockDiffusionDrafter(body, BlockDiffusionConfig(mask_token_id=V, block_size=4, sub_block_size=2))
        if kind == "block-draft-vocab":
            return BlockDiffusionDrafter(body, BlockDiffusionConfig(mask_token_id=V, block_size=4, sub_block_size=2),
                                         draft_token_ids=torch.arange(1, V, 2))
        if kind == "masked":
            return MaskedDiffusionDrafter(body, MaskedDiffusionConfig(mask_token_id=V, steps=2))
        return AutoregressiveDrafter(make_model(V, seed=9, layers=1, std=0.6))

    assert drafter_attached(drafter, Target(make_model(V, seed=5, std=0.6), kernels="stock"))._direct is None
    target = Target(make_model(V, seed=5, std=0.6), kernels="auto")
    drafts = {}
    for path in ("direct", "transformers"):
        d = drafter_attached(drafter, target)
        assert d._direct is not None
        if path == "transformers":
            d._direct = None
        calls = []
        if d._direct is not None:
            real = d._direct.forward
            monkeypatch.setattr(d._direct, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
        out = []
        for i, n in enumerate((9, 13, 14, 21)):
            context = torch.randint(3, V, (n,), generator=torch.Generator().manual_seed(i))
            gen = torch.Generator().manual_seed(100 + i)
            draft = d.propose(context, FixedPolicy(5), 5, SamplingParams(temperature=0.9), gen)
            out.append((draft.tokens.tolist(), None if draft.probs is None else draft.probs.clone()))
        assert (len(calls) > 0) == (path == "direct")
        drafts[path] = out
    for (tok_a, q_a), (tok_b, q_b) in zip(drafts["direct"], drafts["transformers"]):
        assert tok_a == tok_b
        assert (q_a is None) == (q_b is None) and (q_a is None or same_bits(q_a, q_b))
