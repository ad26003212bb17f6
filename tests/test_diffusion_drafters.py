"""Diffusion drafters: greedy equivalence for every kind x policy, acceptance where it must happen, masks,
cache reuse, unmasking rules."""

import pytest
import torch

from conftest import make_model, reference_greedy
from diffspec import FailFastPolicy, FixedPolicy, SamplingParams, SpeculativeEngine, Target
from diffspec.drafters import (BlockDiffusionConfig, BlockDiffusionDrafter, ConditionedConfig, ConditionedDrafter,
                               ConditionedDraftModel, MaskedDiffusionConfig, MaskedDiffusionDrafter)
from diffspec.drafters import conditioned, conditioned_fused
from diffspec.drafters.denoising import block_causal_mask, full_mask, judge_out_of_order_one_hot, keeps_q, select_top, select_unmask
from diffspec.policies import failfast_next_increment

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6], list(range(11, 31)), [30]]


def dllm(vocab_size, seed=3, std=0.5):
    """A tiny random diffusion body: the target's vocabulary plus one mask token (id = vocab_size)."""
    return make_model(vocab_size + 1, seed=seed, std=std)


def conditioned_for(target, seed=4, block_size=6, layers=1, lookup_hints=False):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        cfg = ConditionedConfig.for_target(target.model.config, mask_token_id=3, num_hidden_layers=layers,
                                           block_size=block_size, num_features=2, lookup_hints=lookup_hints)
        model = ConditionedDraftModel(cfg).to(torch.float64)
        for p in model.parameters():  # larger weights: peakier drafts, so some get accepted
            p.data.normal_(0, 0.3) if p.dim() > 1 else None
    return ConditionedDrafter(model)


def make(kind, target, tokenizer_size):
    v = tokenizer_size
    if kind == "block":
        return BlockDiffusionDrafter(dllm(v), BlockDiffusionConfig(mask_token_id=v, block_size=8, sub_block_size=4))
    if kind == "block-unshifted-multistep":
        return BlockDiffusionDrafter(dllm(v), BlockDiffusionConfig(mask_token_id=v, block_size=4, sub_block_size=2,
                                                                   unmask_threshold=0.5, logit_shift=False))
    if kind == "masked":
        return MaskedDiffusionDrafter(dllm(v), MaskedDiffusionConfig(mask_token_id=v, steps=2))
    if kind == "masked-unshifted":
        return MaskedDiffusionDrafter(dllm(v), MaskedDiffusionConfig(mask_token_id=v, steps=3, logit_shift=False,
                                                                     context_window=6))
    if kind == "conditioned":
        return conditioned_for(target)
    if kind == "conditioned-hints":  # prompt lookup's copy in its block
        return conditioned_for(target, lookup_hints=True)
    if kind == "conditioned-q8":  # 8-bit codes and activations, one C call a pass (conditioned_fused.py)
        if conditioned_fused.unavailable() is not None:  # no C compiler here: nothing to test
            pytest.skip(f"fused_layers.c does not build here: {conditioned_fused.unavailable()}")
        drafter = conditioned_for(target)
        drafter.compute_dtype = "q8"
        return drafter
    raise ValueError(kind)


KINDS = ["block", "block-unshifted-multistep", "masked", "masked-unshifted", "conditioned", "conditioned-hints",
         "conditioned-q8"]
POLICIES = {
    "fixed4": lambda: FixedPolicy(4),
    "fixed13": lambda: FixedPolicy(13),                            # crosses block boundaries
    "failfast": lambda: FailFastPolicy(),
    "failfast-extend": lambda: FailFastPolicy(tau=0.0, n=3, n_max=11),  # always widens: several windows
}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_equivalence(target, tiny_model, tokenizer, kind, policy):
    engine = SpeculativeEngine(target, make(kind, target, len(tokenizer)), POLICIES[policy]())
    drafted = 0
    for prompt in PROMPTS:
        r = engine.generate(prompt, max_new_tokens=30)
        assert r.token_ids == reference_greedy(tiny_model, prompt, 30), (kind, policy, prompt)
        drafted += r.drafted_tokens
        assert r.drafter_forward_passes > 0
    assert drafted > 0


def test_target_as_its_own_block_drafter_accepts_everything(target, tiny_model, tokenizer):
    """With block size 1 the block-causal mask is the causal mask: a block drafter whose body is the
    target (plus a mask row) drafts exactly the target's tokens, so every draft must be accepted."""
    v = len(tokenizer)
    drafter = BlockDiffusionDrafter(with_mask_row(tiny_model, v),
                                    BlockDiffusionConfig(mask_token_id=v, block_size=1, sub_block_size=1))
    r = SpeculativeEngine(target, drafter, FixedPolicy(6)).generate(PROMPTS[1], max_new_tokens=40, stop_token_ids=[])
    assert r.token_ids == reference_greedy(tiny_model, PROMPTS[1], 40, stop_ids=())
    assert r.accepted_tokens == r.drafted_tokens > 0


def with_mask_row(model, vocab_size, seed=9, layers=2):
    """A diffusion body computing what `model` computes, plus a mask token (id = vocab_size) whose
    embedding and head row are zero."""
    body = make_model(vocab_size + 1, seed=seed, layers=layers)
    with torch.no_grad():
        own = dict(body.named_parameters())
        for name, p in model.named_parameters():
            own[name][: p.shape[0]].copy_(p)
        body.model.embed_tokens.weight[vocab_size].zero_()
        body.lm_head.weight[vocab_size].zero_()
    return body


