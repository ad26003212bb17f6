"""The engine's own speed work (issue 19): the measured matmul formulation per row count
(kernels.py) and the position-indexed KV cache (cache.PositionalLayer). Both must leave every
output as it was: the same logits to rounding, greedy speculative output equal to plain, rollback
exact, plain decoding untouched."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import DynamicCache

from diffspec import kernels as K
from diffspec.greedy_head import bf16_matmul_native
from diffspec.cache import PositionalLayer, new_cache, reserve_cache, truncate_cache
from diffspec.engine import SpeculativeEngine
from diffspec.errors import DiffspecError
from diffspec.policies import make_policy
from diffspec.target import Target

from conftest import make_model
from helpers import RandomDrafter, ScriptedDrafter


def every_bucket(model, one_row: bool = False) -> K.LinearPlan:
    """A plan that routes every row count from 2 (or 1) up through mm(W, x^T), whatever the timings."""
    buckets = K.ROW_BUCKETS if one_row else K.ROW_BUCKETS[1:]
    return K.LinearPlan({shape: frozenset(buckets) for shape in K.linear_groups(model)})


@pytest.fixture()
def mm_calls(monkeypatch):
    """A list that grows by one each time a routed layer (or anyone) calls kernels.mm_linear."""
    calls, original = [], K.mm_linear
    monkeypatch.setattr(K, "mm_linear", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mm_formulation_computes_linear(dtype):
    torch.manual_seed(0)
    lin = torch.nn.Linear(24, 40, bias=True).to(dtype)
    for shape in ((3, 24), (1, 5, 24), (2, 3, 24), (1, 24), (1, 1, 24)):
        x = torch.randn(*shape, dtype=dtype)
        got, want = K.mm_linear(x, lin.weight, lin.bias), F.linear(x, lin.weight, lin.bias)
        assert got.shape == want.shape and got.is_contiguous()
        torch.testing.assert_close(got, want)
    x = torch.randn(4, 24, dtype=dtype)
    torch.testing.assert_close(K.mm_linear(x, lin.weight, None), F.linear(x, lin.weight))


def test_plan_buckets_json_and_validation():
    plan = K.LinearPlan({(8, 4): frozenset({2, 3, 4, 5, 6, 8})})
    assert [r for r in range(1, 70) if plan.uses_mm((8, 4), r)] == [2, 3, 4, 5, 6, 7, 8, 9]
    assert not plan.uses_mm((4, 8), 2)  # another shape: stock
    again = K.LinearPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and "8x4: rows 2,3,4,5,6,8" in again.describe()
    assert K.LinearPlan().describe() == "stock"
    one = K.LinearPlan({(8, 4): frozenset({1, 2, 3})})
    assert one.one_row and one.uses_mm((8, 4), 1) and not plan.one_row
    assert one.multi_row_only() == K.LinearPlan({(8, 4): frozenset({2, 3})})
    assert K.LinearPlan.from_json(json.loads(json.dumps(one.to_json()))) == one
    for bad in ({"format": 99, "mm_rows": []}, {"format": K.FORMAT, "mm_rows": [[8, 4, [0]]]},
                {"format": K.FORMAT, "mm_rows": [[8, 4, [7]]]}, [1]):
        with pytest.raises((ValueError, KeyError, TypeError)):
            K.LinearPlan.from_json(bad)
    with pytest.raises(DiffspecError, match="unknown --kernels 'fast'"):
        K.check_kernels("fast")


def test_measured_plan_covers_every_shape_and_is_cached(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFSPEC_COST_CACHE", str(tmp_path))
    model = make_model(70, dtype=torch.float32, hidden=64)
    plan = K.cached_plan(model, quiet=True)
    shapes = set(K.linear_groups(model))
    assert set(plan.mm_rows) == shapes and set(plan.timings_us) == {f"{n}x{k}" for n, k in shapes} | {"greedy_head"}
    head = plan.timings_us["greedy_head"]  # [planned fp32 head, screened] per bucket, where bf16 is native
    assert set(head) == (set(K.ROW_BUCKETS) if bf16_matmul_native() else set())
    assert plan.head_rows == {rows for rows, (full, screened) in head.items() if screened < K.MARGIN * full}
    for shape, rows in plan.mm_rows.items():
        timed = plan.timings_us[f"{shape[0]}x{shape[1]}"]
        assert 1 in timed  # one row is timed too, and decided on its own timing
        assert (1 in rows) == (timed[1][1] < K.MARGIN * timed[1][0])
        # from 2 rows, a prefix of the buckets: nothing is routed past a bucket where mm did not win
        multi = sorted(rows - {1})
        assert multi == list(K.ROW_BUCKETS[1:1 + len(multi)])
    assert len(list(tmp_path.glob("linear-plan-*.json"))) == 1
    monkeypatch.setattr(K, "measure_plan", lambda *a, **k: pytest.fail("measured twice"))
    assert K.cached_plan(model, quiet=True) == plan
    assert K.plan_for_mode(model, "auto") == plan and K.plan_for_mode(model, "stock") == K.LinearPlan()
    assert K.plan_for_mode(model, "multi-row") == plan.multi_row_only()


def test_loaders_starting_together_time_the_plan_once(monkeypatch, tmp_path):
    """Two loaders on an empty cost cache (the suite's two workers, a server beside a CLI run): one times the
    plan, the other waits for it and reads it (two timings at once would each slow the other, and the work is
    done twice). Threads open the lock file apart, so they exclude each other as two processes do."""
    import threading
    import time

    monkeypatch.setenv("DIFFSPEC_COST_CACHE", str(tmp_path))
    model = make_model(70, dtype=torch.float32, hidden=64)
    timed, measure = [], K.measure_plan

    def slow_measure(m, **settings):
        timed.append(1)
        time.sleep(0.5)  # both loaders are past their first read by then
        return measure(m, **settings)

    monkeypatch.setattr(K, "measure_plan", slow_measure)
    plans = []
    loaders = [threading.Thread(target=lambda: plans.append(K.cached_plan(model, quiet=True))) for _ in range(2)]
    for loader in loaders:
        loader.start()
    for loader in loaders:
        loader.join()
    assert len(timed) == 1 and len(plans) == 2 and plans[0] == plans[1]


def test_an_entry_whose_lock_cannot_be_taken_is_still_filled(tmp_path, monkeypatch):
    """Where no lock file can be made (here its folder would sit under a file) or the file system refuses locks,
    read_or_fill measures unlocked."""
    import fcntl

    from diffspec.output import read_or_fill

    (tmp_path / "a-file").write_text("")
    where = tmp_path / "a-file" / "entry.json"
    assert read_or_fill(where, lambda: None, lambda: 42) == (42, False)
    assert read_or_fill(where, lambda: 41, lambda: pytest.fail("filled though read")) == (41, True)

    def no_locks(handle, operation):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    assert read_or_fill(tmp_path / "entry.json", lambda: None, lambda: 43) == (43, False)


def test_routed_layers_give_the_same_logits_and_one_row_stays_stock(mm_calls):
    model = make_model(70, dtype=torch.float32)
    ids = torch.randint(0, 70, (1, 9), generator=torch.Generator().manual_seed(1))
    want = model(ids).logits
    K.install(model, every_bucket(model))
    try:
        got = model(ids).logits
        assert mm_calls, "the routed path was not taken"
        torch.testing.assert_close(got, want)
        mm_calls.clear()
        one = model(ids[:, :1]).logits
        assert not mm_calls and torch.equal(one, model.__class__.forward(model, ids[:, :1]).logits)
    finally:
        K.uninstall(model)
    assert all("forward" not in m.__dict__ for ms in K.linear_groups(model).values() for m in ms)


def test_one_row_routing_is_the_two_row_kernel_and_stock_kernels_undo_it(mm_calls):
    """auto's one-row formulation: the padded mm. Its logits are close to F.linear's and its rows equal
    those of 2- and 3-row passes bitwise (MKL's GEMM kernel computes each column alike there);
    `stock_kernels` runs F.linear inside the block and puts the routing back."""
    torch.manual_seed(0)
    for n, k in ((300, 64), (64, 200)):
        w, x = torch.randn(n, k), torch.randn(3, k)
        one = K.mm_linear(x[:1], w, None)
        torch.testing.assert_close(one, F.linear(x[:1], w))
        for rows in (2, 3):
            assert torch.equal(one[0], K.mm_linear(x[:rows], w, None)[0])
    model = make_model(70, dtype=torch.float32)
    ids = torch.randint(0, 70, (1, 1), generator=torch.Generator().manual_seed(1))
    stock = model(ids).logits
    K.install(model, every_bucket(model, one_row=True))
    try:
        mm_calls.clear()  # the direct calls above
        routed = model(ids).logits
        assert mm_calls, "the one-row routed path was not taken"
        torch.testing.assert_close(routed, stock)
        mm_calls.clear()
        with K.stock_kernels(model):
            assert torch.equal(model(ids).logits, stock) and not mm_calls
        model(ids)
        assert mm_calls, "the routing was not put back"
    finally:
        K.uninstall(model)


def test_kernel_modes_install_their_plans(monkeypatch):
    monkeypatch.setattr(K, "cached_plan", lambda m, quiet=True: every_bucket(m, one_row=True))
    auto = Target(make_model(70, dtype=torch.float32), kernels="auto")
    multi = Target(make_model(70, dtype=torch.float32), kernels="multi-row")
    stock = Target(make_model(70, dtype=torch.float32), kernels="stock")
    assert auto.linear_plan.one_row and not multi.linear_plan.one_row and multi.linear_plan.mm_rows
    assert stock.linear_plan == K.LinearPlan()
    assert len({auto.fingerprint, multi.fingerprint, stock.fingerprint}) == 3  # other kernels, other cost tables


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_speculation_with_routed_kernels_equals_plain(gamma):
    """Every verify width the routed formulation serves, accepted and rejected drafts alike."""
    tok_ids = list(range(5, 17))
    plain_target = Target(make_model(70, seed=3))
    plain = SpeculativeEngine(plain_target, None).generate(tok_ids, max_new_tokens=40, stop_token_ids=[]).token_ids
    routed = Target(make_model(70, seed=3))
    K.install(routed.model, every_bucket(routed.model, one_row=True))  # plain's own steps routed too
    assert SpeculativeEngine(routed, None).generate(tok_ids, max_new_tokens=40, stop_token_ids=[]).token_ids == plain
    for drafter in (ScriptedDrafter(tok_ids + plain), RandomDrafter(70, seed=4)):
        engine = SpeculativeEngine(routed, drafter, make_policy("fixed", gamma=gamma))
        assert engine.generate(tok_ids, max_new_tokens=40, stop_token_ids=[]).token_ids == plain


def test_target_fingerprint_changes_with_the_plan(monkeypatch):
    model = make_model(70, dtype=torch.float32)
    stock = Target(model).fingerprint
    monkeypatch.setattr(K, "cached_plan", lambda m, quiet=True: every_bucket(m))
    routed = Target(make_model(70, dtype=torch.float32), kernels="auto")
    assert routed.fingerprint != stock and routed.linear_plan == every_bucket(model)
    assert Target(make_model(70, dtype=torch.float32)).fingerprint == stock


def test_kernels_flag_refused_where_it_cannot_apply():
    from diffspec.backends import check_backend_settings

    pytest.importorskip("llama_cpp")
    with pytest.raises(DiffspecError, match="--kernels stock applies to the transformers backend"):
        check_backend_settings("llama.cpp", None, torch.float32, "cpu", "stock")
    proc = subprocess.run([sys.executable, "-m", "diffspec", "generate", "hi", "--kernels", "fast"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--kernels: invalid choice: 'fast'" in proc.stderr


# --- the position-indexed cache --------------------------------------------------------------
def test_positional_cache_rolls_back_and_grows_like_the_dynamic_one():
    """Passes of several widths with rollbacks between them, past the preallocated capacity: the
    logits equal those of transformers' concatenating cache."""
    model = make_model(70, seed=5)
    ids = torch.randint(0, 70, (80,), generator=torch.Generator().manual_seed(2))
    positional, dynamic = new_cache(model.config, capacity=4), DynamicCache(config=model.config)
    assert all(isinstance(layer, PositionalLayer) for layer in positional.layers)
    length = 0
    plan = [(7, 7), (3, 8), (5, 10), (1, 9), (12, 20), (2, 2), (30, 31), (4, 33)]  # (width, keep after)
    for width, keep in plan:
        outs = []
        for cache in (positional, dynamic):
            truncate_cache(cache, length)
            outs.append(model(ids[length:length + width][None], past_key_values=cache, use_cache=True).logits)
        assert torch.equal(outs[0], outs[1])
        assert positional.get_seq_length() == dynamic.get_seq_length() == length + width
        length = keep
    assert positional.layers[0].capacity >= 33 and positional.layers[0].keys.shape[-2] == 35


def test_reserve_preallocates_and_keeps_what_is_held():
    model = make_model(70, seed=6)
    cache = new_cache(model.config, capacity=2)
    ids = torch.arange(5, 11)[None]
    model(ids, past_key_values=cache, use_cache=True)
    held = cache.layers[0].keys.clone()
    reserve_cache(cache, 100)
    assert cache.layers[0].capacity == 100 and torch.equal(cache.layers[0].keys, held)
    buffer = cache.layers[0]._keys
    model(torch.arange(11, 60)[None], past_key_values=cache, use_cache=True)
    assert cache.layers[0]._keys is buffer  # no reallocation within the reserve
    with pytest.raises(ValueError, match="non-positive"):
        cache.layers[0].crop(3)


def test_positional_views_follow_the_length_whoever_moved_it():
    """keys/values are cut when read (the fused layers advance every layer's length in one C call and read none of
    them): after advance, crop, update, reserve and reset a read sees exactly positions [0, length); a view assigned
    directly (as some transformers helpers do) holds until the length next changes."""
    layer = PositionalLayer(capacity=4)
    assert layer.keys is None and layer.values is None  # before the first pass, as transformers' layers
    k = torch.arange(2 * 3 * 8, dtype=torch.float32).view(1, 2, 3, 8)
    layer.update(k, k + 0.5)
    assert layer.keys.shape[-2] == 3 and torch.equal(layer.values, k + 0.5)
    layer.reserve(10)  # written in place past the length by a caller, then recorded
    layer._keys[:, :, 3:5] = 7.0
    layer.advance(2)
    assert layer.keys.shape[-2] == 5 and torch.equal(layer.keys[:, :, 3:], torch.full((1, 2, 2, 8), 7.0))
    assert layer.keys.data_ptr() == layer._keys.data_ptr()  # a view of the buffer, no copy
    layer.crop(-4)
    assert layer.keys.shape[-2] == layer.values.shape[-2] == 1
    layer.keys = "assigned"
    assert layer.keys == "assigned"
    layer.advance(1)
    assert layer.keys.shape[-2] == 2
    layer.keys = layer.values = "assigned"  # rolled back, then a pass back to the same length: the buffer's view
    layer.crop(-1)
    layer.advance(1)
    assert layer.keys.shape[-2] == layer.values.shape[-2] == 2
    layer.keys = "assigned"
    layer.reset()
    layer.update(k[:, :, :2], k[:, :, :2])
    assert torch.equal(layer.keys, k[:, :, :2])
    layer.reset()
    assert layer.keys.shape[-2] == 0 and layer.get_seq_length() == 0


# --- only the logits that are read --------------------------------------------------------------
def test_logits_of_rows_equal_the_full_rows_with_and_without_logits_to_keep():
    from diffspec.drafters.denoising import logits_of_rows

    model = make_model(70, seed=7)
    ids = torch.randint(0, 70, (1, 12), generator=torch.Generator().manual_seed(3))
    full = model(input_ids=ids).logits[0]
    for rows in ([0], [3, 4, 9], list(range(12))):
        torch.testing.assert_close(logits_of_rows(model, rows, input_ids=ids), full[rows])
    torch.testing.assert_close(logits_of_rows(model, 1, input_ids=ids), full[-1:])

    class NoKeep(torch.nn.Module):  # a model whose forward has no logits_to_keep: all rows, then picked
        def forward(self, input_ids):
            return model(input_ids=input_ids)

    assert torch.equal(logits_of_rows(NoKeep(), [2, 5], input_ids=ids), model(input_ids=ids).logits[0][[2, 5]])

    class IgnoresKeep(torch.nn.Module):  # takes **kwargs, so it accepts logits_to_keep, but computes every row
        def forward(self, input_ids, **kwargs):
            return model(input_ids=input_ids)

    assert torch.equal(logits_of_rows(IgnoresKeep(), [2, 5], input_ids=ids), full[[2, 5]])
    assert torch.equal(logits_of_rows(IgnoresKeep(), 2, input_ids=ids), full[-2:])


@pytest.mark.parametrize("shift", [True, False])
def test_block_drafter_drafts_as_if_every_row_were_computed(shift, monkeypatch):
    """The block-diffusion drafter asks for the rows it reads (1 per commit, the masked ones per step);
    its drafts equal those drawn from full logits, and it runs no more passes."""
    from diffspec.drafters.block_diffusion import BlockDiffusionConfig, BlockDiffusionDrafter
    from diffspec.types import SamplingParams

    def drafts(all_rows: bool):
        torch.manual_seed(0)
        drafter = BlockDiffusionDrafter(make_model(71, seed=8), BlockDiffusionConfig(
            block_size=4, sub_block_size=2, mask_token_id=70, unmask_threshold=0.0, logit_shift=shift))
        target = Target(make_model(70, seed=9))
        engine = SpeculativeEngine(target, drafter, make_policy("fixed", gamma=5))
        if all_rows:
            def every_row(model, rows, **inputs):
                full = model(**inputs).logits[0]
                return full[-rows:] if isinstance(rows, int) else full[rows]
            monkeypatch.setattr("diffspec.drafters.block_diffusion.logits_of_rows", every_row)
        try:
            r = engine.generate(list(range(5, 15)), max_new_tokens=24, stop_token_ids=[], sampling=SamplingParams())
        finally:
            monkeypatch.undo()
        return r.token_ids, [(s.drafted, s.accepted) for s in r.rounds], sum(s.drafter_forward_passes for s in r.rounds)

    rows_read, every = drafts(False), drafts(True)
    assert rows_read[:2] == every[:2] and rows_read[2] <= every[2]


# --- incremental detokenisation -------------------------------------------------------------------
def _stream_text(tokenizer, ids, chunks, clean=True):
    from diffspec.engine import IncrementalText

    seen = []

    def decode(part):
        seen.append(len(part))
        return tokenizer.decode(list(part), skip_special_tokens=True)

    text, released, at = IncrementalText(decode), "", 0
    for n in chunks:
        at = min(len(ids), at + n)
        delta = text.advance(ids[:at], final=at == len(ids))
        assert not clean or "\ufffd" not in delta  # never half a character
        released += delta
    return released, max(seen)


@pytest.mark.slow
def test_incremental_text_equals_decoding_everything_on_the_real_tokenizer():
    """SmolLM2's byte-level BPE: accents, CJK, emoji split over byte tokens, code with spaces and
    newlines, in rounds of 1-7 tokens: the released text is the full decoding, and no call decodes
    more than twice the window and one round."""
    import random

    from diffspec.engine import IncrementalText
    from diffspec.models import gguf_file, gguf_text_side

    tok, _ = gguf_text_side(gguf_file(None), quiet=True)
    text = ("Café naïve — 東京は晴れ 🌤️🚀 def f(x):\n    return x  **  2  # ok\n\n\tEnd. " * 6)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    for _ in range(5):
        chunks = [rng.randint(1, 7) for _ in range(len(ids))]
        released, widest = _stream_text(tok, ids, chunks)
        assert released == tok.decode(ids, skip_special_tokens=True)
        assert widest <= 2 * IncrementalText.WINDOW + 7
    noise = [rng.randrange(tok.vocab_size) for _ in range(300)]  # broken byte sequences too
    released, _ = _stream_text(tok, noise, [3] * 100, clean=False)
    assert released == tok.decode(noise, skip_special_tokens=True)


def test_incremental_text_on_a_tokenizer_that_joins_with_spaces():
    from conftest import make_tokenizer

    tok = make_tokenizer()
    ids = tok("w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13", add_special_tokens=False)["input_ids"]
    for chunk in (1, 2, 5):
        released, widest = _stream_text(tok, ids, [chunk] * len(ids))
        assert released == tok.decode(ids, skip_special_tokens=True) == "w1 w2 w3 w4 w5 w6 w7 w8 w9 w10 w11 w12 w13"


def test_hf_generate_method_runs_transformers_own_kernels(mm_calls):
    """The bench's `hf-generate` is what users run today: F.linear, not the target's routed kernels,
    which stay installed for the engine's methods after it."""
    from diffspec.bench.runners import HFRunner
    from diffspec.types import SamplingParams

    target = Target(make_model(70, seed=3, dtype=torch.float32))
    assert HFRunner(target).same_model  # stock kernels: judged against plain
    target.linear_plan = every_bucket(target.model, one_row=True)
    K.install(target.model, target.linear_plan)
    assert not HFRunner(target).same_model  # plain's one-row steps run another kernel: compared, not judged
    outcome = HFRunner(target).run(list(range(5, 15)), 6, SamplingParams())
    assert len(outcome.token_ids) == 6 and not mm_calls
    target.forward(torch.tensor([5]))
    assert mm_calls, "the routing was not put back after hf-generate"


@pytest.fixture()
def sdpa_calls(monkeypatch):
    """(query rows, key/value heads, enable_gqa) of every scaled_dot_product_attention call."""
    calls, real = [], F.scaled_dot_product_attention

    def spy(query, key, value, *args, **kwargs):
        calls.append((query.shape[-2], key.shape[1], bool(kwargs.get("enable_gqa", False))))
        return real(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    return calls


def test_gqa_attention_shares_heads_in_the_kernel_and_equals_repeat_kv_bitwise(sdpa_calls):
    """attention.py: under --kernels auto a GQA model's passes of 2+ rows (verify passes: they carry a
    mask) hand the kernel the key/value heads as cached, no repeat_kv copy; their logits equal those
    of transformers' route bitwise, at every width, before and after a rollback. One-row eager steps
    keep transformers' own route (plain decoding untouched); stock kernels and hf-generate keep sdpa."""
    from diffspec import attention

    model = make_model(70, seed=5, dtype=torch.float32)
    assert attention.applies(model) and model.config.num_key_value_heads < model.config.num_attention_heads
    gqa = Target(model, kernels="auto")
    assert model.config._attn_implementation == attention.GQA_SDPA
    assert gqa.runtime()["attention"] == attention.GQA_SDPA
    ref = Target(make_model(70, seed=5, dtype=torch.float32))  # stock: transformers' sdpa
    assert ref.model.config._attn_implementation == "sdpa"
    fingerprint = gqa.base_fingerprint
    attention.uninstall(model)
    gqa._fingerprint = None
    assert gqa.base_fingerprint != fingerprint  # another attention kernel, other cost tables
    attention.install(model)
    gqa._fingerprint = None
    ids = torch.randint(3, 70, (60,), generator=torch.Generator().manual_seed(0))
    K.uninstall(gqa.model)  # linear layers as in ref: only the attention differs
    for t in (gqa, ref):
        t.reserve(60)
        t.forward(ids[:20], logits=False)
    for width in (2, 3, 5, 8, 1):
        sdpa_calls.clear()
        got, want = gqa.forward(ids[20:20 + width]).logits, ref.forward(ids[20:20 + width]).logits
        assert torch.equal(got, want), width
        layers = model.config.num_hidden_layers
        mine, theirs = sdpa_calls[:layers], sdpa_calls[layers:]
        if width > 1:
            assert all(kv == 2 and flag for _, kv, flag in mine), mine  # the cached heads, shared in the kernel
            assert all(kv == 4 and not flag for _, kv, flag in theirs), theirs  # transformers' repeat_kv copy
        else:
            assert [c[1:] for c in mine] == [c[1:] for c in theirs]  # one-row eager: transformers' own route
        for t in (gqa, ref):
            t.truncate(20 + width // 2)  # rollback, then the next pass from there
        ids = torch.cat((ids[:20 + width // 2], ids[20 + width // 2:].roll(1)))
    with K.stock_kernels(gqa.model):
        assert model.config._attn_implementation == "sdpa"
    assert model.config._attn_implementation == attention.GQA_SDPA
    Target(model, kernels="stock")  # stock: transformers' own, whatever ran the model before
    assert model.config._attn_implementation == "sdpa"


def test_gqa_attention_applies_only_to_grouped_heads_on_a_cpu():
    from transformers import LlamaConfig, LlamaForCausalLM

    from diffspec import attention

    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=4)
    plain_heads = LlamaForCausalLM(cfg).eval()
    assert not attention.applies(plain_heads)
    Target(plain_heads, kernels="auto")
    assert plain_heads.config._attn_implementation == "sdpa"
    grouped = make_model(50, dtype=torch.float32)
    grouped.config._attn_implementation = "eager"  # a user's choice of attention is left alone
    assert not attention.applies(grouped) and not attention.install(grouped)
    assert grouped.config._attn_implementation == "eager"


def test_gqa_attention_stays_with_the_target(monkeypatch):
    """A block drafter's body copied from a target's config gets transformers' sdpa back (the target's
    attention is an inference route, not the drafter's: its training runs transformers' own), and a
    config whose head counts cannot be read as one number is left alone instead of crashing."""
    from diffspec import attention
    from diffspec.training.block import make_block_body

    target = Target(make_model(70, dtype=torch.float32), kernels="auto")
    assert target.model.config._attn_implementation == attention.GQA_SDPA
    body = make_block_body(target.model, 1)
    body = body[0] if isinstance(body, tuple) else body
    assert body.config._attn_implementation == "sdpa"
    assert target.model.config._attn_implementation == attention.GQA_SDPA

    model = make_model(70, dtype=torch.float32)
    monkeypatch.setattr(type(model.config), "num_key_value_heads",
                        property(lambda self: (_ for _ in ()).throw(RuntimeError("per-layer"))), raising=False)
    assert not attention.applies(model)


def test_a_copy_of_a_routed_model_computes_with_its_own_weights():
    """The drafters' dtype trial times a deep copy of a model whose linear layers are routed (converted to
    bfloat16): the copy's layers must run on the copy's weights. With the routed forward a closure over
    the original module, the copy computed with the original's weights (and failed on a dtype mix)."""
    import copy

    model = make_model(50, seed=2)
    K.install(model, every_bucket(model, one_row=True))
    ids = torch.tensor([[5, 6, 7, 8]])
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    with torch.inference_mode():
        got = twin(ids).logits
        K.uninstall(twin)
        want = twin(ids).logits
    torch.testing.assert_close(got, want)
    halved = copy.deepcopy(model).to(torch.bfloat16)  # the trial's conversion: runs, in bfloat16
    with torch.inference_mode():
        assert halved(ids).logits.dtype == torch.bfloat16


def test_plan_reps_come_from_the_environment_and_bad_values_are_refused(monkeypatch):
    monkeypatch.delenv("DIFFSPEC_PLAN_REPS", raising=False)
    assert K.plan_reps() == 5
    monkeypatch.setenv("DIFFSPEC_PLAN_REPS", "2")
    assert K.plan_reps() == 2
    for bad in ("0", "-3", "two", ""):
        monkeypatch.setenv("DIFFSPEC_PLAN_REPS", bad)
        with pytest.raises(DiffspecError, match="DIFFSPEC_PLAN_REPS"):
            K.plan_reps()


def test_calibration_reps_come_from_the_environment_and_reach_the_timing(monkeypatch, target):
    """$DIFFSPEC_CALIBRATION_REPS: how many times a verify pass is timed (3 by default); bad values refused by name."""
    from diffspec import costs

    monkeypatch.delenv("DIFFSPEC_CALIBRATION_REPS", raising=False)
    assert costs.calibration_reps() == 3
    for bad in ("0", "-1", "one", ""):
        monkeypatch.setenv("DIFFSPEC_CALIBRATION_REPS", bad)
        with pytest.raises(DiffspecError, match="DIFFSPEC_CALIBRATION_REPS"):
            costs.calibration_reps()
    passes = []
    forward = target.forward
    monkeypatch.setattr(target, "forward", lambda ids, *a, **k: passes.append(len(ids)) or forward(ids, *a, **k))
    for reps in (1, 2):
        monkeypatch.setenv("DIFFSPEC_CALIBRATION_REPS", str(reps))
        passes.clear()
        table = costs.measure_verify_costs(target, ks=(0, 3), contexts=(8,))
        assert table.ks == (0, 3)
        assert passes.count(4) == reps and passes.count(1) == reps  # each k timed `reps` times (warm-ups are 2 rows)
