"""train-drafter on a tiny target and a tiny corpus: the loss falls, held-out acceptance rises where the
answers are learnable, the drafter reloads, resume resumes."""

import json
import random

import pytest
import torch

from conftest import make_model, make_tokenizer, reference_greedy
from diffspec import FailFastPolicy, FixedPolicy, SpeculativeEngine, Target
from diffspec.checkpoint import load_drafter
from diffspec.errors import DiffspecError
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


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_model_dir, corpus):
    """The tiny target's own answers to the corpus: the token store every training test reads."""
    return make_store(tmp_path_factory.mktemp("store"), tiny_model_dir, corpus)


@pytest.fixture(scope="module")
def memorisable_store(tmp_path_factory, memorisable_target_dir):
    rng = random.Random(1)
    path = tmp_path_factory.mktemp("memorisable-corpus") / "prompts.jsonl"
    with open(path, "w") as f:
        for _ in range(160):
            f.write(json.dumps({"text": " ".join(f"w{rng.randrange(60)}" for _ in range(rng.randrange(2, 6)))}) + "\n")
    return make_store(tmp_path_factory.mktemp("memorisable-store"), memorisable_target_dir, path)


def make_store(path, model_dir, corpus):
    from diffspec.training.store import build_store
    target = Target.load(str(model_dir))
    build_store(path, target, load_corpus(str(corpus)), max_new_tokens=16, max_prompt_tokens=48, batch_size=8,
                progress=False)
    return path


def request(tmp, model_dir, data, **kw):
    # float32 unless a test asks otherwise: "auto" times a 512x576x8192 matmul in fp32 and bf16 (seconds on
    # an AVX2 CPU) on every call; the choice itself is tested in test_auto_train_dtype_is_measured_not_assumed
    base = dict(out=str(tmp), target=str(model_dir), data=str(data), seq_len=64, block_size=4, anchors=8,
                batch_sequences=2, lr=3e-3, quiet=True, checkpoint_every_s=0.0, train_dtype="float32",
                eval_prompts=0, eval_tokens=12, held_out=8, epochs=100.0)
    base.update(kw)
    return TrainRequest(**base)


def losses(path):
    return [json.loads(l)["loss"] for l in open(path / "train_log.jsonl")]


@pytest.mark.parametrize("train_dtype", ["float32", "bfloat16"])
def test_training_lowers_the_loss_and_writes_everything(tmp_path, tiny_model_dir, store, train_dtype):
    record = train_drafter(request(tmp_path, tiny_model_dir, store, steps=60, train_dtype=train_dtype))
    assert record["train_dtype"] == train_dtype
    log = losses(tmp_path)
    assert len(log) == 60
    first, last = sum(log[:10]) / 10, sum(log[-10:]) / 10
    assert last < first * 0.9, (first, last)
    for name in ("drafter/config.json", "drafter/model.safetensors", "loss.png", "training.json", "checkpoint.pt"):
        assert (tmp_path / name).is_file(), name
    assert record["data"]["prompts_done"] > 0 and record["supervised_slots_per_s"] > 0
    assert record["held_out"]["overall"]["anchors"] > 0  # the end-of-run check on held-out store sequences


