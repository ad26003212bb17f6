"""Speculation-length rules as pure functions with worked examples."""

import pytest

from diffspec import DiffspecError, FailFastPolicy, FixedPolicy
from diffspec.drafters.base import DraftBuilder
from diffspec.policies import failfast_next_increment


def run(policy, confidences, limit=1000):
    """Drive the policy like a drafter does, with scripted confidences; return the draft length."""
    builder = DraftBuilder()
    for k in builder.increments(policy, limit):
        for _ in range(k):
            if len(builder) == len(confidences):
                return len(builder)
            builder.add(0, confidences[len(builder)])
    return len(builder)


def test_failfast_rule_worked_examples():
    assert failfast_next_increment([], 0.45, 10, 60) == 10
    assert failfast_next_increment([0.9] * 10, 0.45, 10, 60) == 10
    assert failfast_next_increment([0.9] * 9 + [0.44], 0.45, 10, 60) == 0
    assert failfast_next_increment([0.45] * 10, 0.45, 10, 60) == 10     # >= tau continues
    assert failfast_next_increment([0.9] * 60, 0.45, 10, 60) == 0       # N_max
    assert failfast_next_increment([0.9] * 55, 0.45, 10, 60) == 5       # never past N_max


@pytest.mark.parametrize("confidences, expected", [
    ([0.1] * 100, 10),                       # fail fast: the first window is always drafted
    ([0.9] * 100, 60),                       # win big: up to N_max
    ([0.9] * 15 + [0.2] + [0.9] * 84, 20),   # the window holding the low token is finished, then stop
    ([0.9] * 10 + [0.3] + [0.9] * 89, 20),
    ([0.9] * 29 + [0.44] + [0.9] * 70, 30),
    ([0.9] * 7, 7),                          # the drafter ran out
])
def test_failfast_stop_points(confidences, expected):
    assert run(FailFastPolicy(), confidences) == expected


def test_failfast_respects_limit_and_custom_parameters():
    assert run(FailFastPolicy(), [0.9] * 100, limit=25) == 25
    assert run(FailFastPolicy(tau=0.5, n=4, n_max=12), [0.9] * 100) == 12
    assert run(FailFastPolicy(tau=0.5, n=4, n_max=12), [0.9] * 5 + [0.4] + [0.9] * 20) == 8


def test_fixed_policy():
    assert run(FixedPolicy(5), [0.0] * 100) == 5
    assert run(FixedPolicy(5), [0.9] * 3) == 3
    assert run(FixedPolicy(0), [0.9] * 3) == 0
    assert run(FixedPolicy(8), [0.9] * 100, limit=2) == 2


@pytest.mark.parametrize("make", [lambda: FixedPolicy(-1), lambda: FailFastPolicy(tau=1.5),
                                  lambda: FailFastPolicy(n=0), lambda: FailFastPolicy(n=10, n_max=5)])
def test_invalid_policy_parameters(make):
    with pytest.raises(DiffspecError):
        make()


def test_policy_parameters_a_block_limited_drafter_makes_moot_are_said_once(target):
    """Issue 15: a conditioned drafter with block 8 drafts at most 7 tokens a round, so FailFast's
    window N=10 makes it fixed gamma=7 and gamma 16 is capped: the engine says so in each result
    (stats line, --json, bench Methods table) and stays silent where every parameter still acts."""
    import torch

    from diffspec import SpeculativeEngine
    from diffspec.drafters import ConditionedConfig, ConditionedDrafter, ConditionedDraftModel

    torch.manual_seed(0)
    drafter = ConditionedDrafter(ConditionedDraftModel(ConditionedConfig.for_target(
        target.model.config, mask_token_id=3, block_size=8, num_features=2)).to(torch.float64))
    assert drafter.max_tokens_per_round == 7
    cases = [(FailFastPolicy(), "FailFast drafts 7 every round"), (FixedPolicy(16), "gamma 16 drafts 7"),
             (FailFastPolicy(n=3, n_max=60), "N_max=60 acts as 7"), (FixedPolicy(7), None),
             (FailFastPolicy(n=3, n_max=6), None)]
    for policy, expected in cases:
        engine = SpeculativeEngine(target, drafter, policy)
        result = engine.generate([5, 6, 7, 8], max_new_tokens=6, stop_token_ids=[])
        if expected is None:
            assert engine.notes == () and result.stats_dict()["notes"] == []
        else:
            assert len(engine.notes) == 1 and expected in engine.notes[0]
            assert result.stats_dict()["notes"] == list(engine.notes)
        assert max(r.drafted for r in result.rounds) <= 7
    # drafters without a per-round cap never get a note
    from diffspec import PromptLookupDrafter

    assert SpeculativeEngine(target, PromptLookupDrafter(), FixedPolicy(60)).notes == ()
