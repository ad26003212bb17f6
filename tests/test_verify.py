"""Acceptance rules as pure tensor functions: worked examples and a seeded statistical test."""

import numpy as np
import torch
from scipy.stats import chisquare

from diffspec.types import Draft
from diffspec.verify import verify_greedy, verify_rejection


def onehot(i, v=6):
    x = torch.zeros(v, dtype=torch.float64)
    x[i] = 1.0
    return x


def logits_for(argmaxes, v=6):
    return torch.stack([onehot(a, v) * 5.0 for a in argmaxes])


def test_greedy_accepts_matching_prefix_then_target_token():
    v = verify_greedy(torch.tensor([3, 1, 4]), logits_for([3, 1, 5, 2]))
    assert (v.num_accepted, v.next_token, v.is_bonus) == (2, 5, False)


def test_greedy_all_accepted_gives_bonus():
    v = verify_greedy(torch.tensor([3, 1]), logits_for([3, 1, 0]))
    assert (v.num_accepted, v.next_token, v.is_bonus) == (2, 0, True)


def test_greedy_first_token_wrong_accepts_nothing_even_if_later_match():
    v = verify_greedy(torch.tensor([2, 1]), logits_for([3, 1, 0]))
    assert (v.num_accepted, v.next_token) == (0, 3)


def test_greedy_empty_draft_is_plain_decoding():
    v = verify_greedy(torch.empty(0, dtype=torch.long), logits_for([4]))
    assert (v.num_accepted, v.next_token, v.is_bonus) == (0, 4, True)


def test_rejection_forced_argmax_accepts_and_rejects_deterministically():
    gen = torch.Generator().manual_seed(0)
    p = torch.stack([onehot(2), onehot(5), onehot(1)])
    for _ in range(50):
        v = verify_rejection(torch.tensor([2, 5]), None, p, gen)  # drafts agree with p's only token
        assert (v.num_accepted, v.next_token, v.is_bonus) == (2, 1, True)
        v = verify_rejection(torch.tensor([2, 4]), None, p, gen)  # second draft has p = 0
        assert (v.num_accepted, v.next_token, v.is_bonus) == (1, 5, False)


def test_rejection_q_equal_p_always_accepts():
    gen = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(4, 6, generator=gen, dtype=torch.float64), -1)
    for _ in range(200):
        drafts = torch.multinomial(p[:3], 1, generator=gen).squeeze(-1)
        assert verify_rejection(drafts, p[:3].clone(), p, gen).num_accepted == 3


def test_rejection_disjoint_supports_never_accepts_and_recovers_from_p():
    gen = torch.Generator().manual_seed(2)
    p = torch.tensor([[0.5, 0.5, 0, 0, 0, 0]] * 2, dtype=torch.float64)
    q = torch.tensor([[0, 0, 0.5, 0.5, 0, 0]], dtype=torch.float64)
    seen = set()
    for _ in range(200):
        v = verify_rejection(torch.tensor([2]), q, p, gen)
        assert v.num_accepted == 0 and v.next_token in (0, 1)
        seen.add(v.next_token)
    assert seen == {0, 1}


def _first_token_distribution_test(p, q, n, seed):
    gen = torch.Generator().manual_seed(seed)
    counts = np.zeros(p.shape[1])
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)[0]
    target = torch.stack([p[0], p[0]])
    for d in drafts.tolist():
        v = verify_rejection(torch.tensor([d]), q, target, gen)
        counts[d if v.num_accepted == 1 else v.next_token] += 1
    return chisquare(counts, p[0].numpy() * n).pvalue


def test_rejection_output_distribution_equals_target_statistically():
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(1, 8, generator=gen, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(1, 8, generator=gen, dtype=torch.float64) * 1.5, -1)
    assert _first_token_distribution_test(p, q, 20000, seed=4) > 1e-3


def test_the_statistical_test_detects_a_wrong_sampler():
    """Power check: accepting every draft (a classic bug) yields q, and the test must say so."""
    gen = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(1, 8, generator=gen, dtype=torch.float64) * 1.5, -1)
    q = torch.softmax(torch.randn(1, 8, generator=gen, dtype=torch.float64) * 1.5, -1)
    draws = torch.multinomial(q[0], 20000, replacement=True, generator=gen)
    counts = np.bincount(draws.numpy(), minlength=8)
    assert chisquare(counts, p[0].numpy() * 20000).pvalue < 1e-6


def test_a_draft_moves_to_the_targets_device_with_its_q_rows():
    """The engine moves each draft to the target's device before verifying (a drafter may build it on the
    CPU; a CUDA target's rows are on CUDA: a greedy round crashed there before). 'meta' stands in for a
    second device on a CPU-only machine."""
    draft = Draft(torch.tensor([3, 4]), torch.full((2, 5), 0.2), torch.tensor([0.9, 0.8]), 1, "x")
    assert draft.to("cpu") is draft
    moved = draft.to("meta")
    assert moved.tokens.device.type == "meta" and moved.probs.device.type == "meta"
    assert (moved.forward_passes, moved.source, moved.tokens.shape, moved.probs.shape) == (1, "x", (2,), (2, 5))
    assert Draft(torch.tensor([3]), None, torch.tensor([0.5])).to("meta").probs is None
