"""Greedy equivalence: every drafter x policy reproduces the target's own greedy output exactly."""

import pytest
import torch
from transformers import GenerationConfig

from conftest import reference_greedy
from helpers import RandomDrafter, ScriptedDrafter
from diffspec import (AutoregressiveDrafter, FailFastPolicy, FixedPolicy, PromptLookupDrafter, SamplingParams,
                      SpeculativeEngine)

PROMPTS = [
    [5, 6, 7, 8, 5, 6, 7, 9, 10, 5, 6],          # repetitive: prompt lookup finds matches
    [11, 12, 13, 14, 15, 16, 17, 18, 19, 20],
    [30],                                        # one-token prompt: nothing to prefill
    [40, 41, 40, 41, 40, 41, 40, 41],
]
POLICIES = {
    "fixed1": lambda: FixedPolicy(1),
    "fixed4": lambda: FixedPolicy(4),
    "fixed16": lambda: FixedPolicy(16),
    "failfast": lambda: FailFastPolicy(),
    "failfast-small": lambda: FailFastPolicy(tau=0.2, n=3, n_max=9),
    "zero": lambda: FixedPolicy(0),               # a draft length of 0 must leave nothing stale
}


def drafters(tiny_model, other_model, tokenizer):
    v = len(tokenizer)
    return {
        "none": None,
        "prompt-lookup": PromptLookupDrafter(),
        "ar-other": AutoregressiveDrafter(other_model, tokenizer, name="ar:other"),
        "ar-self": AutoregressiveDrafter(tiny_model, tokenizer, name="ar:self"),
        "random": RandomDrafter(v, seed=0),
    }


@pytest.mark.parametrize("policy_name", list(POLICIES))
@pytest.mark.parametrize("drafter_name", ["none", "prompt-lookup", "ar-other", "ar-self", "random"])
def test_greedy_output_equals_target_greedy(target, tiny_model, other_model, tokenizer, drafter_name, policy_name):
    drafter = drafters(tiny_model, other_model, tokenizer)[drafter_name]
    engine = SpeculativeEngine(target, drafter, POLICIES[policy_name]())
    totals = [0, 0]
    for prompt in PROMPTS:  # one engine, several requests: state must not leak between them
        expected = reference_greedy(tiny_model, prompt, 40)
        result = engine.generate(prompt, max_new_tokens=40)
        assert result.token_ids == expected, (drafter_name, policy_name, prompt)
        assert sum(r.emitted for r in result.rounds) == len(result.token_ids)
        assert all(r.accepted <= r.drafted for r in result.rounds)
        totals[0] += result.drafted_tokens
        totals[1] += result.accepted_tokens
    if drafter_name != "none" and policy_name != "zero":
        assert totals[0] > 0, "the drafter never drafted: the test would prove nothing"


def test_equals_transformers_generate(target, tiny_model):
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FailFastPolicy())
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        cfg = GenerationConfig(max_new_tokens=30, do_sample=False, eos_token_id=2, pad_token_id=0)
        hf = tiny_model.generate(ids, generation_config=cfg)[0, len(prompt):].tolist()
        assert engine.generate(prompt, max_new_tokens=30).token_ids == hf


def test_target_as_its_own_drafter_accepts_everything(target, tiny_model, tokenizer):
    engine = SpeculativeEngine(target, AutoregressiveDrafter(tiny_model, tokenizer), FixedPolicy(5))
    result = engine.generate(PROMPTS[1], max_new_tokens=60, stop_token_ids=[])
    assert result.accepted_tokens == result.drafted_tokens > 0
    assert result.mean_accepted_length == pytest.approx(6.0)  # 5 drafted + the bonus, every round
    assert result.target_forward_passes == 1 + 10


def test_random_drafter_accepts_almost_nothing_and_changes_nothing(target, tiny_model, tokenizer):
    engine = SpeculativeEngine(target, RandomDrafter(len(tokenizer), seed=3), FixedPolicy(4))
    result = engine.generate(PROMPTS[1], max_new_tokens=60, stop_token_ids=[])
    assert result.token_ids == reference_greedy(tiny_model, PROMPTS[1], 60, stop_ids=())
    assert result.accepted_tokens / result.drafted_tokens < 0.15
    assert result.mean_accepted_length < 1.3