def test_epochs_count_passes_over_the_store(tmp_path, tiny_model_dir, store):
    from diffspec.training.store import read_store
    n = len(read_store(store))
    record = train_drafter(request(tmp_path, tiny_model_dir, store, epochs=2.0, batch_sequences=4))
    train_sequences = n - min(8, n // 20)
    assert record["steps"] == 2 * -(-train_sequences // 4) and record["epochs"] == pytest.approx(2.0)


def test_saved_drafter_reloads_identically_and_stays_lossless(tmp_path, tiny_model_dir, store):
    train_drafter(request(tmp_path, tiny_model_dir, store, steps=5))
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    target = Target(model, AutoTokenizer.from_pretrained(tiny_model_dir))
    outs = []
    for _ in range(2):
        engine = SpeculativeEngine(target, load_drafter(tmp_path / "drafter"), FixedPolicy(3))
        outs.append(engine.generate([5, 6, 7, 8, 9], max_new_tokens=20, stop_token_ids=[]))
    assert outs[0].token_ids == outs[1].token_ids == reference_greedy(model, [5, 6, 7, 8, 9], 20, stop_ids=())
    assert [r.drafted for r in outs[0].rounds] == [r.drafted for r in outs[1].rounds]


class Killed(Exception):
    pass


def test_identical_runs_in_one_process_give_identical_losses(tmp_path, tiny_model_dir, store):
    """The drafter's random init is seeded right before it is made: the first run in a process (lazy imports,
    first loads) once drew other initial weights than the next, which broke the resume test run alone."""
    for name in ("first", "second"):
        train_drafter(request(tmp_path / name, tiny_model_dir, store, steps=3, layers=1, init_from_target=False))
    assert losses(tmp_path / "first") == losses(tmp_path / "second")


@pytest.mark.parametrize("kind", ["conditioned", "block"])
def test_a_killed_run_resumes_at_the_same_step_with_the_same_losses(tmp_path, tiny_model_dir, store, monkeypatch,
                                                                    kind):
    """Uninterrupted 12 steps vs killed after step 7 (checkpoint every step) and resumed: the log is
    continuous and the resumed steps compute the same losses (same batches, anchors, noise, lr)."""
    import diffspec.training.run as run
    layers = dict(layers=1)
    train_drafter(request(tmp_path / "straight", tiny_model_dir, store, kind=kind, steps=12, **layers))
    real_lr_at, calls = run.lr_at, []

    def dying_lr_at(*a, **k):
        calls.append(1)
        if len(calls) == 8:
            raise Killed()
        return real_lr_at(*a, **k)
    monkeypatch.setattr(run, "lr_at", dying_lr_at)
    with pytest.raises(Killed):
        train_drafter(request(tmp_path / "killed", tiny_model_dir, store, kind=kind, steps=12, **layers))
    monkeypatch.setattr(run, "lr_at", real_lr_at)
    record = train_drafter(request(tmp_path / "killed", tiny_model_dir, store, kind=kind, steps=12, resume=True,
                                   **layers))
    rows = [json.loads(l) for l in open(tmp_path / "killed" / "train_log.jsonl")]
    assert record["steps"] == 12 and [r["step"] for r in rows] == list(range(1, 13))
    assert losses(tmp_path / "killed") == pytest.approx(losses(tmp_path / "straight"), abs=1e-4)


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


def test_bad_requests_are_named_before_the_model_loads(tmp_path, store, monkeypatch):
    from diffspec import DiffspecError
    import diffspec.target as target_module

    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the request was checked")
    monkeypatch.setattr(target_module.Target, "load", no_load)
    with pytest.raises(DiffspecError, match="not a diffspec token store"):
        train_drafter(request(tmp_path, "nowhere", tmp_path / "nope", steps=1))
    for bad, match in (({"steps": 0}, "must be positive"), ({"max_time": 0.0}, "must be positive"),
                       ({"max_tokens": -5}, "must be positive"), ({"epochs": 0.0}, "must be positive"),
                       ({"seq_len": 4}, "no room"), ({"slot_decay": 0.0}, "slot-decay"),
                       ({"kind": "eagle"}, "unknown drafter kind"), ({"kind": "block", "feature_cache": True}, "feature-cache"),
                       ({"data_fraction": 1.5}, "data-fraction"), ({"kind": "block", "off_path_slots": True}, "off-path"),
                       ({"objective": "corpus", "off_path_slots": True}, "off-path"),
                       ({"fc_init": "identity"}, "unknown --fc-init"), ({"kind": "block", "fc_init": "random"}, "fc-init"),
                       ({"init_from_target": False, "fc_init": "lowest-layer"}, "fc-init")):
        with pytest.raises(DiffspecError, match=match):
            train_drafter(request(tmp_path, "nowhere", store, **{"steps": 1, **bad}))


def test_default_target_layers_exist_for_any_depth():
    from diffspec.drafters.conditioned import default_target_layers

    assert default_target_layers(30) == [1, 14, 27]
    for depth in (1, 2, 3, 4):  # a one-layer target used to get layer 1, which it lacks
        assert all(0 <= i < depth for i in default_target_layers(depth))


@pytest.mark.parametrize("kind", ["conditioned", "block"])
def test_reduced_draft_vocabulary_drafts_only_its_tokens(tmp_path, tiny_model_dir, store, kind):
    record = train_drafter(request(tmp_path, tiny_model_dir, store, kind=kind, steps=10, draft_vocab=16, layers=1))
    assert record["draft_vocab"] == 16 and 0 < record["draft_vocab_coverage"] <= 1
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from diffspec import SamplingParams
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    target = Target(model, AutoTokenizer.from_pretrained(tiny_model_dir))
    drafter = load_drafter(tmp_path / "drafter")
    allowed = set((drafter.model.draft_token_ids if kind == "conditioned" else drafter.draft_token_ids).tolist())
    assert len(allowed) == 16
    engine = SpeculativeEngine(target, drafter, FixedPolicy(3))
    r = engine.generate([5, 6, 7, 8, 9], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(model, [5, 6, 7, 8, 9], 20, stop_ids=())
    drafter.begin(None)
    ctx = torch.tensor([5, 6, 7, 8, 9])
    if kind == "conditioned":
        drafter.observe(Target(model).forward(ctx[:-1], hidden_layers=drafter.target_layer_ids).hidden_states, 0)
    # one token at a time: the head runs in several chunks (rows 1, 1, 2), each scattered into the full vocabulary
    d = drafter.propose(ctx, FailFastPolicy(tau=0.0, n=1, n_max=3), 10, SamplingParams(temperature=1.0),
                        torch.Generator().manual_seed(0))
    assert set(d.tokens.tolist()) <= allowed
    outside = torch.ones(d.probs.shape[1], dtype=torch.bool)
    outside[list(allowed)] = False
    assert torch.all(d.probs[:, outside] == 0) and torch.allclose(d.probs.sum(-1), torch.ones(3, dtype=d.probs.dtype))


def test_block_kind_trains_and_reloads_losslessly(tmp_path, tiny_model_dir, store):
    train_drafter(request(tmp_path, tiny_model_dir, store, kind="block", steps=40, layers=1))
    log = losses(tmp_path)
    first, last = sum(log[:8]) / 8, sum(log[-8:]) / 8
    assert last < first, (first, last)
    meta = json.loads((tmp_path / "drafter" / "config.json").read_text())["diffspec"]
    assert meta["kind"] == "block-diffusion" and meta["block_size"] == 4
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    target = Target(model, AutoTokenizer.from_pretrained(tiny_model_dir))
    r = SpeculativeEngine(target, load_drafter(tmp_path / "drafter"), FixedPolicy(5)).generate(
        [5, 6, 7, 8, 9], max_new_tokens=20, stop_token_ids=[])
    assert r.token_ids == reference_greedy(model, [5, 6, 7, 8, 9], 20, stop_ids=())


@pytest.mark.parametrize("kind, steps", [("conditioned", 150), ("block", 60)])
def test_training_raises_held_out_acceptance_on_a_memorisable_target(tmp_path, memorisable_target_dir,
                                                                     memorisable_store, kind, steps):
    """The held-out check (evaluation.py on held-out store prompts) gives tau, accepted tokens per round of a
    block of 4, bonus counted: 1.0 = nothing accepted. On answers it can learn, a trained drafter must beat its
    untrained self by a clear margin (with lr ~0 it stays where it starts)."""
    taus = {}
    for lr in (1e-9, 1e-2):
        record = train_drafter(request(tmp_path / str(lr), memorisable_target_dir, memorisable_store, kind=kind,
                                       steps=steps, lr=lr, layers=2 if kind == "conditioned" else 1,
                                       batch_sequences=4, anchors=16))
        taus[lr] = record["held_out"]["overall"]["tau"]
    assert taus[1e-2] >= taus[1e-9] + 1.0, taus


def test_two_copy_mask_matches_the_drafting_layout():
    from diffspec.training.block import two_copy_mask
    m = two_copy_mask(4, 2)[0, 0]
    # clean positions 0..3 (blocks 0,0,1,1) then noisy 4..7
    assert m[1, :4].tolist() == [True, True, False, False] and not m[1, 4:].any()     # clean: block-causal
    assert m[6, :4].tolist() == [True, True, False, False]                           # noisy block 1 sees clean block 0
    assert m[6, 4:].tolist() == [False, False, True, True]                           # and itself, both ways
    assert m[4, :4].tolist() == [False] * 4 and m[4, 4:].tolist() == [True, True, False, False]


def test_block_loss_reports_slot1_accuracy_of_each_blocks_first_masked_position(tiny_model):
    """The progress bar's 'slot-1 acc' for block kind, recomputed position by position: labels are
    made to agree with the drafter's argmax in every other counted block, so the share is ~1/2; and
    a sequence's sums do not change when a second sequence shares its batch."""
    from diffspec.training.block import BlockDiffusionLoss, make_block_body, noise_batch, two_copy_mask

    model, mask_id = make_block_body(tiny_model, 1)
    T, B, start = 24, 4, 3
    tokens = torch.randint(0, mask_id, (T,), generator=torch.Generator().manual_seed(0))
    noisy, masked = noise_batch(tokens[None], B, mask_id, [7])
    y, masked1 = noisy[0], masked[0]
    with torch.no_grad():
        hidden = model.model(input_ids=torch.cat([tokens, y])[None], attention_mask=two_copy_mask(T, B),
                             position_ids=torch.arange(T).repeat(2)[None]).last_hidden_state[0]
    labels = torch.zeros(T, dtype=torch.long)
    firsts = []
    for b in range(0, T, B):
        p = next((i for i in range(b, b + B) if masked1[i] and i >= start), None)
        if p is not None and bool(masked1[p: b + B].all()):  # a draft's first token: the rest of the block unknown
            row = hidden[p - 1] if p % B == 0 else hidden[T + p - 1]
            top = int(model.lm_head(row).argmax())
            labels[p - 1] = top if len(firsts) % 2 == 0 else (top + 1) % mask_id
            firsts.append(p)
    loss = BlockDiffusionLoss(model, B, "target")
    with torch.no_grad():
        ce, weight, n, correct, count = loss(tokens[None], noisy, masked, torch.tensor([T]), torch.tensor([start]),
                                            labels[None])
        other = torch.randint(0, mask_id, (1, T), generator=torch.Generator().manual_seed(1))
        noisy2, masked2 = noise_batch(other, B, mask_id, [8])
        ce2, _, n2, correct2, count2 = loss(torch.cat([tokens[None], other]), torch.cat([noisy, noisy2]),
                                           torch.cat([masked, masked2]), torch.tensor([T, T]),
                                           torch.tensor([start, T]), torch.cat([labels[None], labels[None]]))
    assert len(firsts) >= 2 and int(n) == int(masked1[start:].sum()) and int(count) == len(firsts)
    assert int(correct) == (len(firsts) + 1) // 2
    assert (int(n2), int(correct2), int(count2)) == (int(n), int(correct), int(count))  # the second is all prompt
    assert float(ce2) == pytest.approx(float(ce), rel=1e-9)
    # a draft vocabulary without the first counted block's slot-1 label: that block has no slot 1 (its next
    # masked position is a slot-2 prediction and is never promoted), and every label outside is not trained
    dropped = int(labels[firsts[0] - 1])
    draft_ids = torch.tensor([t for t in range(mask_id) if t != dropped])
    with torch.no_grad():
        _, _, n3, _, count3 = BlockDiffusionLoss(model, B, "target", draft_ids)(
            tokens[None], noisy, masked, torch.tensor([T]), torch.tensor([start]), labels[None])
    assert int(n3) == sum(int(labels[i - 1]) != dropped for i in range(start, T) if masked1[i])
    assert int(count3) == sum(int(labels[p - 1]) != dropped for p in firsts) < len(firsts)


@pytest.mark.parametrize("kind", ["conditioned", "block"])
def test_two_gloo_processes_match_one_process(tmp_path, tiny_model_dir, store, kind):
    """`torchrun --nproc-per-node 2` (gloo on CPU): each rank computes half of every global batch and DDP
    averages the gradients; with the same global batch and seed the losses are the single process's."""
    import os
    import subprocess
    import sys

    common = ["--target", str(tiny_model_dir), "--data", str(store), "--kind", kind, "--steps", "6",
              "--batch-sequences", "4", "--block-size", "4", "--anchors", "8", "--seq-len", "64", "--layers", "1",
              "--lr", "3e-3", "--train-dtype", "float32", "--eval-prompts", "0", "--held-out", "8", "--epochs", "100"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "diffspec", "train-drafter", "--out", str(tmp_path / "two"), *common],
                         capture_output=True, text=True, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, "-m", "diffspec", "train-drafter", "--out", str(tmp_path / "one"), *common],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    rows = [json.loads(l) for l in open(tmp_path / "two" / "train_log.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), rel=1e-4, abs=1e-4)
    assert [r["tokens"] for r in rows] == [json.loads(l)["tokens"] for l in open(tmp_path / "one" / "train_log.jsonl")]
    assert json.loads((tmp_path / "two" / "training.json").read_text())["machine"]["processes"] == 2


def test_leaving_the_world_frees_ddp_first(tmp_path):
    """A DDP module in a reference cycle outlives the function that made it until the collector runs, and
    holds the process group: left to the interpreter's finalisation, gloo's threads were torn down there
    and a rank aborted at exit (SIGABRT, 9 of 40 two-rank runs on a loaded machine). A first DDP in a
    process lands in such a cycle (seen: its __init__ frame stayed referenced until a collection); here the cycle
    is made by hand, so the test does not depend on import order. leave_world collects before it
    destroys the group."""
    import gc
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from diffspec.training.distributed import World, leave_world, wrap

    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path / 'rendezvous'}")
    world = World(rank=0, size=2)  # "distributed" for wrap/leave_world; one real rank is enough here
    gc.disable()  # no automatic collection may do leave_world's job
    try:
        def train_a_step():
            module = wrap(torch.nn.Linear(4, 4), world)
            module(torch.randn(2, 4)).sum().backward()
            cycle = [module]
            cycle.append(cycle)
        train_a_step()
        assert any(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
        leave_world(world)
        assert not dist.is_initialized()
        assert not any(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()


def test_resume_with_other_settings_is_refused(tmp_path, tiny_model_dir, store):
    from diffspec import DiffspecError
    train_drafter(request(tmp_path, tiny_model_dir, store, steps=3))
    with pytest.raises(DiffspecError, match="batch_sequences was 2, now 4"):
        train_drafter(request(tmp_path, tiny_model_dir, store, steps=6, batch_sequences=4, resume=True))


def test_held_out_prompts_never_train_and_shares_are_nested(tmp_path, tiny_model_dir, corpus):
    """A store answered greedily and sampled holds two sequences per prompt: the held-out split is by
    prompt, so no held-out prompt is trained on; a smaller --data-fraction is a prefix of a larger one."""
    from types import SimpleNamespace
    from diffspec.training.distributed import World
    from diffspec.training.run import load_training_data
    from diffspec.training.store import build_store
    build_store(tmp_path / "two", Target.load(str(tiny_model_dir)), load_corpus(str(corpus)), max_new_tokens=12,
                max_prompt_tokens=48, batch_size=8, temperatures=(0.0, 0.7), progress=False)
    no_target = SimpleNamespace(tokenizer_fingerprint=None)
    split = {f: load_training_data(request(tmp_path, tiny_model_dir, tmp_path / "two", data_fraction=f, held_out=6),
                                   no_target, World(), None) for f in (0.5, 1.0)}
    train, held, _ = split[1.0]
    prompt = lambda s: tuple(s[0][: s[1]].tolist())
    assert len(held) >= 2 and len({prompt(s) for s in held}) == len(held)
    assert not {prompt(s) for s in held} & {prompt(s) for s in train}
    from collections import Counter
    assert max(Counter(prompt(s) for s in train).values()) == 2  # greedy and sampled answers of one prompt
    half, held_half, _ = split[0.5]
    assert [prompt(s) for s in held_half] == [prompt(s) for s in held]
    assert [s[0].tolist() for s in half] == [s[0].tolist() for s in train[: len(half)]] and len(half) < len(train)


def test_feature_cache_runs_the_target_once_per_sequence(tmp_path, tiny_model_dir, store, monkeypatch):
    import diffspec.training.run as run
    calls = []
    real = run.target_features
    monkeypatch.setattr(run, "target_features", lambda model, batch, layers, **kw: calls.append(batch.index.tolist())
                        or real(model, batch, layers, **kw))
    record = train_drafter(request(tmp_path, tiny_model_dir, store, epochs=2.0, feature_cache=True, batch_sequences=4))
    seen = [i for c in calls for i in c]
    assert record["epochs"] == pytest.approx(2.0) and sorted(seen) == sorted(set(seen))  # never twice
    assert len(seen) == record["train_sequences"]


def test_init_drafter_continues_from_a_trained_drafter(tmp_path, tiny_model_dir, store):
    """--init-drafter starts from a trained drafter's weights and shape at another block size: its first
    loss is below a fresh start's and its weights are the trained drafter's, the draft vocabulary is kept, and
    a shape asked for that differs from the drafter's is refused before the target loads."""
    from diffspec import DiffspecError
    first = train_drafter(request(tmp_path / "a", tiny_model_dir, store, steps=60, draft_vocab=24))
    train_drafter(request(tmp_path / "fresh", tiny_model_dir, store, steps=1, draft_vocab=24, block_size=6))
    cont = train_drafter(request(tmp_path / "b", tiny_model_dir, store, steps=1, block_size=6, lr=1e-12,
                                 init_drafter=str(tmp_path / "a" / "drafter")))
    assert cont["init_drafter"] == str(tmp_path / "a" / "drafter") and cont["init_tensors_from_target"] == 0
    assert cont["draft_vocab"] == 24 and cont["layers"] == first["layers"]
    a, b = (load_drafter(tmp_path / d / "drafter").model for d in ("a", "b"))
    assert torch.equal(a.draft_token_ids, b.draft_token_ids) and b.cfg.block_size == 6
    for (name, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):  # lr ~0: the weights are a's
        assert torch.allclose(p.float(), q.float(), atol=1e-3), name
    trained = losses(tmp_path / "a")
    assert losses(tmp_path / "b")[0] < losses(tmp_path / "fresh")[0], (trained[:3], trained[-3:])
    with pytest.raises(DiffspecError, match="--layers 3 differs from the drafter"):
        train_drafter(request(tmp_path / "c", tiny_model_dir, store, steps=1, layers=3,
                              init_drafter=str(tmp_path / "a" / "drafter")))
    with pytest.raises(DiffspecError, match="drafter folder not found"):
        train_drafter(request(tmp_path / "c", tiny_model_dir, store, steps=1, init_drafter=str(tmp_path / "none")))
    with pytest.raises(DiffspecError, match="applies to --kind conditioned"):
        train_drafter(request(tmp_path / "c", tiny_model_dir, store, steps=1, kind="block",
                              init_drafter=str(tmp_path / "a" / "drafter")))


def test_fc_init_passes_the_lowest_target_layer_through(tmp_path, tiny_model_dir, store):
    """--fc-init lowest-layer: fc maps the concatenated features [layer a; layer b; ...] to the features of the
    lowest layer exactly (whatever the order of target_layer_ids), the rest of fc starts at zero, and the run
    records it; `random` leaves fc as drawn (a seeded draw, so the two runs differ in fc only); lowest-layer is
    the default."""
    from diffspec.drafters.conditioned import ConditionedConfig, ConditionedDraftModel
    from diffspec.training.conditioned import pass_lowest_layer_through

    cfg = ConditionedConfig(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                            intermediate_size=16, num_target_layers=6, target_layer_ids=(3, 1, 5), vocab_size=20,
                            mask_token_id=0)
    model = ConditionedDraftModel(cfg)
    assert pass_lowest_layer_through(model) == 1
    features = torch.randn(5, 24)
    assert torch.equal(model.fc(features), features[:, 8:16])
    assert model.fc.weight[:, :8].abs().sum() == 0 and model.fc.weight[:, 16:].abs().sum() == 0

    runs = {}
    for fc_init in ("random", "lowest-layer"):
        record = train_drafter(request(tmp_path / fc_init, tiny_model_dir, store, steps=1, lr=1e-12, fc_init=fc_init))
        runs[fc_init] = load_drafter(tmp_path / fc_init / "drafter").model
        assert ("fc_init" in record) == (fc_init == "lowest-layer")
    default = train_drafter(request(tmp_path / "default", tiny_model_dir, store, steps=1, lr=1e-12))
    assert default["fc_init"].startswith("lowest-layer")
    h, lowest = runs["random"].cfg.hidden_size, runs["random"].cfg.target_layer_ids.index(min(runs["random"].cfg.target_layer_ids))
    passed = runs["lowest-layer"].fc.weight.float()
    assert torch.allclose(passed[:, lowest * h:(lowest + 1) * h], torch.eye(h), atol=1e-3)
    assert not torch.allclose(runs["random"].fc.weight.float(), passed, atol=1e-3)
    for (name, p), (_, q) in zip(runs["random"].state_dict().items(), runs["lowest-layer"].state_dict().items()):
        if not name.startswith("fc."):
            assert torch.allclose(p.float(), q.float(), atol=1e-3), name


@pytest.mark.parametrize("feature_cache", [False, True])
def test_distill_objective_trains_from_the_targets_own_distributions(tmp_path, tiny_model_dir, store, feature_cache):
    """--objective distill: the loss (cross-entropy against the target's top-32) falls, from the feature
    cache too; refused for the block kind."""
    from diffspec import DiffspecError
    record = train_drafter(request(tmp_path, tiny_model_dir, store, steps=60, objective="distill", draft_vocab=24,
                                  feature_cache=feature_cache))
    log = losses(tmp_path)
    assert sum(log[-10:]) / 10 < 0.9 * sum(log[:10]) / 10, (log[:3], log[-3:])
    assert record["request"]["objective"] == "distill"
    with pytest.raises(DiffspecError, match="distill applies to --kind conditioned"):
        train_drafter(request(tmp_path / "b", tiny_model_dir, store, steps=1, kind="block", objective="distill"))


def test_training_reads_a_corpus_store(tmp_path, tiny_model_dir, corpus):
    """A store of the corpus text itself (make-data --source corpus) trains like a generated one: the labels
    are the target's own choices over that text, and the loss falls."""
    from diffspec.training.store import build_corpus_store
    build_corpus_store(tmp_path / "c", Target.load(str(tiny_model_dir)), load_corpus(str(corpus)), progress=False)
    record = train_drafter(request(tmp_path / "run", tiny_model_dir, tmp_path / "c", steps=40))
    log = losses(tmp_path / "run")
    assert record["train_sequences"] > 0 and sum(log[-8:]) / 8 < sum(log[:8]) / 8, (log[:3], log[-3:])


def test_resume_compares_the_runs_shape_not_how_it_was_asked(tmp_path, tiny_model_dir, store):
    """No --layers and --layers 2 are the same run (the default is 2): the resume goes on; a checkpoint
    written before layers/draft_vocab became optional (it recorded 2 and 8192) resumes too."""
    train_drafter(request(tmp_path, tiny_model_dir, store, steps=3))
    record = train_drafter(request(tmp_path, tiny_model_dir, store, steps=5, layers=2, draft_vocab=8192, resume=True))
    assert record["steps"] == 5
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=False)
    assert ckpt["same_run"]["layers"] == 2 and ckpt["same_run"]["draft_vocab"] == 8192


def test_profile_steps_splits_steps_by_phase_and_leaves_the_losses_alone(tmp_path, tiny_model_dir, store):
    """--profile-steps: a lent GPU's run brings back where a step goes (the trainer missed its 10x there and the
    lease had no time left to profile it): a table with the loop's four phases and the operators under them."""
    from diffspec.training.step_profile import PHASES
    train_drafter(request(tmp_path / "plain", tiny_model_dir, store, steps=8, layers=1, init_from_target=False))
    train_drafter(request(tmp_path / "profiled", tiny_model_dir, store, steps=8, layers=1, init_from_target=False,
                          profile_steps=2))
    assert losses(tmp_path / "profiled") == losses(tmp_path / "plain")
    table = (tmp_path / "profiled" / "profile_steps.txt").read_text()
    assert "steps 4..5" in table and all(p[:40] in table for p in PHASES), table[:2000]
    summary = table.split("== by")[0]
    per_phase = {p: float(line.split()[-1]) for p in PHASES for line in summary.splitlines()
                 if line.strip().startswith(p[len("diffspec: "):])}
    assert set(per_phase) == set(PHASES) and all(ms > 0 for ms in per_phase.values()), summary
    assert "aten::mm" in table or "aten::addmm" in table or "aten::bmm" in table
    assert not (tmp_path / "plain" / "profile_steps.txt").exists()
    with pytest.raises(DiffspecError, match="--profile-steps must be 0 or more"):
        train_drafter(request(tmp_path / "bad", tiny_model_dir, store, steps=2, profile_steps=-1))


def test_a_run_shorter_than_its_profile_writes_the_steps_it_profiled(tmp_path, tiny_model_dir, store):
    train_drafter(request(tmp_path / "a", tiny_model_dir, store, steps=3, layers=1, init_from_target=False,
                          profile_steps=4))
    assert (tmp_path / "a" / "drafter" / "model.safetensors").is_file()
    assert not (tmp_path / "a" / "profile_steps.txt").exists()  # it ended in the warm-up: nothing profiled
    train_drafter(request(tmp_path / "b", tiny_model_dir, store, steps=5, layers=1, init_from_target=False,
                          profile_steps=4))
    assert "steps 4..5 (after 2 steps and a warm-up step; the run ended first)" in (
        tmp_path / "b" / "profile_steps.txt").read_text()


def test_a_run_whose_loss_stops_being_finite_fails_and_writes_no_drafter(tmp_path, tiny_model_dir, store, monkeypatch):
    """A NaN setting (--grad-clip nan: refused now, up front) made every weight NaN and the run still said 'done'
    and wrote the drafter. A loss that stops being finite, for any reason, now ends the run with an error naming
    the step; no drafter is written and the last checkpoint is the one before."""
    from diffspec import DiffspecError
    from diffspec.training import run

    with pytest.raises(DiffspecError, match="grad-clip must be > 0"):
        train_drafter(request(tmp_path / "nan", tiny_model_dir, store, steps=2, grad_clip=float("nan")))
    parts, calls = run._parts, []

    def poisoned(out):
        ce, *rest = parts(out)
        calls.append(1)
        return (ce * float("nan") if len(calls) == 3 else ce, *rest)

    monkeypatch.setattr(run, "_parts", poisoned)
    with pytest.raises(DiffspecError, match="diverged at step 3: the loss is not finite"):
        train_drafter(request(tmp_path / "run", tiny_model_dir, store, steps=5))
    assert not (tmp_path / "run" / "drafter" / "model.safetensors").exists()
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    assert ckpt["state"]["step"] == 2 and all(torch.isfinite(v).all() for v in ckpt["model"].values())


def test_an_out_that_is_a_file_is_refused_before_the_target_loads(tmp_path, store):
    from diffspec import DiffspecError

    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(DiffspecError, match="exists and is not a folder"):
        train_drafter(request(tmp_path / "notes.txt", "/no/such/model", store, steps=1))
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_a_second_run_into_a_runs_folder_without_resume_is_refused(tmp_path, tiny_model_dir, store):
    """Re-running train-drafter into a folder that holds a run started over and replaced its checkpoint and drafter
    (make-data and export-drafter refuse such a folder). Refused now, before the target loads; --resume continues."""
    from diffspec import DiffspecError

    train_drafter(request(tmp_path, tiny_model_dir, store, steps=2))
    before = (tmp_path / "drafter" / "model.safetensors").read_bytes()
    with pytest.raises(DiffspecError, match="holds a training run.*--resume continues it"):
        train_drafter(request(tmp_path, "/no/such/model", store, steps=4))
    assert (tmp_path / "drafter" / "model.safetensors").read_bytes() == before
    assert train_drafter(request(tmp_path, tiny_model_dir, store, steps=4, resume=True))["steps"] == 4
