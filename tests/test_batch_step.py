"""make-data's direct decode step (training/batch_step.py): the model's logits, the same greedy answers, and the
graph protocol (static input buffers, one capture per shape, the fallback) checked on a CPU with an eager stand-in
for CUDA graphs; the graphs themselves on CUDA only."""

import random
import subprocess
import sys

import pytest
import torch
from conftest import make_model

from diffspec.errors import DiffspecError
from diffspec.training import batch_step
from diffspec.training import store as store_mod
from diffspec.training.store import BatchKVCache, generate_batch


def prompts_of(seed: int, n: int, vocab: int, longest: int = 24) -> list:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(1, longest))] for _ in range(n)]


def prefilled(model, prompts, capacity):
    """A left-padded batch prefilled through the model's forward, as generate_batch does -> (cache, mask, next
    positions, last tokens' logits)."""
    n, width = len(prompts), max(map(len, prompts))
    ids = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, capacity), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(p)
        mask[r, width - len(p): width] = 1
    device = next(model.parameters()).device
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    cache = BatchKVCache(model.config, n, capacity)
    out = model(input_ids=ids, attention_mask=mask[:, :width], position_ids=pos, past_key_values=cache, use_cache=True)
    cache.advance(width)
    return cache, mask, pos[:, -1] + 1, out.logits[:, -1]


def steps_beside_the_model(model, prompts, graphs: bool, tolerance, steps: int = 3):
    """`steps` decode steps of a left-padded batch through the model's forward and through a DecodeStep on a
    second cache, the same tokens fed to both; each step's logits must agree within tolerance(model's logits)
    -> (the model's cache, the step's cache, the step)."""
    cap = max(map(len, prompts)) + 8
    ref_cache, ref_mask, ref_pos, ref_logits = prefilled(model, prompts, cap)
    cache, mask, pos, _ = prefilled(model, prompts, cap)
    step = batch_step.DecodeStep(model, cache, graphs=graphs)
    for _ in range(steps):
        tok = ref_logits.argmax(-1)
        width = ref_cache.length
        ref_mask[:, width] = 1
        mask[:, width] = 1
        ref_logits = model(input_ids=tok.view(-1, 1), attention_mask=ref_mask[:, : width + 1],
                           position_ids=ref_pos.view(-1, 1), past_key_values=ref_cache, use_cache=True).logits[:, -1]
        logits = step.step(tok, pos, mask)
        assert torch.allclose(logits.float(), ref_logits.float(), atol=tolerance(ref_logits), rtol=0), \
            (logits - ref_logits).abs().max()
        for cache_, pos_ in ((ref_cache, ref_pos), (cache, pos)):
            cache_.advance(1)
            pos_ += 1
    return ref_cache, cache, step


def eager_record(run, pool=None):
    """CUDA graphs' protocol without CUDA: the output is one buffer, rewritten from the captured inputs by each
    replay; like a graph, the recorder never sees the caller's tensors, only the buffers `run` closes over."""
    out = run()

    def replay():
        out.copy_(run())
    return replay, out


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model(len(tokenizer), seed=0)  # float64


@pytest.mark.parametrize("graphs", [False, True])
@torch.inference_mode()
def test_the_direct_step_computes_the_models_logits(model, tokenizer, monkeypatch, graphs):
    """Three steps on a left-padded batch: the direct step's logits equal the model's forward's (float64), over
    the exact span and (the graph path, eager stand-in) over positions rounded up to SPAN, unwritten ones masked."""
    monkeypatch.setattr(batch_step, "record", eager_record)
    ref_cache, cache, step = steps_beside_the_model(model, prompts_of(3, 6, len(tokenizer)), graphs,
                                                    lambda ref: 1e-10)
    for a, b in zip(ref_cache.layers, cache.layers):  # the same keys and values written
        assert torch.allclose(a.keys[:, :, : cache.length], b.keys[:, :, : cache.length], atol=1e-12, rtol=0)
        assert torch.allclose(a.values[:, :, : cache.length], b.values[:, :, : cache.length], atol=1e-12, rtol=0)
    assert step.captured == (1 if graphs else 0)  # one shape: one capture, replayed three times