def test_failfast_drafts_long_when_confident_and_short_when_not(target, tiny_model):
    expected = reference_greedy(tiny_model, PROMPTS[1], 80, stop_ids=())
    full = PROMPTS[1] + expected
    confident = SpeculativeEngine(target, ScriptedDrafter(full, 0.9), FailFastPolicy())
    r = confident.generate(PROMPTS[1], max_new_tokens=80, stop_token_ids=[])
    assert r.token_ids == expected
    assert r.rounds[0].drafted == 60 and r.rounds[0].accepted == 60  # win big: N_max
    unsure = SpeculativeEngine(target, ScriptedDrafter(full, 0.3), FailFastPolicy())
    r = unsure.generate(PROMPTS[1], max_new_tokens=80, stop_token_ids=[])
    assert r.token_ids == expected
    assert max(x.drafted for x in r.rounds) == 10  # fail fast: never past the first window


def test_stop_token_ends_generation_and_is_included(target, tiny_model):
    free = reference_greedy(tiny_model, PROMPTS[1], 30, stop_ids=())
    stop = free[7]
    first = free.index(stop)
    engine = SpeculativeEngine(target, ScriptedDrafter(PROMPTS[1] + free, 1.0), FixedPolicy(16))
    r = engine.generate(PROMPTS[1], max_new_tokens=30, stop_token_ids=[stop])
    assert r.token_ids == free[: first + 1]  # a fully accepted block never runs past the stop token
    assert r.finish_reason == "stop"


@pytest.mark.parametrize("max_new", [1, 2, 7, 16, 17])
def test_max_new_tokens_is_exact_even_with_long_drafts(target, tiny_model, max_new):
    free = reference_greedy(tiny_model, PROMPTS[1], 40, stop_ids=())
    engine = SpeculativeEngine(target, ScriptedDrafter(PROMPTS[1] + free, 1.0), FixedPolicy(16))
    r = engine.generate(PROMPTS[1], max_new_tokens=max_new, stop_token_ids=[])
    assert r.token_ids == free[:max_new]
    assert r.finish_reason == "length"


def test_context_limit_caps_generation(tiny_model, tokenizer):
    from diffspec import Target
    target = Target(tiny_model, tokenizer, max_context=16)
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FixedPolicy(8))
    r = engine.generate(PROMPTS[1], max_new_tokens=50, stop_token_ids=[])
    assert len(r.token_ids) == 6 and r.finish_reason == "length"
    assert r.token_ids == reference_greedy(tiny_model, PROMPTS[1], 6, stop_ids=())


def test_stream_yields_the_final_text(target, tokenizer):
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FailFastPolicy())
    stream = engine.stream("w5 w6 w7 w5 w6", max_new_tokens=25)
    pieces = list(stream)
    assert len(pieces) >= 2
    assert "".join(pieces) == stream.result.text == target.decode(stream.result.token_ids)


def test_generate_decodes_its_text_once_and_gets_the_streams_text(target, monkeypatch):
    """generate reads no deltas, so it decodes once at the end, not every round; its text is the stream's."""
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FailFastPolicy())
    streamed = engine.stream("w5 w6 w7 w5 w6", max_new_tokens=25)
    streamed_text = "".join(streamed)
    calls = []
    decode = target.decode
    monkeypatch.setattr(target, "decode", lambda ids: calls.append(len(ids)) or decode(ids))
    r = engine.generate("w5 w6 w7 w5 w6", max_new_tokens=25)
    assert r.num_rounds >= 2 and calls == [len(r.token_ids)]
    assert r.text == streamed_text == streamed.result.text and r.token_ids == streamed.result.token_ids


