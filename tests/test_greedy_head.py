"""The screened greedy head (greedy_head.py): exactly the argmax of the head's dot products, whatever the
row count, from a bf16 product and a bound; wired into the target where the plan measured it faster."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from diffspec import greedy_head as G
from diffspec import kernels as K
from diffspec.engine import SpeculativeEngine
from diffspec.policies import make_policy
from diffspec.target import Target
from diffspec.types import SamplingParams

from conftest import make_model
from helpers import RandomDrafter, ScriptedDrafter


def near_ties(rows: int = 256, hidden: int = 96, vocab: int = 512, seed: int = 0):
    """Rows whose two best tokens are near-copies of one head row (3e-4 apart per weight): the bf16 product
    cannot tell them apart (its error is ~0.4% of a logit), the exact products can."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(vocab, hidden, generator=g) * 0.2
    w[1::2] = w[0::2] + torch.randn(vocab // 2, hidden, generator=g) * 3e-4  # token 2i+1 ~ token 2i
    w[5] *= 3.0  # one long row: row norms differ
    targets = torch.randint(0, vocab // 2, (rows,), generator=g) * 2
    h = w[targets] * 40 + torch.randn(rows, hidden, generator=g) * 0.5
    h[:, 7] *= 5.0  # an outlier dimension, as language models' hidden states have
    return h, w


def screen(h, w, slack=1.0):
    return G.screened_argmax(h, w, w.to(torch.bfloat16), w.norm(dim=-1), slack=slack)


def test_screened_argmax_is_the_exact_argmax_where_a_bf16_argmax_is_not():
    h, w = near_ties()
    exact = G.exact_argmax(h, w)
    assert torch.equal(screen(h, w), exact)
    # the case has power: with a bound 10x too small (or none: bf16's own argmax) rows go wrong
    assert not torch.equal(screen(h, w, slack=0.1), exact)
    assert not torch.equal(F.linear(h.bfloat16(), w.bfloat16()).float().argmax(-1), exact)


def test_screened_choices_do_not_depend_on_the_row_count():
    h, w = near_ties(rows=17, seed=1)
    whole = screen(h, w)
    one_by_one = torch.cat([screen(h[i:i + 1], w) for i in range(h.shape[0])])
    in_threes = torch.cat([screen(h[i:i + 3], w) for i in range(0, h.shape[0], 3)])
    assert torch.equal(whole, one_by_one) and torch.equal(whole, in_threes)


def test_flat_rows_are_narrowed_by_the_fp32_product_and_stay_exact(monkeypatch):
    h, w = near_ties(rows=64, seed=3)
    calls = []
    original = G.candidates
    monkeypatch.setattr(G, "candidates", lambda *a, **k: calls.append(a[3]) or original(*a, **k))
    monkeypatch.setattr(G, "MAX_CANDIDATES_PER_ROW", 0)  # every pass counts as flat
    assert torch.equal(screen(h, w), G.exact_argmax(h, w))
    assert calls == [G.row_bound_factors(96)[0], G.fp32_bound_factors(96)[0]]  # bf16, then fp32


def test_ties_take_the_lowest_token_id_as_argmax_does():
    w = torch.randn(64, 16)
    w[40] = w[9]  # two identical rows: an exact tie
    h = w[9:10] * 5
    assert int(screen(h, w)) == 9 == int(G.exact_argmax(h, w))


def test_rows_without_a_finite_bound_take_the_fp32_argmax():
    h, w = near_ties(rows=4)
    h[2, 0] = float("inf")
    got = screen(h, w)
    assert torch.equal(got, F.linear(h, w).argmax(-1))


def test_the_bound_holds_on_this_machine_and_a_tenth_of_it_would_not():
    h, w = near_ties(rows=32, seed=2)
    approx = F.linear(h.bfloat16(), w.bfloat16()).double()
    error = (approx - h.double() @ w.double().t()).abs()
    per_norm, per_value, absolute = G.row_bound_factors(w.shape[1])
    bound = (torch.outer(h.double().norm(dim=-1), w.double().norm(dim=-1)) * per_norm
             + approx.abs().amax(-1, keepdim=True) * per_value)
    assert bool((error <= bound + absolute).all())
    assert bool((error > bound / 10).any())  # the bound is not vacuous: the error reaches a tenth of it
    assert G.bound_holds(G.GreedyHead.of(torch.nn.Linear(96, 512, bias=False)))


def screened_everywhere(monkeypatch, one_row=True):
    """The plan screens every row bucket, as if measured faster, and bf16 counts as native (so the target's
    wiring is tested on every CPU kind; the screen's arithmetic is the same)."""
    buckets = frozenset(K.ROW_BUCKETS if one_row else K.ROW_BUCKETS[1:])
    monkeypatch.setattr(K, "cached_plan", lambda m, quiet=True: K.LinearPlan({}, {}, buckets))
    monkeypatch.setattr(G, "bf16_matmul_native", lambda: True)


def test_the_target_stops_before_the_head_and_reads_logits_only_when_asked(monkeypatch):
    screened_everywhere(monkeypatch)
    ids = torch.arange(4, 40)
    stock = Target(make_model(70, seed=5, dtype=torch.float32))
    target = Target(make_model(70, seed=5, dtype=torch.float32), kernels="auto")
    assert target.greedy_head is not None and target.runtime()["greedy_head"].startswith("screened")
    assert stock.greedy_head is None and "stock" in stock.runtime()["greedy_head"]
    off = Target(make_model(70, seed=5, dtype=torch.float32), kernels="auto", screen_greedy_head=False)
    assert off.greedy_head is None and off.runtime()["greedy_head"] == "fp32 logits (turned off)"
    assert target.fingerprint != off.fingerprint  # other costs: other cost tables
    assert off.forward(ids[:3])._logits is not None
    for t in (stock, target):
        t.forward(ids[:20], logits=False)
    for start, width in ((20, 1), (21, 4), (25, 9)):
        want, got = stock.forward(ids[start:start + width]), target.forward(ids[start:start + width])
        assert got._logits is None and got.final_hidden.shape == (width, 32)
        assert torch.equal(got.greedy_tokens(), G.exact_argmax(got.final_hidden, target.greedy_head.weight))
        assert torch.equal(got.greedy_tokens(), want.logits.argmax(-1))
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-6)  # computed when read
    assert target.forward(ids[30:34], logits=False).logits.shape == (1, 70)  # a prefill: as before


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_speculation_with_the_screened_head_equals_plain(monkeypatch, gamma):
    """Plain decoding (one-row steps) and verify passes of every width, all screened; and the same output
    as plain decoding through the fp32 logits."""
    prompt = list(range(5, 17))
    unscreened = SpeculativeEngine(Target(make_model(70, seed=3, dtype=torch.float32)), None)
    reference = unscreened.generate(prompt, max_new_tokens=40, stop_token_ids=[]).token_ids
    screened_everywhere(monkeypatch)
    target = Target(make_model(70, seed=3, dtype=torch.float32), kernels="auto")
    assert target.greedy_head is not None
    plain = SpeculativeEngine(target, None).generate(prompt, max_new_tokens=40, stop_token_ids=[]).token_ids
    assert plain == reference
    for drafter in (ScriptedDrafter(prompt + plain), RandomDrafter(70, seed=4)):
        engine = SpeculativeEngine(target, drafter, make_policy("fixed", gamma=gamma))
        assert engine.generate(prompt, max_new_tokens=40, stop_token_ids=[]).token_ids == plain


def test_sampling_reads_the_logits_of_a_screened_pass(monkeypatch):
    screened_everywhere(monkeypatch)
    prompt = list(range(5, 17))
    outs = []
    for kernels in ("stock", "auto"):
        target = Target(make_model(70, seed=3, dtype=torch.float32), kernels=kernels)
        engine = SpeculativeEngine(target, RandomDrafter(70, seed=4), make_policy("fixed", gamma=3))
        sampling = SamplingParams(temperature=0.8, seed=11)
        outs.append(engine.generate(prompt, 30, sampling, stop_token_ids=[]).token_ids)
    assert outs[0] == outs[1]  # the same seeded draws from the same probabilities


def test_models_the_screen_would_not_be_exact_for_are_not_screened(monkeypatch):
    screened_everywhere(monkeypatch)
    scaled = make_model(70, seed=5, dtype=torch.float32)
    scaled.register_forward_hook(lambda mod, args, out: setattr(out, "logits", out.logits * 2) or out)
    target = Target(scaled, kernels="auto")
    assert target.greedy_head is None
    assert "not its head applied to its last hidden state" in target.runtime()["greedy_head"]
    assert target.forward(torch.arange(4, 9)).logits.shape == (5, 70)
    doubles = Target(make_model(70, seed=5), kernels="auto")  # float64: no bf16 screen of it
    assert doubles.greedy_head is None and "float64" in doubles.greedy_head_note
    monkeypatch.setattr(G, "bf16_matmul_native", lambda: False)
    assert G.GreedyHead.for_model(make_model(70, dtype=torch.float32)) == (None, "this CPU has no native bf16 matmul")


def test_plan_json_keeps_the_head_rows_and_multi_row_drops_one_row():
    plan = K.LinearPlan({(8, 4): frozenset({2, 3})}, {}, frozenset({1, 3, 4, 16, 64}))
    again = K.LinearPlan.from_json(plan.to_json())
    assert again == plan and again.head_rows == {1, 3, 4, 16, 64}
    assert plan.multi_row_only().head_rows == {3, 4, 16, 64}
    # a row count takes the largest bucket at or below it; nothing past the last bucket
    rows = (1, 2, 3, 5, 15, 16, 20, 64, 65)
    assert [plan.screens_head(r) for r in rows] == [True, False, True, False, False, True, True, True, False]
    assert "greedy head screened" in plan.describe()
    with pytest.raises(ValueError):
        K.LinearPlan.from_json({**plan.to_json(), "head_rows": [7]})


def test_compiled_passes_stop_before_the_head_too(monkeypatch):
    """A compiled width that screens is traced without the head (logits_to_keep: none); its choices are the
    eager target's and its logits, read, match eager's to rounding."""
    torch._dynamo.reset()
    screened_everywhere(monkeypatch)
    ids = torch.arange(4, 40)
    eager = Target(make_model(70, seed=5, dtype=torch.float32), kernels="auto")
    comp = Target(make_model(70, seed=5, dtype=torch.float32), kernels="auto", compile="on")
    for t in (eager, comp):
        t.reserve(40)
        t.forward(ids[:20], logits=False)
    for start, width in ((20, 1), (21, 3), (24, 4)):
        assert comp.compiled.runs((width, True))
        want, got = (t.forward(ids[start:start + width]) for t in (eager, comp))
        assert got._logits is None and torch.equal(got.greedy_tokens(), want.greedy_tokens())
        torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=1e-5)