def test_direct_steps_give_the_model_forwards_answers(model, tokenizer):
    prompts = prompts_of(1, 10, len(tokenizer))
    want = generate_batch(model, prompts, 20, {2, 7}, 0, decode_step="model")
    assert min(map(len, want)) < 20 and max(map(len, want)) == 20  # rows stop mid-batch: the batch compacts
    assert generate_batch(model, prompts, 20, {2, 7}, 0, decode_step="direct") == want
    assert generate_batch(model, prompts, 20, {2, 7}, 0, decode_step="direct", prefill_tokens=30,
                          compact_share=0.0) == want


def test_graph_steps_capture_once_per_shape_and_give_the_same_answers(model, tokenizer, monkeypatch):
    """The graph path with the eager stand-in: inputs go through the captured buffers (a replay that read the
    caller's tensors, or reused a stale buffer, would answer otherwise), rows dropped as they stop (a new row
    count: a new capture), and spans crossing SPAN (another capture)."""
    graphs_on_cpu(monkeypatch)
    monkeypatch.setattr(batch_step, "SPAN", 8)
    made = []
    real_init = batch_step.DecodeStep.__init__

    def remembered(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        made.append(self)
    monkeypatch.setattr(batch_step.DecodeStep, "__init__", remembered)
    prompts = prompts_of(1, 10, len(tokenizer))
    want = generate_batch(model, prompts, 20, {2, 7}, 0, decode_step="model")
    got = generate_batch(model, prompts, 20, {2, 7}, 0, decode_step="graph", compact_share=0.0)
    assert got == want
    (step,) = made
    assert step.graphs and 2 < step.captured < 19, step.captured  # fewer captures than steps, more than one
    # sampling: the same tokens from the same generators
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(len(prompts))]  # noqa: E731
    assert (generate_batch(model, prompts, 12, {2}, 0, temperature=0.8, generator=gens(), decode_step="graph")
            == generate_batch(model, prompts, 12, {2}, 0, temperature=0.8, generator=gens(), decode_step="model"))


def graphs_on_cpu(monkeypatch, record=None):
    """`graph` accepted for a CPU model as for a CUDA one, captures through `record` (default: the eager
    stand-in), and no failure remembered from another test."""
    monkeypatch.setattr(batch_step, "record", record or eager_record)
    monkeypatch.setattr(batch_step, "_graph_failed", [])
    real_choose = batch_step.choose_kind
    monkeypatch.setattr(batch_step, "choose_kind", lambda kind, m: "graph" if kind == "graph" else real_choose(kind, m))


def graph_kind_on_cpu(monkeypatch):
    """Graph steps on a CPU: the eager stand-in for the graphs, and `graph` accepted as a CUDA model's would be
    -> the list of (rows, span) shapes captured."""
    graphs_on_cpu(monkeypatch)
    monkeypatch.setattr(batch_step, "SPAN", 8)
    shapes = []
    real_capture = batch_step.DecodeStep._capture

    def capture(self, tokens, positions, valid, at, span):
        shapes.append((int(tokens.shape[0]), span))
        return real_capture(self, tokens, positions, valid, at, span)
    monkeypatch.setattr(batch_step.DecodeStep, "_capture", capture)
    return shapes


def test_a_session_replays_the_graphs_of_earlier_batches_and_rows_go_in_powers_of_two(model, tokenizer, monkeypatch):
    """make-data's batches share one cache and its graphs (store.BatchSession): a later batch of the same shapes
    captures nothing, a new shape is captured once, and dropped rows leave power-of-two row counts."""
    shapes = graph_kind_on_cpu(monkeypatch)
    prompts = prompts_of(1, 10, len(tokenizer))
    want = generate_batch(model, prompts, 20, {2, 19}, 0, decode_step="model")
    assert sorted(map(len, want))[:4] == [3, 4, 6, 8]  # rows stop at several steps: the batch shrinks
    session = store_mod.BatchSession(model, 10, 24 + 20, "graph")
    assert generate_batch(model, prompts, 20, {2, 19}, 0, session=session) == want
    first = list(shapes)
    assert first and all(rows == 10 or rows & (rows - 1) == 0 for rows, _ in first), first  # 10, then 8, 4, ...
    assert any(rows < 10 for rows, _ in first)  # rows were dropped
    buffers = [layer.keys.data_ptr() for layer in session.cache.layers]
    assert generate_batch(model, prompts, 20, {2, 19}, 0, session=session) == want
    assert shapes == first  # the same shapes again: every graph replayed, none captured
    other = prompts_of(9, 6, len(tokenizer))
    assert (generate_batch(model, other, 20, {2, 19}, 0, session=session)
            == generate_batch(model, other, 20, {2, 19}, 0, decode_step="model"))
    assert [layer.keys.data_ptr() for layer in session.cache.layers] == buffers  # one cache throughout
    # sampling through a session: the same tokens from the same generators
    gens = lambda: [torch.Generator().manual_seed(i) for i in range(len(prompts))]  # noqa: E731
    assert (generate_batch(model, prompts, 12, {2}, 0, temperature=0.8, generator=gens(), session=session)
            == generate_batch(model, prompts, 12, {2}, 0, temperature=0.8, generator=gens(), decode_step="model"))
    bigger = prompts_of(3, 12, len(tokenizer))  # more rows than the session holds: a new cache, the same answers
    assert (generate_batch(model, bigger, 8, {2}, 0, session=session)
            == generate_batch(model, bigger, 8, {2}, 0, decode_step="model"))
    assert session.cache.state.allocated == 12


