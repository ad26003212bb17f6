"""A repeated prompt keeps its prefill (Target.prefill): the next request on the same prompt starts at its first
round, from the state a new prefill would leave, bitwise; anything that would make a new prefill compute otherwise
(other tokens, other hidden states asked, changed weights or routing, a cache cut below the prompt or reset, a
sliding window that no longer holds the prompt) prefills anew. The bench times a prefill for every request."""

import copy

import pytest
import torch

from conftest import make_model, reference_greedy
from helpers import RandomDrafter
from diffspec import FixedPolicy, PromptLookupDrafter, SamplingParams, SpeculativeEngine, Target

V = 64
PROMPT = [5, 9, 13, 7, 22, 31, 8, 14, 40, 3, 17, 25, 5, 9, 13]


def prefill_kv(target: Target, upto: int):
    """The keys and values of every layer at the first `upto` positions (copies)."""
    cache = target._cache
    return [(layer.keys[..., :upto, :].clone(), layer.values[..., :upto, :].clone()) for layer in cache.layers]


@pytest.mark.parametrize("kernels", ["stock", "auto"])
def test_a_repeated_prompt_keeps_its_prefill_and_the_state_a_new_prefill_leaves(kernels):
    model = make_model(V, seed=3)
    target = Target(model, kernels=kernels)
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FixedPolicy(3))
    first = engine.generate(PROMPT, max_new_tokens=12, stop_token_ids=[])
    assert first.prefill_forward_passes == 1
    again = engine.generate(PROMPT, max_new_tokens=12, stop_token_ids=[])
    assert again.prefill_forward_passes == 0
    assert again.target_forward_passes == first.target_forward_passes - 1
    assert first.token_ids == again.token_ids == reference_greedy(model, PROMPT, 12, stop_ids=())
    # seeded sampling: the same seed gives the same sample from a kept prefill as from a new one
    sampled = [engine.generate(PROMPT, max_new_tokens=8, stop_token_ids=[],
                               sampling=SamplingParams(temperature=1.0, seed=7)) for _ in range(2)]
    kept = prefill_kv(target, len(PROMPT) - 1)
    target.reset()
    new = engine.generate(PROMPT, max_new_tokens=8, stop_token_ids=[], sampling=SamplingParams(temperature=1.0, seed=7))
    assert [r.prefill_forward_passes for r in sampled + [new]] == [0, 0, 1]
    assert sampled[0].token_ids == sampled[1].token_ids == new.token_ids
    fresh = Target(copy.deepcopy(model), kernels=kernels)
    fresh.prefill(torch.tensor(PROMPT[:-1]), 64)
    for (k, v), (fk, fv) in zip(kept, prefill_kv(fresh, len(PROMPT) - 1)):
        assert torch.equal(k, fk) and torch.equal(v, fv)  # bitwise what a new prefill computes


def test_anything_that_changes_what_a_prefill_computes_prefills_anew():
    model = make_model(V, seed=4)
    target = Target(model, kernels="auto")
    engine = SpeculativeEngine(target, RandomDrafter(V, seed=2), FixedPolicy(3))

    def passes(prompt=PROMPT, n=6):
        r = engine.generate(prompt, max_new_tokens=n, stop_token_ids=[])
        assert r.token_ids == reference_greedy(model, prompt, n, stop_ids=())
        return r.prefill_forward_passes

    assert passes() == 1 and passes() == 0
    assert passes(PROMPT[:-2]) == 1  # a shorter prompt (a prefix of the kept one): its own pass
    assert passes(PROMPT + [6]) == 1 and passes(PROMPT) == 1
    target.truncate(len(PROMPT) - 2)  # cut below the prompt by someone else: its positions will be written over
    target.forward(torch.tensor([60, 61, 62]))
    assert passes() == 1
    target.reset()
    assert passes() == 1
    with torch.no_grad():  # weights changed in place: kept keys and values would be another model's
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(-1.5)
            layer.self_attn.v_proj.weight.mul_(0.5)
    assert passes() == 1 and passes() == 0
    from diffspec.packed_linear import routing_changed

    routing_changed()  # a linear layer routed anew (a plan installed, q8, a drafter's bf16 copy)
    assert passes() == 1
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2 if threads == 1 else 1)  # other threads: other matmul splits
        assert passes() == 1
    finally:
        torch.set_num_threads(threads)