def test_verify_costs_are_timed_with_the_greedy_choices_read(monkeypatch):
    """A screened pass computes its choices after the pass: the cost table must time them, or the policy
    would see verify passes cheaper than the engine pays for them."""
    from diffspec.costs import measure_verify_costs
    from diffspec.target import TargetOutput

    screened_everywhere(monkeypatch)
    target = Target(make_model(70, seed=5, dtype=torch.float32), kernels="auto")
    read = []
    original = TargetOutput.greedy_tokens
    monkeypatch.setattr(TargetOutput, "greedy_tokens", lambda self: read.append(1) or original(self))
    measure_verify_costs(target, ks=(0, 1, 4), contexts=(8,), reps=2)
    assert len(read) == 3 * 2  # every timed pass


def test_a_row_left_without_candidates_takes_the_fp32_argmax(monkeypatch):
    """Only an overflowing product (inf - inf in the bounds) could leave a row without a candidate: the
    pass then falls back to the fp32 logits instead of answering an out-of-range token."""
    h, w = near_ties(rows=3)
    original = G.candidates

    def without_row_one(*args, **kwargs):
        rows, tokens = original(*args, **kwargs)
        return rows[rows != 1], tokens[rows != 1]

    monkeypatch.setattr(G, "candidates", without_row_one)
    assert torch.equal(screen(h, w), F.linear(h, w).argmax(-1))


