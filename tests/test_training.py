"""train-drafter on a tiny target and a tiny corpus: the loss falls, held-out acceptance rises where the
answers are learnable, the drafter reloads, resume resumes."""

import json
import random

import pytest
import torch

from conftest import make_model, make_tokenizer, reference_greedy
from diffspec import FixedPolicy, SpeculativeEngine, Target
from diffspec.checkpoint import load_drafter
from diffspec.training.data import drop_evaluation_overlap, iter_json_array, load_corpus
from diffspec.training.run import TrainRequest, train_drafter


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("corpus") / "chats.jsonl"
    with open(path, "w") as f:
        for _ in range(40):
            user = " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randrange(3, 9)))
            reply = " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randrange(5, 15)))
            f.write(json.dumps({"messages": [{"role": "user", "content": user},
                                             {"role": "assistant", "content": reply}]}) + "\n")
    return path


@pytest.fixture(scope="module")
def memorisable_target_dir(tmp_path_factory):
    """A target whose answers a drafter can learn from a few hundred tokens: no attention (every o_proj
    zero), so its next token is a fixed function f of the current token and an answer is the chain
    f(x), f(f(x)), ... from the prompt's last word. Saved without a chat template, so prompts end in
    their own last word (with the template every prompt ends in 'assistant' and every answer would
    be the same one, dropped as a repeat)."""
    path = tmp_path_factory.mktemp("memorisable-target")
    tok = make_tokenizer()
    tok.chat_template = None
    model = make_model(len(tok), seed=0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("o_proj.weight"):
                p.zero_()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def request(tmp, model_dir, corpus, **kw):
    # float32 unless a test asks otherwise: "auto" times a 512x576x8192 matmul in fp32 and bf16 (seconds on
    # an AVX2 CPU) on every call; the choice itself is tested in test_auto_train_dtype_is_measured_not_assumed
    base = dict(out=str(tmp), target=str(model_dir), corpus=str(corpus), generate=12, corpus_sequences=12,
                response_tokens=16, seq_len=64, block_size=4, anchors=8, sequences_per_step=2, lr=3e-3,
                quiet=True, checkpoint_every_s=0.0, train_dtype="float32")
    base.update(kw)
    return TrainRequest(**base)


@pytest.mark.parametrize("train_dtype", ["float32", "bfloat16"])
def test_training_lowers_the_loss_and_writes_everything(tmp_path, tiny_model_dir, corpus, train_dtype):
    record = train_drafter(request(tmp_path, tiny_model_dir, corpus, steps=60, train_dtype=train_dtype))
    assert record["train_dtype"] == train_dtype
    log = [json.loads(l) for l in open(tmp_path / "train_log.jsonl")]
    assert len(log) == 60
    first = sum(r["loss"] for r in log[:10]) / 10
    last = sum(r["loss"] for r in log[-10:]) / 10
    assert last < first * 0.9, (first, last)
    for name in ("drafter/config.json", "drafter/model.safetensors", "loss.png", "training.json", "checkpoint.pt"):
        assert (tmp_path / name).is_file(), name
    assert record["data"]["generated_sequences"] > 0


def test_saved_drafter_reloads_identically_and_stays_lossless(tmp_path, tiny_model_dir, corpus):
    train_drafter(request(tmp_path, tiny_model_dir, corpus, steps=5))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    target = Target(model, AutoTokenizer.from_pretrained(tiny_model_dir))
    outs = []
    for _ in range(2):
        engine = SpeculativeEngine(target, load_drafter(tmp_path / "drafter"), FixedPolicy(3))
        outs.append(engine.generate([5, 6, 7, 8, 9], max_new_tokens=20, stop_token_ids=[]))
    assert outs[0].token_ids == outs[1].token_ids == reference_greedy(model, [5, 6, 7, 8, 9], 20, stop_ids=())
    assert [r.drafted for r in outs[0].rounds] == [r.drafted for r in outs[1].rounds]


def test_resume_continues_from_the_checkpoint_step(tmp_path, tiny_model_dir, corpus):
    train_drafter(request(tmp_path, tiny_model_dir, corpus, steps=8))
    record = train_drafter(request(tmp_path, tiny_model_dir, corpus, steps=14, resume=True))
    log = [json.loads(l) for l in open(tmp_path / "train_log.jsonl")]
    assert record["steps"] == 14 and [r["step"] for r in log] == list(range(1, 15))


def test_auto_train_dtype_is_measured_not_assumed():
    from diffspec.training.run import choose_train_dtype
    dtype, why = choose_train_dtype("auto", "cpu", width=64, vocab=256)
    assert dtype in (torch.float32, torch.bfloat16) and why.startswith("measured")
    assert choose_train_dtype("float32", "cpu")[0] == torch.float32


def test_truncated_json_array_is_read_element_by_element():
    text = '[{"a": 1}, {"b": 2},\n {"c": [3, 4' # cut off mid-element, as the ShareGPT file is
    assert list(iter_json_array(text)) == [{"a": 1}, {"b": 2}]


def test_corpus_files_and_evaluation_overlap(tmp_path):
    txt = tmp_path / "notes.txt"
    txt.write_text("first paragraph\n\nsecond paragraph\n")
    assert [c[0]["content"] for c in load_corpus(str(txt))] == ["first paragraph", "second paragraph"]
    convs = [[{"role": "user", "content": "def add(a, b):\n    return a + b"}], [{"role": "user", "content": "hello"}]]
    kept, dropped = drop_evaluation_overlap(convs, ["def add(a, b):   return a + b"])
    assert dropped == 1 and kept == convs[1:]


def test_bad_requests_are_named(tmp_path, tiny_model_dir, corpus):
    from diffspec import DiffspecError
    with pytest.raises(DiffspecError, match="budget"):
        train_drafter(request(tmp_path, tiny_model_dir, corpus))
    with pytest.raises(DiffspecError, match="corpus not found"):
        train_drafter(request(tmp_path, tiny_model_dir, tmp_path / "nope.jsonl", steps=1))
    for budget in ({"steps": 0}, {"max_time": 0.0}, {"max_tokens": -5}):  # steps=0 used to loop forever
        with pytest.raises(DiffspecError, match="must be positive"):
            train_drafter(request(tmp_path, tiny_model_dir, corpus, **budget))


def test_default_target_layers_exist_for_any_depth():
    from diffspec.drafters.conditioned import default_target_layers

    assert default_target_layers(30) == [1, 14, 27]
    for depth in (1, 2, 3, 4):  # a one-layer target used to get layer 1, which it lacks
        assert all(0 <= i < depth for i in default_target_layers(depth))


def test_reduced_draft_vocabulary_drafts_only_its_tokens(tmp_path, tiny_model_dir, corpus):
    record = train_drafter(request(tmp_path, tiny_model_dir, corpus, steps=10, draft_vocab=16))
    assert record["draft_vocab"] == 16 and 0 < record["draft_vocab_coverage"] <= 1
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from diffspec import SamplingParams
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    target = Target(model, AutoTokenizer.from_pretrained(tiny_model_dir))
    drafter = load_drafter(tmp_path / "drafter")
    allowed = set(drafter.model.draft_token_ids.tolist())
    assert len(allowed) == 16
    engine = SpeculativeEngine(target, drafter, FixedPolicy(3))
    r = engine.generate([5, 6, 7, 8, 9], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(model, [5, 6, 7, 8, 9], 20, stop_ids=())
    drafter.begin(None)
    ctx = torch.tensor([5, 6, 7, 8, 9])
    drafter.observe(Target(model).forward(ctx[:-1], hidden_layers=drafter.target_layer_ids).hidden_states, 0)
    d = drafter.propose(ctx, FixedPolicy(3), 10, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert set(d.tokens.tolist()) <= allowed
    outside = torch.ones(d.probs.shape[1], dtype=torch.bool)
    outside[list(allowed)] = False
    assert torch.all(d.probs[:, outside] == 0) and torch.allclose(d.probs.sum(-1), torch.ones(3, dtype=d.probs.dtype))


def test_block_kind_trains_and_reloads_losslessly(tmp_path, tiny_model_dir, corpus):
    train_drafter(request(tmp_path, tiny_model_dir, corpus, kind="block", steps=40, layers=1, sequences_per_step=2))
    log = [json.loads(l) for l in open(tmp_path / "train_log.jsonl")]
    first = sum(r["loss"] for r in log[:8]) / 8
    last = sum(r["loss"] for r in log[-8:]) / 8
    assert last < first, (first, last)
    meta = json.loads((tmp_path / "drafter" / "config.json").read_text())["diffspec"]
    assert meta["kind"] == "block-diffusion" and meta["block_size"] == 4
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    target = Target(model, AutoTokenizer.from_pretrained(tiny_model_dir))
    r = SpeculativeEngine(target, load_drafter(tmp_path / "drafter"), FixedPolicy(5)).generate(
        [5, 6, 7, 8, 9], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(model, [5, 6, 7, 8, 9], 20, stop_ids=())


@pytest.mark.parametrize("kind, steps", [("conditioned", 150), ("block", 30)])
def test_training_raises_held_out_acceptance_on_a_memorisable_target(tmp_path, memorisable_target_dir, corpus,
                                                                     kind, steps):
    """The held-out figure is a mean accepted length (bonus counted: 1.0 = nothing accepted, block 4 allows
    up to 4.0). On answers it can learn, a trained drafter must beat its untrained self by a clear margin
    (measured: conditioned 1.00 -> 2.89, block 1.12 -> 2.75; with lr 0 both stay where they start)."""
    record = train_drafter(request(tmp_path, memorisable_target_dir, corpus, kind=kind, steps=steps, generate=40,
                                   lr=1e-2, layers=2 if kind == "conditioned" else 1))
    before, after = record["held_out_mean_accepted_length_before"], record["held_out_mean_accepted_length_after"]
    assert record["data"]["generated_sequences"] >= 8 and before is not None  # there is a held-out split
    assert after >= before + 1.0, (before, after)


def test_two_copy_mask_matches_the_drafting_layout():
    from diffspec.training.block import two_copy_mask
    m = two_copy_mask(4, 2)[0, 0]
    # clean positions 0..3 (blocks 0,0,1,1) then noisy 4..7
    assert m[1, :4].tolist() == [True, True, False, False] and not m[1, 4:].any()     # clean: block-causal
    assert m[6, :4].tolist() == [True, True, False, False]                           # noisy block 1 sees clean block 0
    assert m[6, 4:].tolist() == [False, False, True, True]                           # and itself, both ways
    assert m[4, :4].tolist() == [False] * 4 and m[4, 4:].tolist() == [True, True, False, False]


def test_features_come_back_in_input_order(tiny_model):
    from diffspec.training.features import extract_features
    seqs = [([5, 6, 7, 8, 9, 10], 2), ([11, 12], 1), ([13, 14, 15, 16], 1)]
    feats = extract_features(tiny_model, seqs, layer_ids=(0,), batch_size=2)
    assert [f.tokens.tolist() for f in feats] == [s for s, _ in seqs]
    assert [f.first_supervised for f in feats] == [2, 1, 1]


def test_repeated_target_answers_are_dropped_before_the_held_out_split():
    from diffspec.training.run import drop_repeated_answers
    gen = [([1, 2, 9, 9], 2), ([3, 9, 9], 1), ([1, 2, 8], 2), ([4, 5, 9, 9], 2)]
    kept, dropped = drop_repeated_answers(gen)
    assert kept == [([1, 2, 9, 9], 2), ([1, 2, 8], 2)] and dropped == 2


def test_block_loss_reports_slot1_accuracy_of_each_blocks_first_masked_position(tiny_model):
    """The progress bar's 'slot-1 acc' for block kind, recomputed position by position: labels are
    made to agree with the drafter's argmax in every other counted block, so the share is ~1/2."""
    from diffspec.training.block import block_diffusion_loss, make_block_body, noisy_copy, two_copy_mask
    from diffspec.training.features import SequenceFeatures

    model, mask_id = make_block_body(tiny_model, 1)
    T, B, start = 24, 4, 3
    tokens = torch.randint(0, mask_id, (T,), generator=torch.Generator().manual_seed(0))
    y, masked = noisy_copy(tokens, B, mask_id, random.Random(7))        # the masks the loss will draw
    with torch.no_grad():
        hidden = model.model(input_ids=torch.cat([tokens, y])[None], attention_mask=two_copy_mask(T, B),
                             position_ids=torch.arange(T).repeat(2)[None]).last_hidden_state[0]
    labels = torch.zeros(T, dtype=torch.long)
    firsts = []
    for b in range(0, T, B):
        p = next((i for i in range(b, b + B) if masked[i] and i >= start), None)
        if p is not None and bool(masked[p: b + B].all()):  # a draft's first token: the rest of the block unknown
            row = hidden[p - 1] if p % B == 0 else hidden[T + p - 1]
            top = int(model.lm_head(row).argmax())
            labels[p - 1] = top if len(firsts) % 2 == 0 else (top + 1) % mask_id
            firsts.append(p)
    seq = SequenceFeatures(tokens, torch.zeros(T, 1), labels, first_supervised=start)
    loss, n, acc = block_diffusion_loss(model, seq, B, mask_id, "target", random.Random(7))
    assert len(firsts) >= 2 and n == int(masked[start:].sum())
    assert acc == pytest.approx(((len(firsts) + 1) // 2) / len(firsts))