def test_statistics_are_consistent(target):
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FailFastPolicy())
    r = engine.generate(PROMPTS[0], max_new_tokens=40, stop_token_ids=[])
    s = r.stats_dict()
    assert s["rounds"] == len(r.rounds) == s["target_forward_passes"] - 1
    assert s["mean_accepted_length"] == pytest.approx(len(r.token_ids) / len(r.rounds), abs=1e-3)
    assert s["mean_accepted_length"] == pytest.approx(1 + s["accepted_tokens"] / s["rounds"], abs=1e-3)
    assert r.wall_time_s >= r.draft_time_s + r.verify_time_s
    assert all(r_.draft_time_s >= 0 and r_.verify_time_s > 0 for r_ in r.rounds)


def test_ar_drafter_counts_its_forward_passes(target, other_model, tokenizer):
    engine = SpeculativeEngine(target, AutoregressiveDrafter(other_model, tokenizer), FixedPolicy(3))
    r = engine.generate(PROMPTS[1], max_new_tokens=20, stop_token_ids=[])
    assert r.drafter_forward_passes == r.drafted_tokens  # one pass per drafted token


def test_a_stop_token_cut_keeps_the_verdict_and_emits_only_the_output(target, tiny_model):
    """A perfect drafter's 16 tokens all accepted, then a stop token at the second cuts the output: the round emits
    2 tokens and keeps the verdict, 16 accepted (the drafter's record; what a policy learns from). A length limit
    never cuts accepted tokens: drafts are capped to the room left. Every round but a request's last keeps
    emitted == accepted + 1."""
    ref = reference_greedy(tiny_model, PROMPTS[1], 40, stop_ids=())
    assert ref[0] != ref[1]
    engine = SpeculativeEngine(target, ScriptedDrafter(list(PROMPTS[1]) + ref), FixedPolicy(16))
    r = engine.generate(PROMPTS[1], max_new_tokens=40, stop_token_ids=[ref[1]])
    assert r.token_ids == ref[:2] and r.finish_reason == "stop"
    assert [(x.drafted, x.accepted, x.emitted) for x in r.rounds] == [(16, 16, 2)]
    assert r.accepted_tokens == 16 and r.mean_accepted_length == 2.0
    r = engine.generate(PROMPTS[1], max_new_tokens=2, stop_token_ids=[])
    assert r.token_ids == ref[:2] and [(x.drafted, x.accepted, x.emitted) for x in r.rounds] == [(1, 1, 2)]
    r = engine.generate(PROMPTS[1], max_new_tokens=37, stop_token_ids=[])
    assert r.token_ids == ref[:37] and all(x.emitted == x.accepted + 1 for x in r.rounds)


@pytest.mark.parametrize("policy", ["fixed3", "alternating3", "fixed0"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_engine_feeds_a_hidden_state_drafter_exactly_the_positions_before_its_anchor(target, tiny_model,
                                                                                         tokenizer, policy, temperature):
    """Through the engine's rounds (rejections in every one: slot 2 is always wrong; plain steps between; draft
    length 0), a drafter reading the target's hidden states holds, at every proposal, exactly those of the positions
    before its anchor, in order, equal to a fresh pass's. Its output can be right with features off by one (the
    target verifies every token), so only this catches such a feed: one shifted by a position passed every other
    test."""
    from helpers import AlternatingPolicy
    from test_eval_drafter import HiddenRecorder

    drafter = HiddenRecorder(tiny_model, len(tokenizer))
    drafter.wrong_slot = 2
    pol = {"fixed3": FixedPolicy(3), "alternating3": AlternatingPolicy(3), "fixed0": FixedPolicy(0)}[policy]
    engine = SpeculativeEngine(target, drafter, pol)
    prompt = [5, 6, 7, 8]
    sampling = SamplingParams(temperature=temperature, seed=3) if temperature else None
    r = engine.generate(prompt, max_new_tokens=20, stop_token_ids=[], sampling=sampling)
    proposals = sum(1 for c in drafter.calls if c[0] == "propose")
    assert proposals >= (1 if policy == "fixed0" else 5)
    if not temperature:
        assert r.token_ids == reference_greedy(tiny_model, prompt, 20, stop_ids=())