def test_a_packed_head_is_never_screened_so_every_width_chooses_as_a_one_row_step(monkeypatch):
    """The packed kernel's logits are bitwise the same at every width, so their argmax is plain decoding's choice;
    the screen chooses the exact products' argmax, which differs from it where two tokens are closer than fp32's
    rounding (12 of 2,762 one-row steps of SmolLM2 had such a pair within the bound). A plan that would screen a
    width the head runs packed (cached before this rule, or measured) is cut back to the widths it does not."""
    from test_packed_linear import coded_model, every_bucket_packed

    model = coded_model()
    packed = every_bucket_packed(model)
    head = tuple(model.lm_head.weight.shape)
    some = dict(packed.packed_rows)
    some[head] = frozenset({1, 2, 3, 4})  # the head packed up to 4 rows; 8 and 48 run F.linear / mm
    screening = K.LinearPlan(packed_rows=some, head_rows=frozenset({2, 8, 48}))
    assert K.unscreened_where_packed(screening, model).head_rows == {8, 48}
    every = K.LinearPlan(packed_rows=packed.packed_rows, head_rows=frozenset({2, 8, 48}))
    assert K.unscreened_where_packed(every, model).head_rows == frozenset()
    monkeypatch.setattr(K, "cached_plan", lambda model, quiet=False: screening)
    assert K.plan_for_mode(model, "auto").head_rows == {8, 48}  # a cached plan passes through the rule
    assert K.plan_for_mode(model, "multi-row").head_rows == {8, 48}