def test_make_data_runs_its_batches_through_one_session(tmp_path, monkeypatch, tokenizer):
    """build_store keeps one BatchSession for its batches (the graphs captured by the first are replayed)."""
    from diffspec import Target
    sessions = []
    real = store_mod.generate_batch

    def spy(*args, **kwargs):
        sessions.append(kwargs.get("session"))
        return real(*args, **kwargs)
    monkeypatch.setattr(store_mod, "generate_batch", spy)
    monkeypatch.setattr(store_mod, "evaluation_prompts", lambda: [])
    target = Target(make_model(len(tokenizer), seed=0, dtype=torch.float32), tokenizer, name="tiny")
    convs = [[{"role": "user", "content": " ".join(f"w{(i * 7 + j) % 50}" for j in range(3 + i % 4))}]
             for i in range(10)]
    store_mod.build_store(tmp_path / "s", target, convs, max_new_tokens=6, max_prompt_tokens=40, batch_size=4,
                          progress=False)
    assert len(sessions) == 3 and sessions[0] is not None and all(s is sessions[0] for s in sessions)


def test_a_graph_that_fails_to_capture_falls_back_to_the_model_with_a_warning(model, tokenizer, monkeypatch, capsys):
    def broken(run, pool=None):
        raise RuntimeError("operation not permitted when stream is capturing")
    graphs_on_cpu(monkeypatch, broken)
    prompts = prompts_of(2, 5, len(tokenizer))
    assert (generate_batch(model, prompts, 10, {2}, 0, decode_step="graph")
            == generate_batch(model, prompts, 10, {2}, 0, decode_step="model"))
    assert "CUDA-graph decode step failed (RuntimeError: operation not permitted" in capsys.readouterr().err
    assert batch_step._graph_failed  # `auto` asks for graphs no more in this process


def test_a_capture_that_fails_after_its_warm_up_wrote_the_cache_still_gives_the_models_answers(model, tokenizer,
                                                                                                monkeypatch):
    """The warm-up run before a capture writes this step's keys and values; a capture failing after it leaves
    them written, and the model's forward that takes over writes the same position again."""
    def fails_after_warm_up(run, pool=None):
        run()  # the warm-up: this step's keys and values written
        raise RuntimeError("capture failed after the warm-up")
    graphs_on_cpu(monkeypatch, fails_after_warm_up)
    prompts = prompts_of(6, 7, len(tokenizer))
    assert (generate_batch(model, prompts, 16, {2, 19}, 0, decode_step="graph")
            == generate_batch(model, prompts, 16, {2, 19}, 0, decode_step="model"))
    assert batch_step._graph_failed


def test_the_batch_probe_falls_back_too_and_later_graph_requests_get_the_model(model, monkeypatch, capsys):
    """make-data's batch probe captures the first graph: a capture that fails there falls back as generation
    does (it used to end make-data before its first batch), and `graph` is not asked for again."""
    def broken(run, pool=None):
        raise RuntimeError("capture failed")
    monkeypatch.setattr(batch_step, "record", broken)
    monkeypatch.setattr(batch_step, "_graph_failed", [])
    real_choose = batch_step.choose_kind

    def on_cpu_as_on_cuda(kind, m):  # a CPU model asked for graphs as a CUDA one would be
        if kind == "graph" and not batch_step._graph_failed:
            return "graph"
        return real_choose("model" if kind == "graph" else kind, m)
    monkeypatch.setattr(batch_step, "choose_kind", on_cpu_as_on_cuda)
    assert store_mod.decode_step_seconds(model, 4, 16, steps=2, decode_step="graph") > 0
    assert "CUDA-graph decode step failed (RuntimeError: capture failed)" in capsys.readouterr().err
    assert batch_step._graph_failed
    monkeypatch.setattr(batch_step, "choose_kind", real_choose)
    assert real_choose("graph", model) == "model"  # remembered (without it, `graph` on a CPU is refused)


