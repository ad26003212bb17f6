"""The token store (`diffspec make-data`): batched static-cache generation equals per-prompt greedy decoding,
every user turn is a prompt, evaluation prompts stay out, a resumed or interrupted build equals a one-go build,
repeated answers are dropped, and bad settings are refused before any model loads."""

import json
import random
import time

import pytest
import torch

from conftest import make_model, make_tokenizer
from diffspec import Target
from diffspec.cli import main
from diffspec.errors import DiffspecError
from diffspec.training import store as store_mod
from diffspec.training.store import (build_store, choose_batch_size, conversation_prompts, generate_batch,
                                     ordered_prompts, read_store, turn_prompt)


def words(rng, lo, hi):
    return " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randrange(lo, hi)))


@pytest.fixture(scope="module")
def convs():
    """Conversations of one to three exchanges, plus one repeated first turn (a duplicate prompt)."""
    rng = random.Random(0)
    out = []
    for i in range(14):
        conv = []
        for _ in range(1 + i % 3):
            conv += [{"role": "user", "content": words(rng, 2, 8)}, {"role": "assistant", "content": words(rng, 3, 9)}]
        out.append(conv)
    out.append([dict(out[0][0]), {"role": "assistant", "content": "w1 w2"}])
    return out


@pytest.fixture(autouse=True)
def no_evaluation_sets(monkeypatch):
    """The installed benchmark sets are not what these tests are about (and reading them takes time)."""
    monkeypatch.setattr(store_mod, "evaluation_prompts", lambda: [])


@pytest.fixture(scope="module")
def fp32_model(tokenizer):
    return make_model(len(tokenizer), seed=0, dtype=torch.float32)


def hf_greedy(model, prompt, max_new_tokens, stops):
    """Per prompt, unbatched: transformers' own greedy generate, cut after the first stop token."""
    out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=sorted(stops), pad_token_id=0)
    resp = out[0, len(prompt):].tolist()
    for j, t in enumerate(resp):
        if t in stops:
            return resp[: j + 1]
    return resp


def test_batched_static_cache_greedy_equals_per_prompt_greedy(fp32_model, tokenizer):
    rng = random.Random(1)
    prompts = [[rng.randrange(4, len(tokenizer)) for _ in range(rng.randrange(1, 24))] for _ in range(10)]
    # a stop token that one prompt reaches at its 4th token: that row stops mid-batch, the others go on
    stop = hf_greedy(fp32_model, prompts[3], 20, {2})[3]
    stops = {2, stop}
    want = [hf_greedy(fp32_model, p, 20, stops) for p in prompts]
    assert min(map(len, want)) < 20 and max(map(len, want)) == 20, [len(w) for w in want]
    assert generate_batch(fp32_model, prompts, 20, stops, pad_id=0) == want
    # a prefill split into row groups, and rows dropped as soon as one stops: the same tokens
    assert generate_batch(fp32_model, prompts, 20, stops, pad_id=0, prefill_tokens=30, compact_share=0.0) == want