def test_a_prompt_that_gave_hidden_states_gives_them_again():
    """The conditioned drafter reads the prefill's hidden states: a kept prefill hands it the ones it computed;
    a kept prefill without them (a request without a reader) is no use to a request that reads them."""
    from test_engine_sampling import diffusion_drafter

    model = make_model(V, seed=5, std=0.6)
    target = Target(model, kernels="auto")
    reader = SpeculativeEngine(target, diffusion_drafter("conditioned", target), FixedPolicy(3))
    plain = SpeculativeEngine(target, None)
    seen = []
    observe = reader.drafter.observe
    reader.drafter.observe = lambda hidden, start: (seen.append((start, hidden.clone())), observe(hidden, start))[1]
    want = reference_greedy(model, PROMPT, 8, stop_ids=())
    runs = [(e, e.generate(PROMPT, max_new_tokens=8, stop_token_ids=[])) for e in (plain, reader, reader, plain)]
    assert [r.prefill_forward_passes for _, r in runs] == [1, 1, 0, 0]
    assert all(r.token_ids == want for _, r in runs)
    prefills = [h for start, h in seen if start == 0]
    assert len(prefills) == 2 and torch.equal(prefills[0], prefills[1])
    assert prefills[0].shape[0] == len(PROMPT) - 1


def test_a_sliding_window_that_no_longer_holds_the_prompt_prefills_anew():
    from test_sliding_window import make_gemma

    model = make_gemma(V)
    target = Target(model)
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FixedPolicy(3))
    prompt = PROMPT[:4]  # shorter than the window (6)
    short, long_ = (reference_greedy(model, prompt, n, stop_ids=()) for n in (2, 24))
    got = [engine.generate(prompt, max_new_tokens=n, stop_token_ids=[]) for n in (2, 2, 24, 24)]
    assert [r.token_ids for r in got] == [short, short, long_, long_]
    # two tokens past the prompt: the window still holds the prompt; 24: it moved past it
    assert [r.prefill_forward_passes for r in got] == [1, 0, 0, 1]
    # a prompt longer than the window: the prefill itself moved the window past its start
    got = [engine.generate(PROMPT, max_new_tokens=2, stop_token_ids=[]) for _ in range(2)]
    assert [r.prefill_forward_passes for r in got] == [1, 1]
    assert got[0].token_ids == got[1].token_ids == reference_greedy(model, PROMPT, 2, stop_ids=())


def test_a_fixed_capacity_cache_keeps_the_prefill_too():
    model = make_model(V, seed=6)
    target = Target(model, kernels="auto", fixed_cache=True)
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FixedPolicy(3))
    got = [engine.generate(PROMPT, max_new_tokens=10, stop_token_ids=[]) for _ in range(2)]
    assert [r.prefill_forward_passes for r in got] == [1, 0]
    assert got[0].token_ids == got[1].token_ids == reference_greedy(model, PROMPT, 10, stop_ids=())


def test_the_bench_times_a_prefill_for_every_request():
    """Methods share a target in the bench: a prefill kept from the method before would be free for the next."""
    from diffspec.bench.runners import EngineRunner

    target = Target(make_model(V, seed=7), kernels="auto")
    runners = [EngineRunner(SpeculativeEngine(target, None)),
               EngineRunner(SpeculativeEngine(target, PromptLookupDrafter(), FixedPolicy(2)))]
    outcomes = [r.run(PROMPT, 6, SamplingParams()) for r in runners + runners]
    assert outcomes[0].target_forward_passes == outcomes[2].target_forward_passes == 1 + 6
    assert outcomes[1].target_forward_passes == outcomes[3].target_forward_passes
    assert all(o.prefill_time_s > 0 for o in outcomes)