@pytest.fixture(scope="module")
def attentionless(tokenizer):
    """A target without attention (every o_proj zero): its next token is a fixed function f of the
    current token. A diffusion body computing the same f sees the mask token (zero embedding) as an
    all-zero hidden state, so a row fed a mask has uniform logits (confidence 1/V, below every row fed
    a real token). With shifted logits the only masked position predicted from a real token is the
    leftmost one, so each denoising step unmasks exactly the leftmost mask, with f of its left
    neighbour: the draft is the target's own greedy chain, whatever the block or window layout."""
    v = len(tokenizer)
    model = make_model(v, seed=7, layers=1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight"):
                p.zero_()
    return model, with_mask_row(model, v, layers=1)


ACCEPTING = {
    # block 8 with sub-blocks of 4 and the default 0.05 threshold (> 1/V: a uniform row never passes)
    "block": lambda body, v: BlockDiffusionDrafter(body, BlockDiffusionConfig(mask_token_id=v, block_size=8,
                                                                              sub_block_size=4)),
    # T >= every window: one mask unmasked per step
    "masked": lambda body, v: MaskedDiffusionDrafter(body, MaskedDiffusionConfig(mask_token_id=v, steps=16)),
}


@pytest.mark.parametrize("policy", ["fixed4", "fixed13", "failfast-extend"])
@pytest.mark.parametrize("kind", list(ACCEPTING))
def test_drafter_that_knows_the_target_gets_every_token_accepted(attentionless, tokenizer, kind, policy):
    """Acceptance, not just drafting: a shifted diffusion drafter computing the target's own next-token
    function must have every drafted token accepted, across block boundaries (fixed13 > block 8)
    and widening FailFast windows, and the output must still be plain greedy."""
    model, body = attentionless
    v = len(tokenizer)
    engine = SpeculativeEngine(Target(model, tokenizer), ACCEPTING[kind](body, v), POLICIES[policy]())
    for prompt in PROMPTS[:2]:
        r = engine.generate(prompt, max_new_tokens=30, stop_token_ids=[])
        assert r.token_ids == reference_greedy(model, prompt, 30, stop_ids=()), (kind, policy, prompt)
        assert r.accepted_tokens == r.drafted_tokens >= 20, (kind, policy, [(x.drafted, x.accepted) for x in r.rounds])


def test_masked_drafter_unmasking_several_per_step_still_gets_its_first_token_accepted(attentionless, tokenizer):
    """With T=2 a step unmasks several masks at once, most of them fed by masks (wrong); only the
    leftmost, predicted from the last real token, must be right: every round accepts at least one."""
    model, body = attentionless
    v = len(tokenizer)
    engine = SpeculativeEngine(Target(model, tokenizer),
                               MaskedDiffusionDrafter(body, MaskedDiffusionConfig(mask_token_id=v, steps=2)),
                               FixedPolicy(6))
    r = engine.generate(PROMPTS[0], max_new_tokens=30, stop_token_ids=[])
    assert r.token_ids == reference_greedy(model, PROMPTS[0], 30, stop_ids=())
    assert 0 not in r.token_ids  # a mask-fed row's argmax (uniform logits: token 0) is always a wrong guess here
    drafting = [x for x in r.rounds if x.drafted]
    assert drafting and all(x.accepted >= 1 for x in drafting), [(x.drafted, x.accepted) for x in r.rounds]
    assert r.accepted_tokens < r.drafted_tokens  # the wrong guesses are really there, and rejected


def test_one_layer_target_as_block_drafter_is_accepted_at_every_block_boundary(other_model, tokenizer):
    """Real attention, block 4 > 1. For a one-layer model the keys of cached positions depend on their
    tokens alone, and the last position of a committed block sees, block-causally, exactly the
    positions up to itself: its logits (the shifted prediction of the next block's first token) are
    the target's own next-token logits. So in every round whose context ends on a block boundary the
    first drafted token must be accepted. (Inside a block the query also sees the masks after it:
    there nothing is guaranteed, and nothing is asserted.)"""
    v, B = len(tokenizer), 4
    drafter = BlockDiffusionDrafter(with_mask_row(other_model, v, layers=1),
                                    BlockDiffusionConfig(mask_token_id=v, block_size=B, sub_block_size=2))
    engine = SpeculativeEngine(Target(other_model, tokenizer), drafter, FixedPolicy(5))
    boundary_rounds = 0
    for prompt in (PROMPTS[0][:8], PROMPTS[1]):  # lengths 8 and 20: the first round starts on a boundary
        r = engine.generate(prompt, max_new_tokens=30, stop_token_ids=[])
        assert r.token_ids == reference_greedy(other_model, prompt, 30, stop_ids=())
        context = len(prompt)
        for x in r.rounds:
            if context % B == 0 and x.drafted:
                assert x.accepted >= 1, (context, [(y.drafted, y.accepted) for y in r.rounds])
                boundary_rounds += 1
            context += x.emitted
    assert boundary_rounds >= 2


def test_block_causal_mask_edges():
    m = block_causal_mask(q_len=6, past_len=2, block_size=4)[0, 0]  # queries at positions 2..7
    assert m.shape == (6, 8)
    assert m[0].tolist() == [True] * 4 + [False] * 4     # position 2 (block 0) sees block 0 only, both ways
    assert m[1].tolist() == [True] * 4 + [False] * 4     # position 3: last of block 0
    assert m[2].tolist() == [True] * 8                   # position 4: first of block 1 sees blocks 0 and 1
    assert m[5].tolist() == [True] * 8
    assert full_mask(2, 5).all() and full_mask(2, 5).shape == (1, 1, 2, 5)


def test_cached_forward_of_finished_blocks_equals_uncached(tokenizer):
    from diffspec.cache import new_cache

    model = dllm(len(tokenizer))
    ids = torch.randint(4, 60, (1, 12))
    B = 4
    whole = model(input_ids=ids, attention_mask=block_causal_mask(12, 0, B)).logits
    cache = new_cache(model.config)
    parts = []
    for s in range(0, 12, B):
        parts.append(model(input_ids=ids[:, s:s + B], attention_mask=block_causal_mask(B, s, B),
                           past_key_values=cache, use_cache=True).logits)
    assert torch.allclose(torch.cat(parts, 1), whole, atol=1e-10)
    causal = model(input_ids=ids).logits
    assert not torch.allclose(causal, whole)  # the mask really changes attention inside blocks


def test_cache_reuse_saves_passes_and_changes_nothing(target, tiny_model, tokenizer):
    v = len(tokenizer)
    body = dllm(v)
    results = {}
    for reuse in (True, False):
        drafter = BlockDiffusionDrafter(body, BlockDiffusionConfig(mask_token_id=v, block_size=4, sub_block_size=2),
                                        reuse_cache=reuse)
        results[reuse] = SpeculativeEngine(target, drafter, FixedPolicy(6)).generate(PROMPTS[1], max_new_tokens=40)
    assert results[True].token_ids == results[False].token_ids == reference_greedy(tiny_model, PROMPTS[1], 40)
    assert results[True].drafter_forward_passes < results[False].drafter_forward_passes


def test_sub_block_unmask_rule():
    assert select_unmask(torch.tensor([0.2, 0.01, 0.9, 0.06]), 0.05).tolist() == [0, 2, 3]
    assert select_unmask(torch.tensor([0.2, 0.01, 0.3]), 0.5).tolist() == [2]  # at least the most confident
    assert select_unmask(torch.tensor([0.04]), 0.05).tolist() == [0]
    assert select_top(torch.tensor([0.2, 0.7, 0.1, 0.9]), 2).tolist() == [1, 3]
    assert select_top(torch.tensor([0.2]), 5).tolist() == [0]


def test_keeps_q_per_position():
    """A position keeps its q iff no position to its left was unmasked at a later step."""
    assert keeps_q([1, 1, 2, 2, 3]) == [True] * 5
    assert keeps_q([]) == []
    assert keeps_q([1, 3, 2]) == [True, True, False]          # issue 15's worked case: d_0 keeps its q
    assert keeps_q([2, 1, 3, 2, 4]) == [True, False, True, False, True]


def test_out_of_order_positions_are_judged_one_hot():
    from diffspec.types import Draft

    q = torch.full((3, 4), 0.25, dtype=torch.float64)
    draft = Draft(torch.tensor([1, 2, 3]), q, torch.ones(3), 2)
    judged = judge_out_of_order_one_hot(draft, [1, 3, 2])
    assert torch.equal(judged.probs[:2], q[:2]) and judged.probs[2].tolist() == [0, 0, 0, 1.0]
    assert judge_out_of_order_one_hot(draft, [1, 2, 3]) is draft
    assert torch.equal(q, torch.full((3, 4), 0.25, dtype=torch.float64))  # the drafter's rows are not modified


class RecordingPolicy(FailFastPolicy):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = []

    def next_increment(self, confidences):
        self.calls.append(tuple(confidences))
        return super().next_increment(confidences)


@pytest.mark.parametrize("tau", [0.0, 0.05, 0.12, 0.3, 1.0])
def test_block_drafter_stops_where_failfast_says(target, tokenizer, tau):
    """The drafter hands the policy its real confidences; the draft ends exactly where Algorithm 1 says."""
    v = len(tokenizer)
    drafter = BlockDiffusionDrafter(dllm(v, std=0.8), BlockDiffusionConfig(mask_token_id=v, block_size=8,
                                                                          sub_block_size=4))
    drafter.attach(target)
    drafter.begin(None)
    policy = RecordingPolicy(tau=tau, n=3, n_max=14)
    draft = drafter.propose(torch.tensor(PROMPTS[1]), policy, 100, SamplingParams(), None)
    conf = draft.confidences.tolist()
    expected = 0
    while (k := failfast_next_increment(conf[:expected], tau, 3, 14)) > 0:
        expected += k
    assert len(draft) == expected
    assert list(policy.calls[-1]) == pytest.approx(conf)
    assert all(0 < c <= 1 for c in conf)


def test_conditioned_drafter_requires_matching_width(target, tokenizer):
    from diffspec import DiffspecError

    cfg = ConditionedConfig(hidden_size=48, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
                            intermediate_size=64, num_target_layers=2, target_layer_ids=(0, 1), vocab_size=64,
                            mask_token_id=3)
    with pytest.raises(DiffspecError, match="width"):
        SpeculativeEngine(target, ConditionedDrafter(ConditionedDraftModel(cfg)))


def test_conditioned_drafter_sees_exactly_the_accepted_positions(target, tokenizer):
    drafter = conditioned_for(target)
    engine = SpeculativeEngine(target, drafter, FixedPolicy(5))
    r = engine.generate(PROMPTS[0], max_new_tokens=25, stop_token_ids=[])
    # every position but the last emitted token has had its target features handed over
    assert drafter._context_len == len(PROMPTS[0]) + len(r.token_ids) - 1
    assert r.drafter_forward_passes == sum(1 for x in r.rounds if x.drafted)  # one pass drafts a whole block


@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("sampled", [False, True])
def test_conditioned_head_runs_on_the_rows_the_policy_takes(target, monkeypatch, q8, sampled):
    """One pass drafts the whole block, but the head (the widest product a row: the draft vocabulary x the width) runs
    on the rows the policy takes, at least doubling what it drew (one token at a time: rows 1, 1, 2, 4, 1). The drafts
    are block_logits' rows all the same: greedy tokens its argmaxes, sampled q its softmax (q8: bitwise its rows)."""
    if q8 and conditioned_fused.unavailable() is not None:
        pytest.skip(f"fused_layers.c does not build here: {conditioned_fused.unavailable()}")
    drafter = conditioned_for(target, block_size=10)
    if q8:
        drafter.compute_dtype = "q8"
    drafter.attach(target)
    ctx = torch.tensor(PROMPTS[1])
    torch.manual_seed(0)
    drafter.begin(ctx)
    drafter.observe(torch.randn(len(ctx) - 1, drafter.model.fc.in_features, dtype=torch.float64), 0)
    heads = []  # the head's products, as they run
    if q8:
        head = drafter._fused.head
        monkeypatch.setattr(drafter._fused, "head", lambda x: heads.append(head(x)) or heads[-1])
    else:
        real = conditioned.matmul
        monkeypatch.setattr(conditioned, "matmul",
                            lambda x, w: heads.append(real(x, w)) or heads[-1] if w is drafter._head_matrix else real(x, w))
    sampling = SamplingParams(temperature=1.0, seed=0) if sampled else SamplingParams()
    generator = torch.Generator().manual_seed(0) if sampled else None
    d = drafter.propose(ctx, FixedPolicy(2), 100, sampling, generator)
    assert [h.shape[0] for h in heads] == [2] and len(d) == 2
    heads.clear()
    d = drafter.propose(ctx, FailFastPolicy(tau=0.0, n=1, n_max=9), 100, sampling, generator)
    assert [h.shape[0] for h in heads] == [1, 1, 2, 4, 1] and len(d) == 9
    monkeypatch.undo()
    full = drafter.block_logits(ctx)
    drawn = torch.cat(heads)
    assert torch.equal(drawn, full) if q8 else torch.allclose(drawn, full, rtol=0, atol=1e-9)
    q = torch.softmax(full.float(), -1)
    if sampled:
        assert torch.allclose(d.probs.float(), q, atol=1e-6)
        assert torch.allclose(d.confidences, q[torch.arange(9), d.tokens], atol=1e-6)  # each token's own q
    else:
        assert d.tokens.tolist() == drafter.model.to_target_ids(full.argmax(-1)).tolist()
        assert torch.allclose(d.confidences, q.max(-1).values, atol=1e-6)
    heads.clear()  # a limit under the block: the head stops at it
    monkeypatch.setattr(drafter._fused if q8 else conditioned, "head" if q8 else "matmul",
                        (lambda x: heads.append(x.shape[0]) or head(x)) if q8 else
                        (lambda x, w: heads.append(x.shape[0]) or real(x, w) if w is drafter._head_matrix else real(x, w)))
    assert len(drafter.propose(ctx, FixedPolicy(13), 5, sampling, generator)) == 5 and heads == [5]


def test_out_of_order_tokens_are_judged_one_hot_the_rest_keep_q(target, tokenizer):
    """One step per sub-block, left to right: every token keeps its q. Multi-step unmasking out of order:
    the first token keeps its q, and a token unmasked before one on its left is judged with one-hot q
    (per position, denoising.keeps_q)."""
    v = len(tokenizer)
    ctx = torch.tensor(PROMPTS[1])
    sp = SamplingParams(temperature=1.0, seed=0)
    one_step = BlockDiffusionDrafter(dllm(v), BlockDiffusionConfig(mask_token_id=v, block_size=8, sub_block_size=4))
    one_step.attach(target)
    d = one_step.propose(ctx, FixedPolicy(8), 100, sp, torch.Generator().manual_seed(0))
    assert d.probs is not None and d.probs.shape == (8, v)
    multi = BlockDiffusionDrafter(dllm(v), BlockDiffusionConfig(mask_token_id=v, block_size=8, sub_block_size=8,
                                                               unmask_threshold=0.99))
    multi.attach(target)
    d = multi.propose(ctx, FixedPolicy(8), 100, sp, torch.Generator().manual_seed(0))
    assert d.probs is not None and len(d) == 8 and d.forward_passes >= 2
    one_hot = [bool(d.probs[i, d.tokens[i]] == 1.0) for i in range(len(d))]
    assert not one_hot[0] and any(one_hot), one_hot


# --- what the conditioned drafter computes in (compute_dtype) ------------------------------------
# The target stays float64 (exact verify/decode agreement); only the drafter is float32 or bf16.

def greedy_identical_drafted(engine, tiny_model) -> int:
    """Generate each of PROMPTS (30 tokens, no stop), assert it equals plain greedy; -> tokens drafted."""
    drafted = 0
    for prompt in PROMPTS:
        r = engine.generate(prompt, max_new_tokens=30, stop_token_ids=[])
        assert r.token_ids == reference_greedy(tiny_model, prompt, 30, stop_ids=())
        drafted += r.drafted_tokens
    return drafted


def no_q8(monkeypatch):
    """`auto` chooses between float32 and bfloat16 only (tests about those two, on any machine)."""
    monkeypatch.setattr(ConditionedDrafter, "_q8_unavailable", lambda self: "not this test's subject")


def float32_drafter(target):
    drafter = conditioned_for(target)
    drafter.model.to(torch.float32)
    return drafter


@pytest.mark.parametrize("policy", ["fixed4", "failfast-extend"])
def test_bfloat16_drafter_stays_lossless_and_leaves_the_target_alone(target, tiny_model, policy):
    head_before = tiny_model.lm_head.weight.detach().clone()
    drafter = float32_drafter(target)
    drafter.compute_dtype = "bfloat16"
    engine = SpeculativeEngine(target, drafter, POLICIES[policy]())
    assert next(drafter.model.parameters()).dtype == torch.bfloat16 and drafter._head_weight.dtype == torch.bfloat16
    assert tiny_model.lm_head.weight.dtype == torch.float64 and torch.equal(tiny_model.lm_head.weight, head_before)
    assert greedy_identical_drafted(engine, tiny_model) > 0 and "bfloat16" in drafter.describe()


@pytest.mark.parametrize("timings, chosen", [((10.0, 5.0), torch.bfloat16), ((10.0, 9.0), torch.float32)])
def test_auto_dtype_follows_the_measurement(target, tiny_model, monkeypatch, timings, chosen):
    drafter = float32_drafter(target)
    weights_before = {k: v.clone() for k, v in drafter.model.state_dict().items()}
    no_q8(monkeypatch)  # (with q8 as well: test_conditioned_q8.py)
    measured = iter(timings)  # float32 is timed first, then bfloat16
    monkeypatch.setattr(ConditionedDrafter, "_time_step", lambda self: next(measured))
    drafter.compute_dtype = "auto"
    engine = SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert next(drafter.model.parameters()).dtype == chosen
    assert drafter._head_weight.dtype == (torch.bfloat16 if chosen == torch.bfloat16 else torch.float64)
    assert f"{timings[0]:.1f}" in drafter.describe() and f"{timings[1]:.1f}" in drafter.describe()
    if chosen == torch.float32:  # the bf16 trial ran on a copy: weights bit for bit, the head still the target's
        assert all(torch.equal(v, weights_before[k]) for k, v in drafter.model.state_dict().items())
        assert drafter._head_weight.data_ptr() == drafter._target_head.data_ptr()
    r = engine.generate(PROMPTS[1], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(tiny_model, PROMPTS[1], 20, stop_ids=())


@pytest.mark.parametrize("timings, chosen", [((10.0, 5.0, 9.0), torch.bfloat16), ((10.0, 9.0, 20.0), torch.float32),
                                             ((10.0, 9.0, 5.0), "q8")])
def test_a_second_attach_keeps_the_auto_choice_head_and_all(target, tiny_model, monkeypatch, timings, chosen):
    """Every engine attaches its drafter, and the auto policy's calibration builds two engines before the real one:
    after the first attach chose bfloat16, a later one gave the drafter the target's head back in the target's
    dtype (the model stayed bfloat16), and on SmolLM2 each round's head product ran in float32 through torch:
    9-12 ms a round where the choice measured ~4, and the dtype note was lost. A later attach keeps the choice
    (no second timing), its note, and drafts as the first did."""
    if chosen == "q8" and conditioned_fused.unavailable() is not None:
        pytest.skip(f"fused_layers.c does not build here: {conditioned_fused.unavailable()}")
    drafter = float32_drafter(target)
    measured = iter(timings)  # one timing of each dtype: a second attach that timed again would stop here
    monkeypatch.setattr(ConditionedDrafter, "_time_step", lambda self: next(measured))
    drafter.compute_dtype = "auto"
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    head_dtype, note, model = drafter._head_weight.dtype, drafter.describe(), drafter.model
    context = torch.tensor(PROMPTS[1])
    drafter.begin(None)
    first = drafter.block_logits(context[:1])
    engine = SpeculativeEngine(target, drafter, FixedPolicy(4))  # attached again
    q8 = chosen == "q8"
    assert drafter.model is model and drafter.computes_q8 == q8
    assert next(drafter.model.parameters()).dtype == (torch.float32 if q8 else chosen)
    assert drafter._head_weight.dtype == head_dtype == {torch.bfloat16: torch.bfloat16, torch.float32: torch.float64,
                                                        "q8": torch.float32}[chosen]
    assert drafter.describe() == note and f"{timings[1]:.1f}" in note and f"{timings[2]:.1f}" in note
    drafter.begin(None)
    assert torch.equal(drafter.block_logits(context[:1]), first)
    r = engine.generate(PROMPTS[1], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(tiny_model, PROMPTS[1], 20, stop_ids=())


@pytest.mark.parametrize("compute_dtype", [None, "auto"])
def test_a_drafter_loaded_in_bfloat16_drafts_with_a_bfloat16_head(target, tiny_model, compute_dtype):
    """A drafter whose body came in bfloat16 (loaded so, or converted by its user) with no dtype of ours to choose:
    its head was the target's own, in the target's dtype, so every round's head product ran wide (on SmolLM2 in
    float32 through torch, the cost the second-attach bug had). It drafts with the head in its own dtype now,
    attach after attach, and stays lossless."""
    drafter = float32_drafter(target)
    drafter.model.to(torch.bfloat16)
    drafter.compute_dtype = compute_dtype
    for _ in range(2):
        engine = SpeculativeEngine(target, drafter, FixedPolicy(4))
        assert next(drafter.model.parameters()).dtype == torch.bfloat16 and drafter._head_weight.dtype == torch.bfloat16
    assert tiny_model.lm_head.weight.dtype == torch.float64
    r = engine.generate(PROMPTS[1], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(tiny_model, PROMPTS[1], 20, stop_ids=())


def test_a_model_converted_in_place_after_the_auto_choice_is_timed_again(target, monkeypatch):
    drafter = float32_drafter(target)
    no_q8(monkeypatch)
    measured = iter((10.0, 5.0, 10.0, 9.0))  # bf16 first, then (the model back in float32) float32
    monkeypatch.setattr(ConditionedDrafter, "_time_step", lambda self: next(measured))
    drafter.compute_dtype = "auto"
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert drafter._head_weight.dtype == torch.bfloat16
    drafter.model.float()  # in place: the same model object, another dtype
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert next(drafter.model.parameters()).dtype == torch.float32 and drafter._head_weight.dtype == torch.float64
    assert "float32: 10.0 ms" in drafter.describe()


def test_auto_dtype_really_times_a_draft_and_leaves_no_state(target, tiny_model):
    drafter = float32_drafter(target)
    drafter.compute_dtype = "auto"
    engine = SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert "ms a draft" in drafter.describe()
    assert drafter._context_len == 0  # the timing context is gone before the first request
    r = engine.generate(PROMPTS[0], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(tiny_model, PROMPTS[0], 20, stop_ids=())


def test_auto_dtype_keeps_float64(target):
    drafter = conditioned_for(target)
    drafter.compute_dtype = "auto"
    SpeculativeEngine(target, drafter, FixedPolicy(4))
    assert next(drafter.model.parameters()).dtype == torch.float64 and drafter.dtype_note == ""


def float32_block_drafter(tokenizer):
    body = dllm(len(tokenizer)).to(torch.float32)
    return BlockDiffusionDrafter(body, BlockDiffusionConfig(mask_token_id=len(tokenizer), block_size=8, sub_block_size=4))


@pytest.mark.parametrize("policy", ["fixed13", "failfast-extend"])
def test_bfloat16_block_drafter_stays_lossless(target, tiny_model, tokenizer, policy):
    drafter = float32_block_drafter(tokenizer)
    drafter.compute_dtype = "bfloat16"
    engine = SpeculativeEngine(target, drafter, POLICIES[policy]())
    assert next(drafter.model.parameters()).dtype == torch.bfloat16
    assert next(tiny_model.parameters()).dtype == torch.float64
    assert greedy_identical_drafted(engine, tiny_model) > 0 and "bfloat16" in drafter.describe()


@pytest.mark.parametrize("timings, chosen", [((10.0, 5.0), torch.bfloat16), ((10.0, 9.0), torch.float32)])
def test_block_drafter_auto_dtype_follows_the_measurement(target, tiny_model, tokenizer, monkeypatch, timings, chosen):
    drafter = float32_block_drafter(tokenizer)
    weights_before = {k: v.clone() for k, v in drafter.model.state_dict().items()}
    measured = iter(timings)  # float32 is timed first, then bfloat16
    monkeypatch.setattr(BlockDiffusionDrafter, "_time_step", lambda self: next(measured))
    drafter.compute_dtype = "auto"
    engine = SpeculativeEngine(target, drafter, FixedPolicy(5))
    assert next(drafter.model.parameters()).dtype == chosen
    assert f"{timings[0]:.1f}" in drafter.describe() and f"{timings[1]:.1f}" in drafter.describe()
    if chosen == torch.float32:  # the bf16 trial ran on a copy: the weights bit for bit
        assert all(torch.equal(v, weights_before[k]) for k, v in drafter.model.state_dict().items())
    r = engine.generate(PROMPTS[1], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(tiny_model, PROMPTS[1], 20, stop_ids=())


def test_block_drafter_keeps_float32_rotary_frequencies_in_bfloat16(target, tokenizer):
    drafter = float32_block_drafter(tokenizer)
    before = {n: b.clone() for n, b in drafter.model.named_buffers() if "inv_freq" in n}
    drafter.compute_dtype = "bfloat16"
    SpeculativeEngine(target, drafter, FixedPolicy(5))
    after = dict(drafter.model.named_buffers())
    assert before and next(drafter.model.parameters()).dtype == torch.bfloat16
    assert all(after[n].dtype == torch.float32 and torch.equal(after[n], b) for n, b in before.items())


def test_block_drafter_auto_dtype_keeps_float64_and_falls_back_when_bf16_fails(target, tokenizer, monkeypatch):
    drafter = BlockDiffusionDrafter(dllm(len(tokenizer)), BlockDiffusionConfig(mask_token_id=len(tokenizer), block_size=8,
                                                                               sub_block_size=4))
    drafter.compute_dtype = "auto"
    SpeculativeEngine(target, drafter, FixedPolicy(5))
    assert next(drafter.model.parameters()).dtype == torch.float64 and drafter.dtype_note == ""
    drafter = float32_block_drafter(tokenizer)
    calls = iter([lambda: 10.0, None])

    def time_step(self):
        step = next(calls)
        if step is None:
            raise RuntimeError("no bf16 kernel")
        return step()
    monkeypatch.setattr(BlockDiffusionDrafter, "_time_step", time_step)
    drafter.compute_dtype = "auto"
    SpeculativeEngine(target, drafter, FixedPolicy(5))
    assert next(drafter.model.parameters()).dtype == torch.float32 and "bfloat16 failed" in drafter.describe()


@pytest.mark.parametrize("draft_vocab", [True, False])
@pytest.mark.parametrize("bf16_wins", [True, False])
def test_block_drafter_auto_dtype_times_bfloat16_through_the_pass_of_the_model_it_times(tokenizer, monkeypatch,
                                                                                         bf16_wins, draft_vocab):
    """A target with measured kernels gives the drafter the direct pass (llama_pass.for_drafter), made at attach for
    the float32 model. The dtype trial converts a copy; its bfloat16 step ran through the float32 model's pass on a
    bfloat16 cache ('expected m1 and m2 to have the same dtype'), so `auto` always settled on float32 with "bfloat16
    failed" (seen on SmolLM2's block drafter on an AVX2 EPYC). The trial now times each model through its own pass,
    really running both steps, and the drafter keeps the pass of the model it drafts with (before, where bfloat16
    won, it drafted through the float32 original's modules)."""
    model = make_model(len(tokenizer), seed=0)  # tiny_model's weights: a target with measured kernels routes its
    target = Target(model, tokenizer, name="tiny", kernels="auto")  # layers, and tiny_model is shared by the session
    drafter = float32_block_drafter(tokenizer)
    if draft_vocab:  # its head applied by diffspec to the pass's hidden state, as SmolLM2's shipped block drafters
        drafter = BlockDiffusionDrafter(drafter.model, drafter.config, draft_token_ids=torch.arange(1, len(tokenizer), 2))
    real = BlockDiffusionDrafter._time_step

    def timed(self, *a, **k):
        real(self, *a, **k)  # the step really runs (the trial failed here)
        if next(self.model.parameters()).dtype == torch.bfloat16:
            return 5.0 if bf16_wins else 9.9
        return 10.0
    monkeypatch.setattr(BlockDiffusionDrafter, "_time_step", timed)
    drafter.compute_dtype = "auto"
    engine = SpeculativeEngine(target, drafter, FixedPolicy(5))
    assert drafter._direct is not None and drafter._direct.model is drafter.model
    note = drafter.describe()
    assert "failed" not in note and "10.0" in note and ("5.0" if bf16_wins else "9.9") in note
    assert next(drafter.model.parameters()).dtype == (torch.bfloat16 if bf16_wins else torch.float32)
    assert greedy_identical_drafted(engine, model) > 0


def test_a_draft_vocabulary_head_runs_the_measured_plan_as_the_body_does(tokenizer, monkeypatch):
    """The draft vocabulary's head rows ran through F.linear, which asks MKL for x @ W^T: on an AMD CPU 2-3x slower
    than mm(W, x^T) at 2-8 rows (SmolLM2's 8192 x 576 rows: 4.7-5.8 against 1.5-2.9 ms on Zen 1, a third of a
    denoising step), while the body's layers ran the measured plan. The rows are now a layer of their own, routed by
    the plan measured for their shape; the logits are the same product and the output stays the target's."""
    from diffspec import kernels
    from diffspec.packed_linear import linear_groups

    every = frozenset(kernels.ROW_BUCKETS)  # a plan that routes every shape through mm(W, x^T)
    monkeypatch.setattr(kernels, "plan_for_mode",
                        lambda model, mode, quiet=False: kernels.LinearPlan(mm_rows={s: every for s in linear_groups(model)}))
    ids = torch.arange(1, len(tokenizer), 2)
    drafter = BlockDiffusionDrafter(dllm(len(tokenizer)), BlockDiffusionConfig(mask_token_id=len(tokenizer), block_size=8,
                                                                               sub_block_size=4), draft_token_ids=ids)
    model = make_model(len(tokenizer), seed=0)  # tiny_model's weights, routed here by the patched plan: not the
    engine = SpeculativeEngine(Target(model, tokenizer, name="tiny", kernels="auto"), drafter, FixedPolicy(5))  # shared one
    real, head_calls = kernels.mm_linear, []

    def spy(x, weight, bias):
        head_calls.append(weight.shape[0] == ids.numel())
        return real(x, weight, bias)
    monkeypatch.setattr(kernels, "mm_linear", spy)
    assert greedy_identical_drafted(engine, model) > 0
    assert any(head_calls)  # the head's rows went through mm(W, x^T)
    assert "draft head routed" in drafter.cost_signature()  # draft costs cached before the routing are timed again
    weight, bias, linear = drafter._draft_head
    assert "forward" in linear.__dict__ and torch.equal(weight, drafter.model.lm_head.weight.detach()[ids])
    hidden = torch.randn(3, weight.shape[1], dtype=weight.dtype)
    assert torch.allclose(linear(hidden), torch.nn.functional.linear(hidden, weight), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("bf16_wins", [False, True])
def test_the_dtype_trial_times_each_dtype_with_the_kernels_it_would_draft_with(tokenizer, monkeypatch, bf16_wins):
    """The `auto` dtype trial timed the float32 step before the measured matmul plan (kernels.py) was installed:
    body and draft head through F.linear, which on an AMD CPU is 2-3x slower than the plan at a block's rows, while
    the bfloat16 candidate was timed through bf16_linear. So where the two dtypes are close it could keep bfloat16
    where the routed float32 body would win. Now each candidate is timed as it would draft: every linear layer of the
    model being timed routed for that model and dtype, the draft head's rows included."""
    from diffspec import kernels
    from diffspec.packed_linear import linear_groups

    every = frozenset(kernels.ROW_BUCKETS)  # a plan that routes every shape through mm(W, x^T)
    monkeypatch.setattr(kernels, "plan_for_mode",
                        lambda model, mode, quiet=False: kernels.LinearPlan(mm_rows={s: every for s in linear_groups(model)}))
    ids = torch.arange(1, len(tokenizer), 2)
    drafter = BlockDiffusionDrafter(dllm(len(tokenizer)).to(torch.float32), BlockDiffusionConfig(
        mask_token_id=len(tokenizer), block_size=8, sub_block_size=4), draft_token_ids=ids)
    real, timed_as = BlockDiffusionDrafter._time_step, []

    def timed(self, *a, **k):
        real(self, *a, **k)
        dtype = next(self.model.parameters()).dtype
        layers = [m for m in self.model.modules() if isinstance(m, torch.nn.Linear)]
        head = self._draft_head
        timed_as.append((dtype, all("forward" in m.__dict__ and m.forward.__self__ is m for m in layers),
                         head is not None and head[2] is not None and head[0].dtype == dtype))
        return (5.0 if bf16_wins else 9.9) if dtype == torch.bfloat16 else 10.0
    monkeypatch.setattr(BlockDiffusionDrafter, "_time_step", timed)
    drafter.compute_dtype = "auto"
    model = make_model(len(tokenizer), seed=0)  # tiny_model's weights, routed here by the patched plan
    engine = SpeculativeEngine(Target(model, tokenizer, name="tiny", kernels="auto"), drafter, FixedPolicy(5))
    assert [t[0] for t in timed_as] == [torch.float32, torch.bfloat16]
    assert timed_as == [(torch.float32, True, True), (torch.bfloat16, True, True)]  # each body and head routed
    kept = torch.bfloat16 if bf16_wins else torch.float32
    assert next(drafter.model.parameters()).dtype == kept and drafter._head_routed()
    assert greedy_identical_drafted(engine, model) > 0


def test_block_drafter_auto_dtype_really_times_a_step_and_leaves_no_state(target, tiny_model, tokenizer):
    drafter = float32_block_drafter(tokenizer)
    drafter.compute_dtype = "auto"
    engine = SpeculativeEngine(target, drafter, FixedPolicy(5))
    assert "ms a draft step" in drafter.describe()
    assert drafter._cached_ids == [] and drafter._cache.get_seq_length() == 0  # the timing context is gone
    r = engine.generate(PROMPTS[0], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(tiny_model, PROMPTS[0], 20, stop_ids=())


def test_drafter_dtype_errors(target):
    from diffspec import DiffspecError, load_engine
    from diffspec.drafter_names import make_drafter

    with pytest.raises(DiffspecError, match="applies to the conditioned and block-diffusion drafters"):
        make_drafter("prompt-lookup", target, compute_dtype="bfloat16")
    with pytest.raises(DiffspecError, match="applies to the conditioned and block-diffusion drafters"):
        make_drafter("none", target, compute_dtype="bfloat16")
    assert make_drafter("prompt-lookup", target, compute_dtype="auto") is not None
    with pytest.raises(DiffspecError, match="unknown drafter dtype 'fp8'.*auto"):
        make_drafter("conditioned", target, compute_dtype="fp8")
    with pytest.raises(DiffspecError, match="unknown drafter dtype 'fp8'"):  # before any model loads
        load_engine("/nonexistent/model", drafter_dtype="fp8")


@pytest.mark.parametrize("kind", ["block", "masked", "masked-unshifted", "conditioned", "ar"])
@pytest.mark.parametrize("policy", ["fixed4", "failfast-extend"])
def test_a_request_after_a_longer_one_drafts_as_in_a_fresh_engine(tiny_model, other_model, tokenizer, kind, policy):
    """State a drafter keeps across requests (caches, positions, windows) must not leak into the next: outputs
    cannot show it (the target verifies every token), so the rounds are compared: the same drafted and accepted
    counts, round for round, for a short request run after a longer one as in a fresh engine. (Prompt lookup's
    history across requests is an opt-in feature, and left out.)"""
    from diffspec import AutoregressiveDrafter

    def engine():
        t = Target(tiny_model, tokenizer)
        d = AutoregressiveDrafter(other_model, tokenizer) if kind == "ar" else make(kind, t, len(tokenizer))
        return SpeculativeEngine(t, d, POLICIES[policy]())

    used = engine()
    used.generate(list(range(11, 41)), max_new_tokens=30, stop_token_ids=[])
    after = used.generate([5, 6, 7], max_new_tokens=20, stop_token_ids=[])
    fresh = engine().generate([5, 6, 7], max_new_tokens=20, stop_token_ids=[])
    assert after.token_ids == fresh.token_ids == reference_greedy(tiny_model, [5, 6, 7], 20, stop_ids=())
    assert [(r.drafted, r.accepted) for r in after.rounds] == [(r.drafted, r.accepted) for r in fresh.rounds]
    assert after.drafted_tokens > 0


@pytest.mark.parametrize("kind", ["block", "masked", "masked-unshifted", "conditioned", "conditioned-q8", "ar"])
def test_after_rounds_without_drafting_each_draft_is_a_fresh_drafters_on_the_same_context(tiny_model, other_model,
                                                                                           tokenizer, kind):
    """A draft length of 0 (speculation off for a round) must not leave a drafter's state stale (a TensorRT-LLM bug:
    its next drafts came from an old context). Outputs cannot show it, so every draft of a request whose rounds
    alternate drafting and plain steps is compared with the draft a fresh drafter makes from the same context."""
    from diffspec import AutoregressiveDrafter

    from helpers import AlternatingPolicy

    def drafter(t):
        return AutoregressiveDrafter(other_model, tokenizer) if kind == "ar" else make(kind, t, len(tokenizer))

    target = Target(tiny_model, tokenizer)
    d = drafter(target)
    calls = []
    propose = d.propose

    def recording(context, policy, limit, sampling, generator=None):
        draft = propose(context, policy, limit, sampling, generator)
        calls.append((context.clone(), limit, draft.tokens.tolist()))
        return draft

    d.propose = recording
    out = SpeculativeEngine(target, d, AlternatingPolicy(3)).generate(list(range(11, 31)), max_new_tokens=24,
                                                                       stop_token_ids=[])
    assert out.token_ids == reference_greedy(tiny_model, list(range(11, 31)), 24, stop_ids=())
    assert len(calls) >= 4 and sum(r.drafted == 0 for r in out.rounds) >= 4  # drafting after plain steps
    fresh_target = Target(tiny_model, tokenizer)
    for context, limit, tokens in calls:
        fresh = drafter(fresh_target)
        fresh.attach(fresh_target)
        fresh.begin(context)
        if fresh.capabilities.needs_target_hidden_states:
            fresh_target.reset()
            fresh.observe(fresh_target.prefill(context[:-1], len(context) + 8, hidden_layers=fresh.target_layer_ids),
                          start=0)
        assert fresh.propose(context, FixedPolicy(3), limit, SamplingParams(), None).tokens.tolist() == tokens, len(context)


def test_a_conditioned_drafter_without_the_targets_features_refuses_to_draft(tiny_model, tokenizer):
    """Run without the target's hidden states (llama.cpp#26884: acceptance collapsed silently), the drafter says so
    instead of drafting from features it does not have; with them up to the anchor it drafts."""
    target = Target(tiny_model, tokenizer)
    d = make("conditioned", target, len(tokenizer))
    d.attach(target)
    context = torch.tensor(list(range(11, 25)))
    d.begin(context)
    with pytest.raises(RuntimeError, match="features for 0 positions, context needs 13: was the engine told"):
        d.propose(context, FixedPolicy(3), 10, SamplingParams(), None)
    d.observe(target.prefill(context[:-2], 20, hidden_layers=d.target_layer_ids), start=0)  # one position short
    with pytest.raises(RuntimeError, match="features for 12 positions, context needs 13"):
        d.propose(context, FixedPolicy(3), 10, SamplingParams(), None)
    target.reset()
    d.begin(context)
    d.observe(target.prefill(context[:-1], 20, hidden_layers=d.target_layer_ids), start=0)
    assert len(d.propose(context, FixedPolicy(3), 10, SamplingParams(), None).tokens) == 3


@pytest.mark.parametrize("kind", ["block", "masked", "conditioned", "ar"])
def test_a_drafters_q_follows_the_requests_sampling_settings(tiny_model, other_model, tokenizer, kind):
    """Rejection sampling is exact for any q, so the distribution tests cannot see a drafter that ignores the
    request's temperature or top-k (it would only be accepted less). Its q rows hold at most top_k tokens, and a
    lower temperature sharpens every row."""
    from diffspec import AutoregressiveDrafter

    t = Target(tiny_model, tokenizer)
    d = AutoregressiveDrafter(other_model, tokenizer) if kind == "ar" else make(kind, t, len(tokenizer))
    d.attach(t)
    ctx = torch.tensor(list(range(11, 25)))
    q = {}
    for name, params in {"T1": SamplingParams(1.0), "T0.3": SamplingParams(0.3), "k2": SamplingParams(1.0, top_k=2)}.items():
        d.begin(ctx)
        if kind == "conditioned":
            d.observe(Target(tiny_model).forward(ctx[:-1], hidden_layers=d.target_layer_ids).hidden_states, 0)
        draft = d.propose(ctx, FixedPolicy(3), 10, params, torch.Generator().manual_seed(0))
        assert draft.probs is not None and draft.probs.shape[0] == len(draft.tokens) == 3
        q[name] = draft.probs
    assert int((q["k2"] > 0).sum(-1).max()) <= 2
    assert int((q["T1"] > 0).sum(-1).min()) > 2
    assert bool((q["T0.3"].max(-1).values > q["T1"].max(-1).values).all())