def test_a_batch_cache_is_freed_when_the_batch_ends_not_at_the_next_garbage_collection(fp32_model, monkeypatch):
    """Each batch preallocates its whole KV cache (gigabytes for a real target at batch 64): a reference
    cycle would keep every finished batch's cache until a full collection, and memory would grow."""
    import gc
    import weakref

    caches = []
    real_init = store_mod.BatchKVCache.__init__

    def remembered(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        caches.append(weakref.ref(self))
    monkeypatch.setattr(store_mod.BatchKVCache, "__init__", remembered)
    gc.disable()
    try:
        for _ in range(2):
            generate_batch(fp32_model, [[5, 6, 7], [8, 9]], 4, {2}, 0)
        assert len(caches) == 2 and all(ref() is None for ref in caches)
    finally:
        gc.enable()


def test_sampling_with_a_generator_per_prompt_does_not_depend_on_the_batch(fp32_model, tokenizer):
    rng = random.Random(2)
    prompts = [[rng.randrange(4, len(tokenizer)) for _ in range(rng.randrange(2, 12))] for _ in range(6)]

    def gens(idx):
        return [torch.Generator().manual_seed(100 + i) for i in idx]

    together = generate_batch(fp32_model, prompts, 12, {2}, 0, temperature=0.7, generator=gens(range(6)))
    alone = [generate_batch(fp32_model, [p], 12, {2}, 0, temperature=0.7, generator=gens([i]))[0]
             for i, p in enumerate(prompts)]
    assert together == alone
    greedy = generate_batch(fp32_model, prompts, 12, {2}, 0)
    assert together != greedy  # it does sample


def test_every_user_turn_is_a_prompt_with_its_context(tokenizer):
    conv = [{"role": "system", "content": "w50"}, {"role": "user", "content": "w1 w2"},
            {"role": "assistant", "content": "w3"}, {"role": "user", "content": "w4"},
            {"role": "assistant", "content": "w5 w6"}, {"role": "user", "content": "w7 w8 w9"}]
    prompts = conversation_prompts([conv], tokenizer, 100)
    want = [tokenizer.apply_chat_template(conv[:i + 1], add_generation_prompt=True, tokenize=True)["input_ids"]
            for i in (1, 3, 5)]
    assert prompts == want
    text = tokenizer.decode(prompts[2])
    assert all(w in text for w in ("w50", "w1", "w3", "w5", "w6", "w9")) and text.rstrip().endswith("assistant")
    # without a chat template: the turns' contents joined by blank lines
    raw = make_tokenizer()
    raw.chat_template = None
    assert conversation_prompts([conv], raw, 100)[1] == raw("w50\n\nw1 w2\n\nw3\n\nw4")["input_ids"]
    # too long: earlier context is cut from the left, the question itself never
    cut = turn_prompt(tokenizer, conv, 5, 12)
    assert cut == want[2][-12:]
    assert turn_prompt(tokenizer, conv, 5, 3) is None


def test_seeded_order_is_a_prefix_for_every_limit_and_prompts_are_distinct(convs, tokenizer):
    full = ordered_prompts(convs, tokenizer, 64, seed=3)
    assert full.duplicates == 1 and len(set(map(tuple, full.prompts))) == len(full.prompts)
    assert sorted(map(tuple, full.prompts)) == sorted(set(map(tuple, conversation_prompts(convs, tokenizer, 64))))
    assert ordered_prompts(convs, tokenizer, 64, seed=3, limit=5).prompts == full.prompts[:5]
    assert ordered_prompts(convs, tokenizer, 64, seed=4).prompts != full.prompts


class FirstChunk(Exception):
    pass


def test_prompts_are_rendered_as_the_store_needs_them(tmp_path, target, monkeypatch):
    """A corpus is rendered a chunk at a time, in the seeded order, not all before the first answer: rendering all
    of ShareGPT's 61k user turns took a whole `make-data --max-time 6m` on 2 CPU cores before one answer."""
    rng = random.Random(1)
    many = [[{"role": "user", "content": f"q{i} " + words(rng, 2, 6)}, {"role": "assistant", "content": "ok"}]
            for i in range(600)]
    rendered, at_first_chunk = [], []
    render, answer = store_mod.turn_prompt, store_mod._answer_chunk
    monkeypatch.setattr(store_mod, "turn_prompt", lambda *a: rendered.append(1) or render(*a))

    def first_chunk(model, prompts, start, n, *args, **kw):
        at_first_chunk.append((len(rendered), start, n))
        raise FirstChunk

    monkeypatch.setattr(store_mod, "_answer_chunk", first_chunk)
    with pytest.raises(FirstChunk):
        build(tmp_path / "lazy", target, many, temperatures=(0.0,))
    (seen, start, n), = at_first_chunk
    assert start == 0 and 0 < n <= 8 and seen < 300  # ~the 256 prompts the batch probe reads, not the 600
    monkeypatch.setattr(store_mod, "_answer_chunk", answer)
    manifest = build(tmp_path / "some", target, many, temperatures=(0.0,), max_prompts=20)
    assert manifest["prompts_done"] == manifest["prompts_total"] == 20 and manifest["user_turns"] == 600
    assert manifest["user_turns_read"] < 40  # the first 20 distinct prompts' worth, not the 600


def test_lazy_rendering_stores_the_seeded_order_chunk_by_chunk(tmp_path, target, monkeypatch):
    """Past the first 256 prompts (the batch probe's) the prompts are rendered chunk by chunk, and the store holds
    exactly the seeded order's first prompts, in order; a run stopped before the corpus ends says its total is not
    known yet (None), and a rerun continues with the next prompts."""
    rng = random.Random(2)
    many = [[{"role": "user", "content": f"q{i} " + words(rng, 2, 6)}, {"role": "assistant", "content": "ok"}]
            for i in range(700)]
    want = ordered_prompts(many, target.tokenizer, 64, 0).prompts
    chunks = []

    def answers(model, prompts, start, n, *args, **kw):  # distinct stand-in answers (no generation)
        chunks.append((start, n))
        if len(chunks) > 40:
            return None, 0  # as a deadline overtaking the chunk
        return {(i, 0): [10 + i % 50, 10 + i // 50] for i in range(start, start + n)}, 2 * n

    monkeypatch.setattr(store_mod, "_answer_chunk", answers)
    manifest = build(tmp_path / "s", target, many, temperatures=(0.0,), shard_sequences=8)
    assert [c for c in chunks[:40]] == [(8 * k, 8) for k in range(40)] and manifest["prompts_done"] == 320
    assert manifest["prompts_total"] is None and manifest["user_turns_read"] < 700
    stored = [ids.tolist()[:p] for ids, p in read_store(tmp_path / "s").sequences]
    assert stored == want[:320]
    chunks.clear()
    manifest = build(tmp_path / "s", target, many, temperatures=(0.0,), shard_sequences=8, max_prompts=340)
    assert chunks == [(320, 8), (328, 8), (336, 4)] and manifest["prompts_total"] == 340
    assert [ids.tolist()[:p] for ids, p in read_store(tmp_path / "s").sequences] == want[:340]


def build(out, target, convs, **kw):
    args = dict(max_new_tokens=12, max_prompt_tokens=64, batch_size=4, temperatures=(0.0, 0.7), seed=0,
                shard_sequences=8, progress=False)
    args.update(kw)
    return build_store(out, target, convs, **args)


def contents(path):
    s = read_store(path)
    return [(ids.tolist(), p) for ids, p in s.sequences], s.temperatures


def test_store_layout_and_read_back(tmp_path, target, convs):
    manifest = build(tmp_path / "s", target, convs)
    assert manifest["format"] == "diffspec-token-store" and manifest["version"] == 1
    total = len(ordered_prompts(convs, target.tokenizer, 64, 0).prompts)
    assert manifest["prompts_done"] == manifest["prompts_total"] == total
    assert manifest["tokenizer_fingerprint"] == target.tokenizer_fingerprint and manifest["target"] == "tiny"
    assert len(manifest["shards"]) > 1 and all(s["sequences"] <= 8 for s in manifest["shards"])
    on_disk = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert on_disk == json.loads(json.dumps(manifest))
    store = read_store(tmp_path / "s")
    assert len(store) == len(store.sequences) == sum(s["sequences"] for s in manifest["shards"])
    assert set(store.temperatures) == {0.0, 0.7}
    stops = target.stop_token_ids
    responses = set()
    for ids, plen in store.sequences:
        assert ids.dtype == torch.long and 0 < plen < len(ids) <= plen + 12
        resp = ids[plen:].tolist()
        assert all(t not in stops for t in resp[:-1])  # cut after the first stop token
        responses.add(tuple(resp))
    assert len(responses) == len(store)  # no answer stored twice
    assert not list((tmp_path / "s").glob("*.tmp"))


def test_resumed_and_interrupted_builds_equal_a_one_go_build(tmp_path, target, convs, monkeypatch):
    build(tmp_path / "one-go", target, convs)
    want = contents(tmp_path / "one-go")
    # stopped by max_prompts, then continued with another batch size and shard size
    first = build(tmp_path / "resumed", target, convs, max_prompts=5)
    assert first["prompts_done"] == 5
    build(tmp_path / "resumed", target, convs, batch_size=3, shard_sequences=6)
    assert contents(tmp_path / "resumed") == want
    # killed after its first shard: a rerun loses nothing that was written and ends the same
    real = store_mod._write_shard
    calls = []

    def dies_on_the_second_shard(path, seqs):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        real(path, seqs)
    monkeypatch.setattr(store_mod, "_write_shard", dies_on_the_second_shard)
    with pytest.raises(KeyboardInterrupt):
        build(tmp_path / "killed", target, convs)
    monkeypatch.setattr(store_mod, "_write_shard", real)
    assert read_store(tmp_path / "killed").manifest["prompts_done"] == 4  # one chunk: 8 sequences / 2 temperatures
    build(tmp_path / "killed", target, convs)
    assert contents(tmp_path / "killed") == want
    # a deadline already passed writes nothing; the next run finishes
    build(tmp_path / "late", target, convs, deadline=0.0)
    assert read_store(tmp_path / "late").manifest["prompts_done"] == 0
    build(tmp_path / "late", target, convs)
    assert contents(tmp_path / "late") == want


@pytest.fixture(scope="module")
def echo_target():
    """A target without attention (every o_proj zero): its next token depends on the current one only, so
    every prompt (all end in 'assistant') gets the same greedy answer."""
    tok = make_tokenizer()
    model = make_model(len(tok), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight"):
                p.zero_()
    return Target(model, tok, name="echo")


def test_repeated_answers_are_dropped_also_across_a_resume(tmp_path, echo_target, convs):
    first = build(tmp_path / "s", echo_target, convs, temperatures=(0.0,), max_prompts=3)
    assert len(read_store(tmp_path / "s")) == 1 and first["duplicates_dropped"] == 2
    last = build(tmp_path / "s", echo_target, convs, temperatures=(0.0,))
    assert len(read_store(tmp_path / "s")) == 1
    assert last["duplicates_dropped"] == last["prompts_done"] - 1


def test_evaluation_prompts_never_enter_the_store(tmp_path, target, convs, monkeypatch):
    leaked = convs[5][2]["content"]  # a later user turn of one conversation: the whole conversation goes
    monkeypatch.setattr(store_mod, "evaluation_prompts", lambda: ["  " + leaked.upper() + "\n"])
    manifest = build(tmp_path / "s", target, convs, temperatures=(0.0,))
    assert manifest["evaluation_overlap_dropped"] == 1
    banned = {tuple(p) for p in conversation_prompts([convs[5]], target.tokenizer, 64)}
    stored = {tuple(ids[:plen].tolist()) for ids, plen in read_store(tmp_path / "s").sequences}
    assert stored and not stored & banned


def test_other_settings_target_or_prompts_are_refused_on_resume(tmp_path, target, convs, echo_target):
    build(tmp_path / "s", target, convs, max_prompts=2)
    with pytest.raises(DiffspecError, match="max_new_tokens=12, this run asks for 16"):
        build(tmp_path / "s", target, convs, max_new_tokens=16)
    with pytest.raises(DiffspecError, match="temperatures"):
        build(tmp_path / "s", target, convs, temperatures=(0.0,))
    with pytest.raises(DiffspecError, match="target 'tiny', not 'echo'"):
        build(tmp_path / "s", echo_target, convs)
    with pytest.raises(DiffspecError, match="prompts"):
        build(tmp_path / "s", target, convs[::-1])
    with pytest.raises(DiffspecError, match="not a token store"):
        build(tmp_path, target, convs)  # a folder holding other things


def test_read_store_refuses_what_is_not_a_store(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    for path in (tmp_path, tmp_path / "missing"):
        with pytest.raises(DiffspecError, match=str(path.name)):
            read_store(path)


def test_batch_size_is_measured(tiny_model, monkeypatch):
    choice = choose_batch_size(tiny_model, "cpu", cache_len=32, candidates=(1, 4, 8))
    assert choice.batch_size in choice.tokens_per_s and set(choice.tokens_per_s) <= {1, 4, 8}
    assert json.dumps(choice.to_dict())
    # scripted step times (tokens/s = batch / seconds): a burst of load slows the reading at 4 and the first
    # one at 32; growing goes on to 16 at least and stops after two sizes without a 10% gain over the best
    readings = {1: [0.10], 4: [1.0], 8: [0.12], 16: [0.20], 32: [0.9, 0.25], 64: [0.75, 0.7], 128: [1.0]}
    calls = []

    def step_seconds(model, batch, cache_len, steps, decode_step):
        assert decode_step == "model"
        calls.append(batch)
        return readings[batch].pop(0)
    monkeypatch.setattr(store_mod, "decode_step_seconds", step_seconds)
    choice = choose_batch_size(tiny_model, "cpu", candidates=(1, 4, 8, 16, 32, 64, 128))
    assert calls == [1, 4, 8, 16, 32, 64, 32, 64]  # then the best (64 at first) and its neighbour again
    assert choice.batch_size == 32 and choice.tokens_per_s[32] == pytest.approx(128.0)


def test_the_first_chunk_under_a_deadline_is_sized_to_end_in_time(tmp_path, target, convs, monkeypatch):
    """A chunk the deadline overtakes is lost whole. The first chunk of a run was one batch per temperature
    whatever the time left: on 2 CPU cores, 48 prompts x 2 temperatures x 256 tokens under a one-minute
    --max-time stored nothing. It is now sized from the batch probe's tokens/s."""
    from diffspec.training.store import BatchChoice, first_chunk_prompts

    probe = {"chosen": 64, "tokens_per_s": {"1": 29.9, "4": 89.0, "8": 103.3, "16": 117.6, "32": 170.9, "64": 208.9}}
    assert first_chunk_prompts(48, 55.0, 2, 256, probe) == 9    # 9 x 2 x 256 / 103.3 tok/s (batch 8) <= 49.5 s
    assert first_chunk_prompts(48, 3600.0, 2, 256, probe) == 48  # time enough: the whole batch
    assert first_chunk_prompts(48, 1.0, 2, 256, probe) == 1      # never below one
    assert first_chunk_prompts(48, 1.0, 2, 256, None) == 48      # a fixed --batch-size: no probe to go by

    # scripted: 40 generated tokens/s at any batch, so n prompts x 2 temperatures x 8 tokens take 0.4 n s;
    # with 1.5 s left a first chunk of the batch (8 prompts: 1.6 s for its first temperature alone) is lost
    rate, real = 40.0, store_mod.generate_batch

    def slow_generate(model, prompts, max_new_tokens, *args, **kwargs):
        time.sleep(len(prompts) * max_new_tokens / rate)
        return real(model, prompts, max_new_tokens, *args, **kwargs)
    monkeypatch.setattr(store_mod, "generate_batch", slow_generate)
    monkeypatch.setattr(store_mod, "choose_batch_size", lambda *a, **k: BatchChoice(8, {1: rate, 4: rate, 8: rate},
                                                                                   32, "cpu", 0.0))
    manifest = build(tmp_path / "timed", target, convs, batch_size="auto", max_new_tokens=8, shard_sequences=64,
                     deadline=time.time() + 1.5)
    assert 1 <= manifest["prompts_done"] <= 3 and read_store(tmp_path / "timed").manifest["shards"]


def test_cli_says_when_the_deadline_left_nothing_stored(tmp_path, tiny_model_dir, corpus_file, capsys, monkeypatch):
    monkeypatch.setattr(store_mod, "first_chunk_prompts", lambda cap, *a: cap)  # as before: the whole batch
    monkeypatch.setattr(store_mod, "_answer_chunk", lambda *a: (None, 0))  # the deadline overtook the chunk
    args = ["make-data", "--out", str(tmp_path / "late"), "--model", str(tiny_model_dir), "--corpus",
            str(corpus_file), "--max-new-tokens", "8", "--max-prompt-tokens", "48", "--max-time", "60", "--quiet"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "--max-time 60 ended before the first chunk of answers was done" in err and "nothing was stored" in err
    assert "generated tokens/s at batch" in err


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory, convs):
    path = tmp_path_factory.mktemp("corpus") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs))
    return path


def test_cli_refuses_bad_parameters_before_loading_the_model(tmp_path, corpus_file, monkeypatch, capsys):
    def no_loading(*a, **k):
        raise AssertionError("the model must not load")
    monkeypatch.setattr(Target, "load", no_loading)
    base = ["make-data", "--out", str(tmp_path / "s"), "--corpus", str(corpus_file)]
    for extra, says in ((["--batch-size", "zero"], "--batch-size"), (["--batch-size", "0"], "--batch-size"),
                        (["--temperatures", "0", "-0.5"], "temperatures"),
                        (["--max-new-tokens", "0"], "max-new-tokens"),
                        (["--max-time", "soon"], "--max-time")):
        assert main(base + extra) == 2
        err = capsys.readouterr().err
        assert err.startswith("diffspec: error: ") and says in err and err.count("\n") == 1, err
    assert main(["make-data", "--out", str(tmp_path / "s"), "--corpus", str(tmp_path / "none.jsonl")]) == 2
    assert "corpus not found" in capsys.readouterr().err


def test_cli_writes_a_store(tmp_path, tiny_model_dir, corpus_file, capsys):
    out = tmp_path / "store"
    args = ["make-data", "--out", str(out), "--model", str(tiny_model_dir), "--corpus", str(corpus_file),
            "--max-prompts", "6", "--max-new-tokens", "8", "--max-prompt-tokens", "48", "--quiet"]
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prompts_done"] == 6 and summary["sequences"] == len(read_store(out)) > 0
    assert summary["batch_choice"]["chosen"] >= 1 and summary["generated_tokens_per_s"] > 0
    # a float32 model on a CPU: the two decode steps timed at 32 rows, the faster one run and recorded
    from diffspec import fused_layers
    if fused_layers.available():
        choice = summary["decode_step_choice"]
        assert choice["batch"] == 32 and set(choice["ms_per_step"]) == {"model", "direct"}
        assert summary["decode_step"] == choice["chosen"] == min(choice["ms_per_step"], key=choice["ms_per_step"].get)
        assert read_store(out).manifest["settings"]["decode_step"] == summary["decode_step"]
    assert main(args[:-1] + ["--max-new-tokens", "9", "--quiet"]) == 2  # a different setting on the same store
    assert "max_new_tokens=8" in capsys.readouterr().err


def test_cli_summary_of_an_empty_store_and_of_a_resume_that_names_its_step(tmp_path, tiny_model_dir, corpus_file, capsys):
    """A store with no prompt short enough says so in its summary (it raised KeyError: no decode step was ever
    chosen); a resumed run that names its decode step times nothing and records no choice (the first run's
    timing stayed in the manifest beside the step this run named)."""
    base = ["make-data", "--model", str(tiny_model_dir), "--corpus", str(corpus_file), "--max-new-tokens", "6",
            "--quiet"]
    assert main(base + ["--out", str(tmp_path / "empty"), "--max-prompt-tokens", "2"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["prompts_total"] == 0 and summary["decode_step"] is None and summary["decode_step_choice"] is None
    out = str(tmp_path / "store")
    assert main(base + ["--out", out, "--max-prompts", "2", "--max-prompt-tokens", "48"]) == 0
    first = json.loads(capsys.readouterr().out)
    from diffspec import fused_layers
    assert (first["decode_step_choice"] is not None) == fused_layers.available()
    assert main(base + ["--out", out, "--max-prompts", "4", "--max-prompt-tokens", "48", "--decode-step", "model"]) == 0
    second = json.loads(capsys.readouterr().out)
    assert second["prompts_done"] == 4 and second["decode_step"] == "model" and second["decode_step_choice"] is None
    assert "decode_step_choice" not in read_store(out).manifest["settings"]


def test_corpus_store_holds_each_conversation_as_written(tmp_path, target, convs, monkeypatch):
    """--source corpus: every conversation rendered whole, its first user turn (with the assistant prefix)
    as the prompt; evaluation overlap and repeated responses dropped; temperature -1; refuses a used folder."""
    from diffspec.training.store import build_corpus_store, corpus_sequence, turn_prompt
    leaked = convs[4][0]["content"]
    monkeypatch.setattr(store_mod, "evaluation_prompts", lambda: [leaked])
    manifest = build_corpus_store(tmp_path / "c", target, convs + [convs[1]], progress=False, shard_sequences=4)
    store = read_store(tmp_path / "c")
    tok = target.tokenizer
    want = {}
    for i, conv in enumerate(convs):
        if i == 4:
            continue
        whole = [int(t) for t in tok(tok.apply_chat_template(conv, tokenize=False), add_special_tokens=False)["input_ids"]]
        want[tuple(whole)] = len(turn_prompt(tok, conv, 0, 10_000))
    got = {tuple(ids.tolist()): p for ids, p in store.sequences}
    assert got == want  # each kept conversation once (the repeat dropped), prompt = its first user turn
    assert manifest["evaluation_overlap_dropped"] == 1 and manifest["duplicates_dropped"] == 1
    assert set(store.temperatures) == {-1.0} and manifest["source"] == "corpus" and len(manifest["shards"]) > 1
    assert corpus_sequence(tok, [{"role": "user", "content": "w1 w2"}]) is None  # nothing answered: skipped
    with pytest.raises(DiffspecError, match="not empty"):
        build_corpus_store(tmp_path / "c", target, convs, progress=False)


def test_cli_corpus_source_refuses_generation_settings_and_writes_a_store(tmp_path, tiny_model_dir, corpus_file,
                                                                           capsys):
    base = ["make-data", "--source", "corpus", "--model", str(tiny_model_dir), "--corpus", str(corpus_file), "--quiet"]
    for extra, says in ((["--temperatures", "0", "0.7"], "--temperatures"), (["--max-new-tokens", "8"], "--max-new-tokens"),
                        (["--device", "cuda"], "--device"), (["--kernels", "q8"], "--kernels")):
        assert main(base + ["--out", str(tmp_path / "x")] + extra) == 2
        err = capsys.readouterr().err
        assert says in err and "generates nothing" in err and err.count("\n") == 1, err
    assert main(base + ["--out", str(tmp_path / "c"), "--max-prompts", "5"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert 0 < summary["sequences"] == len(read_store(tmp_path / "c")) <= 5 and summary["response_tokens"] > 0


def test_cli_make_data_takes_the_targets_kernels(tmp_path, tiny_model_dir, corpus_file, capsys):
    """--kernels as generate's: q8 refused by name where it cannot run (a target that is not GGUF codes), before a
    prompt is answered; the kernels a run used are in the manifest."""
    base = ["make-data", "--model", str(tiny_model_dir), "--corpus", str(corpus_file), "--quiet", "--max-new-tokens",
            "4", "--max-prompt-tokens", "64", "--max-prompts", "3", "--batch-size", "2"]
    assert main(base + ["--out", str(tmp_path / "q8"), "--kernels", "q8"]) == 2
    err = capsys.readouterr().err
    assert "--kernels q8" in err and "Traceback" not in err, err
    assert not (tmp_path / "q8" / "manifest.json").exists()
    assert main(base + ["--out", str(tmp_path / "a"), "--kernels", "multi-row"]) == 0
    capsys.readouterr()
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert manifest["settings"]["kernels"] == "multi-row" and {s["kernels"] for s in manifest["shards"]} == {"multi-row"}