def test_a_pass_that_failed_midway_is_never_kept():
    """A pass that raises in its second layer leaves the first layer's cache a pass ahead of the second's: the same
    prompt again prefills anew (cutting both layers back by the first's excess would put the second below the
    prompt: a wrong answer, no error)."""
    model = make_model(V, seed=8)
    target = Target(model, kernels="auto")
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FixedPolicy(3))
    want = reference_greedy(model, PROMPT, 8, stop_ids=())
    assert engine.generate(PROMPT, max_new_tokens=8, stop_token_ids=[]).token_ids == want
    down = model.model.layers[1].self_attn.q_proj  # before the second layer writes its cache
    routed = down.__dict__.get("forward")

    def fail(x):
        raise RuntimeError("out of memory (simulated)")

    down.forward = fail
    try:
        with pytest.raises(RuntimeError, match="simulated"):
            engine.generate(PROMPT, max_new_tokens=8, stop_token_ids=[])  # its prefill kept, its first round fails
    finally:
        if routed is not None:
            down.forward = routed
        else:
            del down.forward
    assert len({layer.get_seq_length() for layer in target._cache.layers}) == 2  # the layers disagree
    again = engine.generate(PROMPT, max_new_tokens=8, stop_token_ids=[])
    assert again.prefill_forward_passes == 1 and again.token_ids == want


def test_a_fixed_capacity_cache_keeps_the_prefill_only_at_the_capacity_it_attended_over(monkeypatch):
    import diffspec.cache as dc

    monkeypatch.setattr(dc, "FIXED_CAPACITY_MIN", 16)  # 15 prompt tokens + 1 new fit 16 positions; + 10 need 32
    model = make_model(V, seed=9)
    target = Target(model, kernels="auto", fixed_cache=True)
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FixedPolicy(3))
    got = [engine.generate(PROMPT, max_new_tokens=n, stop_token_ids=[]) for n in (1, 10, 10, 1)]
    assert [r.prefill_forward_passes for r in got] == [1, 1, 0, 0]
    assert dc.fixed_cache_capacity(target._cache) == 32
    assert got[1].token_ids == got[2].token_ids == reference_greedy(model, PROMPT, 10, stop_ids=())


def test_kept_hidden_states_are_handed_out_as_copies_and_only_up_to_a_size(monkeypatch):
    import diffspec.target as dt

    model = make_model(V, seed=10)
    target = Target(model, kernels="auto")
    ids = torch.tensor(PROMPT[:-1])
    first = target.prefill(ids, 32, hidden_layers=(0, 1))
    want = first.clone()
    with torch.inference_mode():
        first.mul_(0)  # a drafter that scribbles on what it was handed
    kept = target.prefill(ids, 32, hidden_layers=(0, 1))
    assert target.forward_passes == 1 and torch.equal(kept, want)
    with torch.inference_mode():
        kept.mul_(0)  # and on what a kept prefill handed it
    assert torch.equal(target.prefill(ids, 32, hidden_layers=(0, 1)), want) and target.forward_passes == 1
    monkeypatch.setattr(dt, "KEPT_HIDDEN_BYTES", want.numel() * want.element_size() - 1)
    target.reset()
    target.prefill(ids, 32, hidden_layers=(0, 1))  # too large to keep: kept without them
    assert target.prefill(ids, 32) is None and target.forward_passes == 2
    assert torch.equal(target.prefill(ids, 32, hidden_layers=(0, 1)), want) and target.forward_passes == 3


