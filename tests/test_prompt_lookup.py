import pytest
import torch

from diffspec import FixedPolicy, PromptLookupDrafter, SamplingParams
from diffspec.errors import DiffspecError
from diffspec.drafters.prompt_lookup import NgramIndex, find_continuation


def t(xs):
    return torch.tensor(xs)


def test_longest_ngram_latest_match():
    # suffix [1, 2, 3]: the latest earlier 3-gram match starts at 4, continuation at 7
    assert find_continuation(t([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]), 3, 1) == (7, 3)


def test_falls_back_to_shorter_ngrams_and_no_match():
    assert find_continuation(t([4, 7, 5, 6, 7]), 3, 1) == (2, 1)
    assert find_continuation(t([4, 7, 5, 6, 7]), 3, 2) == (-1, 0)
    assert find_continuation(t([1, 2, 3, 4]), 3, 1) == (-1, 0)
    assert find_continuation(t([5]), 3, 1) == (-1, 0)


def test_the_incremental_index_finds_what_the_scan_finds():
    """As the context grows round by round (1-9 tokens), and when it is cut back or replaced (a new request, a
    context that does not extend the indexed one), NgramIndex.find equals find_continuation."""
    gen = torch.Generator().manual_seed(0)
    found = 0
    for max_n, min_n in ((3, 2), (3, 1), (4, 4), (1, 1)):
        index = NgramIndex(max_n, min_n)
        ctx = torch.randint(0, 6, (5,), generator=gen)
        for step in range(300):
            assert index.find(ctx) == find_continuation(ctx, max_n, min_n), (max_n, min_n, step, ctx.tolist())
            found += index.find(ctx)[0] >= 0
            event = int(torch.randint(0, 20, (1,), generator=gen))
            if event == 0:    # a new, unrelated context
                ctx = torch.randint(0, 6, (int(torch.randint(1, 12, (1,), generator=gen)),), generator=gen)
            elif event == 1:  # cut back
                ctx = ctx[: max(1, ctx.shape[0] // 2)]
            elif event == 2 and ctx.shape[0] > 3:  # same length, one earlier token changed
                ctx = ctx.clone()
                ctx[1] = (ctx[1] + 1) % 6
            else:
                ctx = torch.cat([ctx, torch.randint(0, 6, (int(torch.randint(1, 10, (1,), generator=gen)),), generator=gen)])
    assert found > 500  # matches were found and compared, not only misses (of 1,200 lookups)


def test_draft_copies_continuation_with_ngram_confidence():
    d = PromptLookupDrafter(max_ngram=3)
    draft = d.propose(t([1, 2, 3, 9, 8, 7, 1, 2, 3]), FixedPolicy(4), 100, SamplingParams(), None)
    assert draft.tokens.tolist() == [9, 8, 7, 1]
    assert draft.confidences.tolist() == [1.0] * 4 and draft.probs is None
    short = d.propose(t([1, 2, 3, 9, 8, 7, 1, 2, 3]), FixedPolicy(40), 100, SamplingParams(), None)
    assert short.tokens.tolist() == [9, 8, 7, 1, 2, 3]   # the context ends there
    weak = PromptLookupDrafter(max_ngram=3, min_ngram=1).propose(t([5, 6, 7, 5]), FixedPolicy(4), 100, SamplingParams(), None)
    assert weak.tokens.tolist() == [6, 7, 5] and abs(weak.confidences[0].item() - 1 / 3) < 1e-6


def test_confidence_learns_from_what_the_target_kept():
    d = PromptLookupDrafter(max_ngram=3, min_ngram=2)
    ctx = [1, 2, 3, 9, 8, 7, 6, 1, 2, 3]
    first = d.propose(t(ctx), FixedPolicy(4), 100, SamplingParams(), None)
    assert first.tokens.tolist() == [9, 8, 7, 6] and abs(first.confidences[0].item() - 1.0) < 1e-6  # prior 3/3
    # the target rejected the very first drafted token (emitted 5 instead of 9)
    rejected = d.propose(t(ctx + [5, 1, 2, 3]), FixedPolicy(4), 100, SamplingParams(), None)
    c_low = rejected.confidences[0].item()
    assert c_low < 0.7
    # now the target keeps all four drafted tokens plus a bonus token
    accepted_ctx = ctx + [5, 1, 2, 3] + rejected.tokens.tolist() + [4, 1, 2, 3]
    again = d.propose(t(accepted_ctx), FixedPolicy(4), 100, SamplingParams(), None)
    assert again.confidences[0].item() > c_low
    d.begin(None)  # a new request forgets
    assert abs(d.confidence(3) - 1.0) < 1e-6


def test_history_copies_from_earlier_requests_where_the_context_has_no_match():
    seen = t([1, 2, 3, 7, 8, 9, 10, 11, 12])
    for history in (0, 100):
        d = PromptLookupDrafter(history_tokens=history)
        d.begin(seen[:3])
        d.propose(seen, FixedPolicy(4), 100, SamplingParams(), None)
        d.begin(t([20, 21]))  # the request that ended goes to the history
        draft = d.propose(t([20, 21, 8, 9]), FixedPolicy(4), 100, SamplingParams(), None)
        assert draft.tokens.tolist() == ([10, 11, 12] if history else [])
        own = d.propose(t([20, 21, 8, 9, 5, 8, 9]), FixedPolicy(4), 100, SamplingParams(), None)
        assert own.tokens.tolist() == [5, 8, 9]  # the request's own match comes first
    # a history match starts at half the prior of a context match, and learns on its own
    assert d.confidence(("history", 2)) != d.confidence(2) and d.confidence(("history", 3)) == 0.5


def test_history_keeps_the_newest_tokens():
    d = PromptLookupDrafter(history_tokens=64)
    for r in range(40):  # each request: a unique 3-gram marker, then its answer
        d.begin(None)
        d.propose(t([1000 + r, 2000 + r, 3000 + r, r, r + 1]), FixedPolicy(1), 100, SamplingParams(), None)
    d.begin(None)
    assert len(d._history.ids) <= 64
    newest = d.propose(t([5, 1039, 2039, 3039]), FixedPolicy(2), 100, SamplingParams(), None)
    assert newest.tokens.tolist() == [39, 40]
    d.begin(None)
    oldest = d.propose(t([5, 1000, 2000, 3000]), FixedPolicy(2), 100, SamplingParams(), None)
    assert oldest.tokens.tolist() == []  # dropped
    with pytest.raises(DiffspecError, match="history_tokens"):
        PromptLookupDrafter(history_tokens=-1)
