import pytest
import torch

from diffspec import FixedPolicy, PromptLookupDrafter, SamplingParams
from diffspec.errors import DiffspecError
from diffspec.drafters.prompt_lookup import NO_MATCH, NgramIndex, find_continuation, match_length


def t(xs):
    return torch.tensor(xs)


def test_longest_ngram_latest_match():
    # suffix [1, 2, 3]: two earlier 3-gram matches, neither reaching further back; the latest (start 4) wins
    assert find_continuation(t([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3]), 3, 1) == (7, 3, 3)


def test_the_match_reaching_furthest_back_wins_over_the_latest():
    """[7, 1, 2, 3] occurred before: that copy is in progress, the later [5, 1, 2, 3] only shares the 3-gram."""
    ctx = [7, 1, 2, 3, 9, 5, 1, 2, 3, 8, 4, 7, 1, 2, 3]
    assert find_continuation(t(ctx), 3, 2) == (4, 3, 4)  # continuation 9, not the latest's 8
    index = NgramIndex(3, 2)
    assert index.find(t(ctx)) == (4, 3, 4)
    # only the latest `candidates` occurrences are compared
    assert find_continuation(t(ctx), 3, 2, candidates=1) == (9, 3, 3)
    assert NgramIndex(3, 2, candidates=1).find(t(ctx)) == (9, 3, 3)
    # the length is followed back as far as max_match
    assert find_continuation(t(ctx), 3, 2, max_match=3) == (9, 3, 3)  # both 3 long: the latest
    long = list(range(100, 140)) + [1] + list(range(100, 140))
    assert find_continuation(t(long), 3, 2) == (40, 3, 40)
    assert find_continuation(t(long), 3, 2, max_match=16).length == 16
    assert match_length(long, 40, long, 3) == 40 and match_length(long, 40, long, 3, max_match=10) == 10


def test_falls_back_to_shorter_ngrams_and_no_match():
    assert find_continuation(t([4, 7, 5, 6, 7]), 3, 1) == (2, 1, 1)
    assert find_continuation(t([4, 7, 5, 6, 7]), 3, 2) == NO_MATCH == (-1, 0, 0)
    assert find_continuation(t([1, 2, 3, 4]), 3, 1) == NO_MATCH
    assert find_continuation(t([5]), 3, 1) == NO_MATCH


def test_the_incremental_index_finds_what_the_scan_finds():
    """As the context grows round by round (1-9 tokens), and when it is cut back or replaced (a new request, a
    context that does not extend the indexed one), NgramIndex.find equals find_continuation."""
    gen = torch.Generator().manual_seed(0)
    found = 0
    for max_n, min_n, max_match, candidates in ((3, 2, 64, 16), (3, 1, 5, 2), (4, 4, 64, 1), (1, 1, 8, 64)):
        index = NgramIndex(max_n, min_n, max_match, candidates)
        ctx = torch.randint(0, 6, (5,), generator=gen)
        for step in range(300):
            assert index.find(ctx) == find_continuation(ctx, max_n, min_n, max_match, candidates), \
                (max_n, min_n, step, ctx.tolist())
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


def test_draft_copies_continuation_with_match_length_confidence():
    d = PromptLookupDrafter(max_ngram=3)
    draft = d.propose(t([1, 2, 3, 9, 8, 7, 1, 2, 3]), FixedPolicy(4), 100, SamplingParams(), None)
    assert draft.tokens.tolist() == [9, 8, 7, 1]
    assert draft.confidences.tolist() == pytest.approx([3 / 5] * 4) and draft.probs is None  # a 3-token match
    short = d.propose(t([1, 2, 3, 9, 8, 7, 1, 2, 3]), FixedPolicy(40), 100, SamplingParams(), None)
    assert short.tokens.tolist() == [9, 8, 7, 1, 2, 3]   # the context ends there
    weak = PromptLookupDrafter(max_ngram=3, min_ngram=1).propose(t([5, 6, 7, 5]), FixedPolicy(4), 100, SamplingParams(), None)
    assert weak.tokens.tolist() == [6, 7, 5] and abs(weak.confidences[0].item() - 1 / 3) < 1e-6