def test_a_prefill_is_kept_only_if_the_arithmetic_held_through_its_own_pass():
    """A routing change during the prefill's pass (a packed model's first pass stacks its layers' packs and routes
    anew): the state is neither the old routing's nor the new one's throughout, so it is not kept."""
    from diffspec.packed_linear import routing_changed

    model = make_model(V, seed=11)
    target = Target(model, kernels="auto")
    q = model.model.layers[0].self_attn.q_proj
    routed = q.__dict__.get("forward")
    calls = []

    def first_call_routes_anew(x):
        if not calls:
            routing_changed()
        calls.append(1)
        return (routed or type(q).forward.__get__(q))(x)

    q.forward = first_call_routes_anew
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FixedPolicy(3))
    got = [engine.generate(PROMPT, max_new_tokens=6, stop_token_ids=[]) for _ in range(3)]
    assert [r.prefill_forward_passes for r in got] == [1, 1, 0]
    assert all(r.token_ids == reference_greedy(model, PROMPT, 6, stop_ids=()) for r in got)


def test_a_weight_viewed_anew_through_data_prefills_anew():
    """Same storage, same shape, same version counter (a `.data` assignment bumps none): another layout is another
    weight."""
    model = make_model(V, seed=12)
    target = Target(model, kernels="auto")
    engine = SpeculativeEngine(target, PromptLookupDrafter(), FixedPolicy(3))
    assert [engine.generate(PROMPT, max_new_tokens=4, stop_token_ids=[]).prefill_forward_passes
            for _ in range(2)] == [1, 0]
    square = model.model.layers[0].self_attn.o_proj.weight  # 32 x 32
    with torch.no_grad():
        square.data = square.data.t()  # the transpose: same storage, same shape, other strides
    r = engine.generate(PROMPT, max_new_tokens=4, stop_token_ids=[])
    assert r.prefill_forward_passes == 1 and r.token_ids == reference_greedy(model, PROMPT, 4, stop_ids=())


def test_a_fixed_capacity_grown_since_the_prefill_is_not_kept(monkeypatch):
    import diffspec.cache as dc

    monkeypatch.setattr(dc, "FIXED_CAPACITY_MIN", 16)
    target = Target(make_model(V, seed=13), kernels="auto", fixed_cache=True)
    ids = torch.tensor(PROMPT[:-1])
    target.prefill(ids, 16)
    target.reserve(40)  # grown (32 -> 64 positions) by someone else: a new prefill would attend over 64
    assert dc.fixed_cache_capacity(target._cache) == 64
    target.prefill(ids, 16)
    assert target.forward_passes == 2
    target.prefill(ids, 16)
    assert target.forward_passes == 2


@pytest.mark.parametrize("kernels", ["stock", "auto"])
def test_a_model_built_under_inference_mode_serves_and_keeps_its_prefill(kernels):
    """Weights made under torch.inference_mode() (a model built or loaded there) keep no in-place version: the
    weights' state key (packed_linear.module_state, and the packed kernels' weight_key) read it and every request
    failed ("Inference tensors do not track version counter"), the conditioned drafter's stacked weights too."""
    from test_diffusion_drafters import conditioned_for

    with torch.inference_mode():
        model = make_model(V, seed=3, dtype=torch.float32)
    target = Target(model, kernels=kernels)
    want = reference_greedy(model, PROMPT, 12, stop_ids=())
    for drafter in (PromptLookupDrafter(), None):
        target.reset()
        engine = SpeculativeEngine(target, drafter, FixedPolicy(3))
        runs = [engine.generate(PROMPT, max_new_tokens=12, stop_token_ids=[]) for _ in range(2)]
        assert [r.token_ids for r in runs] == [want, want]
        assert [r.prefill_forward_passes for r in runs] == [1, 0]
    with torch.inference_mode():
        drafter = conditioned_for(target)
    r = SpeculativeEngine(target, drafter, FixedPolicy(3)).generate(PROMPT, max_new_tokens=12, stop_token_ids=[])
    assert r.token_ids == want and r.drafter_forward_passes > 0