def test_out_of_memory_in_a_graph_step_is_not_taken_for_a_failed_capture(model, tokenizer, monkeypatch):
    def oom(run, pool=None):
        raise torch.OutOfMemoryError("CUDA out of memory")
    graphs_on_cpu(monkeypatch, oom)
    with pytest.raises(torch.OutOfMemoryError):  # the batch probe's to catch: a smaller batch, not graphs off
        generate_batch(model, prompts_of(2, 3, len(tokenizer)), 5, {2}, 0, decode_step="graph")
    assert not batch_step._graph_failed


def test_compaction_keeps_the_buffers_a_graph_reads(model, tokenizer):
    """A graph reads each layer's keys/values through the addresses it was captured with: dropping finished rows
    must move rows within the same buffers, never allocate new ones."""
    cache, *_ = prefilled(model, prompts_of(4, 6, len(tokenizer)), 40)
    before = [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers]
    cache.keep_rows([1, 3, 4])
    assert [(layer.keys.data_ptr(), layer.values.data_ptr()) for layer in cache.layers] == before


def test_the_health_checks_answers_come_from_the_models_forward(target, monkeypatch):
    """Cached as the target's own answers: never from make-data's faster step (other rounding), on any device."""
    from diffspec.evaluation import target_continuations
    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("decode_step"))
        return [[7, 8, 2] for _ in args[1]]
    monkeypatch.setattr(store_mod, "generate_batch", spy)
    assert len(target_continuations(target, [[5, 6], [9, 10, 11]], 4)) == 2
    assert seen == ["model"]


def test_kinds_that_cannot_run_are_refused_by_name(model, tokenizer):
    assert batch_step.choose_kind("auto", model) == "model"  # a CPU model: transformers' forward
    with pytest.raises(DiffspecError, match="needs a CUDA model"):
        batch_step.choose_kind("graph", model)
    with pytest.raises(DiffspecError, match="must be one of"):
        batch_step.choose_kind("fast", model)
    biased = make_model(len(tokenizer), seed=0)
    biased.config.attention_bias = True
    with pytest.raises(DiffspecError, match="needs a Llama-architecture model"):
        batch_step.choose_kind("direct", biased)
    assert not batch_step.applies(biased) and batch_step.applies(model)
    with pytest.raises(DiffspecError, match="needs a Llama-architecture model"):
        generate_batch(biased, [[5, 6]], 3, {2}, 0, decode_step="direct")


def test_the_batch_probe_times_the_step_generation_runs(model, monkeypatch):
    calls = []
    real = batch_step.DecodeStep.step

    def counted(self, *args):
        calls.append(self)
        return real(self, *args)
    monkeypatch.setattr(batch_step.DecodeStep, "step", counted)
    assert store_mod.decode_step_seconds(model, 4, 16, steps=2, decode_step="direct") > 0
    assert len(calls) == 2
    assert store_mod.decode_step_seconds(model, 4, 16, steps=2, decode_step="model") > 0
    assert len(calls) == 2