def test_confidence_learns_from_what_the_target_kept():
    d = PromptLookupDrafter(max_ngram=3, min_ngram=2)
    ctx = [1, 2, 3, 9, 8, 7, 6, 1, 2, 3]
    first = d.propose(t(ctx), FixedPolicy(4), 100, SamplingParams(), None)
    assert first.tokens.tolist() == [9, 8, 7, 6] and abs(first.confidences[0].item() - 0.6) < 1e-6  # prior 3/5
    # the target rejected the very first drafted token (emitted 5 instead of 9)
    rejected = d.propose(t(ctx + [5, 1, 2, 3]), FixedPolicy(4), 100, SamplingParams(), None)
    c_low = rejected.confidences[0].item()
    assert c_low < 0.7
    # now the target keeps all four drafted tokens plus a bonus token
    accepted_ctx = ctx + [5, 1, 2, 3] + rejected.tokens.tolist() + [4, 1, 2, 3]
    again = d.propose(t(accepted_ctx), FixedPolicy(4), 100, SamplingParams(), None)
    assert again.confidences[0].item() > c_low
    d.begin(None)  # a new request forgets
    assert abs(d.confidence(3) - 0.6) < 1e-6


def test_a_longer_match_starts_with_a_higher_confidence_and_learns_apart():
    assert [PromptLookupDrafter.length_class(m) for m in (1, 2, 3, 4, 7, 8, 15, 16, 31, 32, 64, 500)] == \
        [1, 2, 3, 4, 4, 8, 8, 16, 16, 32, 32, 32]
    d = PromptLookupDrafter()
    story = list(range(100, 130))
    ctx = story + [7, 8] + story[:20]  # the answer is 20 tokens into a copy of the prompt
    long = d.propose(t(ctx), FixedPolicy(4), 100, SamplingParams(), None)
    assert long.tokens.tolist() == story[20:24]
    assert long.confidences[0].item() == pytest.approx(16 / 18)  # class 16: 20 tokens matched
    d.begin(None)
    short = d.propose(t(story + [7, 8, 101, 102]), FixedPolicy(4), 100, SamplingParams(), None)
    assert short.tokens.tolist() == story[3:7] and short.confidences[0].item() == pytest.approx(2 / 4)
    # a class's outcomes move only that class
    d._outcomes[2] = [0, 5]
    assert d.confidence(2) < 0.2 and d.confidence(16) == pytest.approx(16 / 18)
    for bad in (dict(max_match=2), dict(candidates=0), dict(candidates=True)):
        with pytest.raises(DiffspecError, match="max_match|candidates"):
            PromptLookupDrafter(**bad)


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
    assert d.confidence(("history", 2)) != d.confidence(2) and d.confidence(("history", 3)) == pytest.approx(0.3)


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


def test_match_length_by_slices_equals_the_token_by_token_walk():
    """The galloping slice comparison against the definition: how many tokens before source[end] equal the end of
    the query, capped, on random sequences over 2-4 symbols (long and tied matches)."""
    import random

    def walk(source, end, query, n, cap):
        length, q = n, len(query)
        while length < min(cap, end, q) and source[end - length - 1] == query[q - length - 1]:
            length += 1
        return length

    rng = random.Random(0)
    for _ in range(5000):
        symbols = rng.randint(1, 3)
        source = [rng.randint(0, symbols) for _ in range(rng.randint(1, 120))]
        query = source[: rng.randint(1, len(source))] if rng.random() < 0.5 else \
            [rng.randint(0, symbols) for _ in range(rng.randint(1, 120))]
        end, cap = rng.randint(0, len(source)), rng.choice([3, 5, 16, 64, 200])
        n = 0
        while n < min(end, len(query), 3) and source[end - n - 1] == query[len(query) - n - 1]:
            n += 1
        assert match_length(source, end, query, n, cap) == walk(source, end, query, n, cap)