@pytest.mark.parametrize("args, message", [
    (["--decode-step", "graph"], "--decode-step graph replays CUDA graphs: it needs --device cuda"),
    (["--source", "corpus", "--decode-step", "model"], "--decode-step set"),
])
def test_make_data_refuses_a_decode_step_that_cannot_run_before_loading(tmp_path, args, message):
    r = subprocess.run([sys.executable, "-m", "diffspec", "make-data", "--out", str(tmp_path / "s"), *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run by the GPU scripts on a lent GPU")
def test_cuda_graph_steps_give_the_model_forwards_answers(tokenizer):
    model = make_model(len(tokenizer), seed=0).cuda()
    prompts = prompts_of(1, 10, len(tokenizer))
    want = generate_batch(model, prompts, 20, {2, 19}, 0, decode_step="model")
    assert generate_batch(model, prompts, 20, {2, 19}, 0, decode_step="graph") == want
    assert generate_batch(model, prompts, 20, {2, 19}, 0) == want  # auto: graphs on CUDA
    # through a session (graphs replayed by a second batch), and past a span of 128 positions (new shapes)
    long_prompts = prompts_of(5, 6, len(tokenizer), longest=120)
    session = store_mod.BatchSession(model, 10, 256, "graph")
    for batch in (prompts, long_prompts, prompts):
        assert (generate_batch(model, batch, 60, {2, 19}, 0, session=session)
                == generate_batch(model, batch, 60, {2, 19}, 0, decode_step="model"))
    assert session.stepper is not None and session.stepper.graphs and session.stepper.captured > 1
    assert not batch_step._graph_failed


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: run by the GPU scripts on a lent GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_cuda_graph_step_logits_in_the_models_dtype(tokenizer, dtype):
    """The lease's target runs in float32, a user's may run in bf16: a replayed step's logits stay within the
    dtype's rounding of the model's forward."""
    model = make_model(len(tokenizer), seed=0, dtype=dtype).cuda()
    tolerance = (lambda ref: 1e-4) if dtype == torch.float32 else (lambda ref: 0.05 * float(ref.abs().max()))  # bf16 ulps
    _, _, step = steps_beside_the_model(model, prompts_of(3, 6, len(tokenizer)), True, tolerance)
    assert step.captured == 1


# --- the direct step's attention by fused_layers.c (float32 on a CPU) -------------------------------------------

def _attention_reference(q, keys, values, first, last, scale):
    """float64, each (row, head) alone: softmax(q . k * scale) . v over positions first[b] .. last."""
    B, H, hd = q.shape
    group = H // keys.shape[1]
    out = torch.empty(B, H, hd, dtype=torch.float64)
    for b in range(B):
        for j in range(H):
            k = keys[b, j // group, first[b]: last + 1].double()
            v = values[b, j // group, first[b]: last + 1].double()
            out[b, j] = torch.softmax(k @ q[b, j].double() * scale, -1) @ v
    return out


@pytest.mark.parametrize("isa", ["native", "avx2", "scalar"])
@pytest.mark.parametrize("head_dim", [64, 12])
def test_c_attention_reads_each_rows_positions_and_shared_heads(isa, head_dim):
    """Rows reading different first positions, three query heads per key/value head, head widths of whole vectors
    (64) and not (12), on every build: within float32 rounding of a float64 reference; a position outside a row's
    run changes nothing, one inside it does (a kernel reading the wrong rows, heads or positions fails)."""
    from diffspec import fused_layers
    from diffspec.packed_linear import NATIVE
    if isa == "avx2" and "avx2" not in open("/proc/cpuinfo").read():
        pytest.skip("this CPU has no AVX2")
    flags = {"native": NATIVE, "avx2": ("-mavx2", "-mfma"), "scalar": ()}[isa]
    if not fused_layers.available(flags):
        pytest.skip(f"fused_layers.c does not build here ({isa})")
    g = torch.Generator().manual_seed(head_dim)
    B, H, KV, cap, last = 5, 6, 2, 40, 30
    q = torch.randn(B, H, head_dim, generator=g)
    keys, values = torch.randn(B, KV, cap, head_dim, generator=g), torch.randn(B, KV, cap, head_dim, generator=g)
    first = torch.tensor([0, 3, 30, 17, 9])
    out = fused_layers.batch_attend(q, keys, values, first, last, 0.3, isa_flags=flags)
    ref = _attention_reference(q, keys, values, first, last, 0.3)
    assert out is not None and torch.allclose(out.double(), ref, atol=2e-6, rtol=0), (out.double() - ref).abs().max()
    keys[1, 0, 2] += 100.0     # row 1 reads from position 3: position 2 is its padding
    values[2, 1, last + 1] += 100.0  # past the last position
    assert torch.equal(fused_layers.batch_attend(q, keys, values, first, last, 0.3, isa_flags=flags), out)
    keys[1, 0, 3] += 1.0       # inside row 1's run: heads 0-2 of row 1 change, nothing else
    moved = fused_layers.batch_attend(q, keys, values, first, last, 0.3, isa_flags=flags) != out
    assert moved[1, :3].any(dim=-1).all() and not moved[1, 3:].any() and not moved[[0, 2, 3, 4]].any()


def test_c_attention_refuses_what_it_cannot_read():
    from diffspec import fused_layers
    if not fused_layers.available():
        pytest.skip("fused_layers.c does not build here")
    q, kv = torch.randn(2, 4, 8), torch.randn(2, 2, 10, 8)
    assert fused_layers.batch_attend(q, kv, kv, torch.tensor([0, 2]), 9, 1.0) is not None
    assert fused_layers.batch_attend(q.double(), kv.double(), kv.double(), torch.tensor([0, 2]), 9, 1.0) is None
    assert fused_layers.batch_attend(q, kv, kv, torch.tensor([0, 2]), 10, 1.0) is None   # past the capacity
    assert fused_layers.batch_attend(q, kv, kv, torch.tensor([0, 10]), 9, 1.0) is None   # a row reading nothing
    assert fused_layers.batch_attend(q, kv[:, :, :, :4], kv[:, :, :, :4], torch.tensor([0, 2]), 9, 1.0) is None


def test_first_read_takes_left_padding_only():
    valid = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 1]], dtype=torch.bool)
    assert batch_step._first_read(valid).tolist() == [2, 0, 4]
    holed = valid.clone()
    holed[1, 2] = False        # a hole: not one run, the matmuls take the mask
    assert batch_step._first_read(holed) is None
    unread_last = valid.clone()
    unread_last[0, 4] = False
    assert batch_step._first_read(unread_last) is None


@pytest.fixture(scope="module")
def model32(tokenizer):
    return make_model(len(tokenizer), seed=0, dtype=torch.float32)


@torch.inference_mode()
def test_the_direct_step_in_float32_attends_in_c_and_keeps_the_models_logits(model32, tokenizer, monkeypatch):
    from diffspec import fused_layers
    if not fused_layers.available():
        pytest.skip("fused_layers.c does not build here")
    calls = []
    real = fused_layers.batch_attend
    monkeypatch.setattr(fused_layers, "batch_attend", lambda *a, **k: calls.append(1) or real(*a, **k))
    ref_cache, cache, step = steps_beside_the_model(model32, prompts_of(3, 6, len(tokenizer)), False,
                                                    lambda ref: 2e-5 * float(ref.abs().max()))
    assert step.c_attention and len(calls) == 3 * len(model32.model.layers)  # every layer of every step
    prompts = prompts_of(1, 10, len(tokenizer))
    want = generate_batch(model32, prompts, 20, {2, 7}, 0, decode_step="model")
    assert min(map(len, want)) < 20  # rows stop mid-batch: the batch compacts, the C call reads kept rows
    assert generate_batch(model32, prompts, 20, {2, 7}, 0, decode_step="direct") == want
    assert not batch_step.DecodeStep(model32, cache, c_attention=False).c_attention
    assert not batch_step.DecodeStep(make_model(len(tokenizer), seed=0), cache).c_attention  # float64: torch's


def test_make_data_times_the_cpu_steps_and_keeps_the_faster(model32, monkeypatch):
    """choose_cpu_step alternates the kinds, keeps each one's best, and takes the faster, whichever it is."""
    order = []

    def fake(model, batch, cache_len, steps, kind):
        order.append(kind)
        return {"model": [0.30, 0.20], "direct": [0.25, 0.26]}[kind][order.count(kind) - 1]
    monkeypatch.setattr(store_mod, "decode_step_seconds", fake)
    choice = store_mod.choose_cpu_step(model32, 32, 100)
    assert order == ["model", "direct", "model", "direct"]
    assert choice.kind == "model" and choice.seconds == {"model": 0.20, "direct": 0.25}
    assert choice.to_dict()["ms_per_step"] == {"model": 200.0, "direct": 250.0}
    order.clear()
    monkeypatch.setattr(store_mod, "decode_step_seconds",
                        lambda m, b, c, s, kind: order.append(kind) or {"model": 0.3, "direct": 0.1}[kind])
    assert store_mod.choose_cpu_step(model32, 32, 100).kind == "direct"
    from diffspec import fused_layers
    assert batch_step.direct_may_win(model32) == fused_layers.available()
    assert not batch_step.direct_may_win(make_model(32, seed=0))  # float64
