"""A conditioned drafter with lookup hints (`ConditionedConfig.lookup_hints`, `train-drafter --lookup-hints`):
its block's slots carry prompt lookup's copy from the context instead of masks. The hints are prompt lookup's
own draft, served and trained alike; the served pass reads them; the batched trainer's loss equals the
per-sequence one on hinted blocks; the setting survives a save and load; DFlash export refuses it; and the
engine's output stays the target's (greedy here and in test_diffusion_drafters; sampled in
test_engine_sampling)."""

import random

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model, reference_greedy
from diffspec import FixedPolicy, PromptLookupDrafter, SamplingParams, SpeculativeEngine, Target
from diffspec.checkpoint import load_drafter, save_drafter
from diffspec.dflash_format import export_dflash
from diffspec.dflash_layout import is_dflash_folder
from diffspec.drafters.conditioned import (ConditionedConfig, ConditionedDraftModel, ConditionedDrafter,
                                           hint_index, lookup_hint_slots)
from diffspec.errors import DiffspecError
from diffspec.training.anchored import AnchoredLoss
from diffspec.training.batches import pad_batch, sample_anchors, target_features
from test_batched_training import reference_sequence_parts


def repetitive(n: int, vocab: int, seed: int) -> list:
    """Token ids that repeat stretches of themselves (so prompt lookup copies often), with changes."""
    rng = random.Random(seed)
    ids = [rng.randrange(4, vocab) for _ in range(6)]
    while len(ids) < n:
        if rng.random() < 0.6:
            start = rng.randrange(0, len(ids) - 3)
            ids += ids[start: start + rng.randrange(3, 8)]
        else:
            ids.append(rng.randrange(4, vocab))
    return ids[:n]


def lookup_draft(ids: list, count: int) -> list:
    """What PromptLookupDrafter (no history) drafts after ids at a fixed length: the reference for the hints."""
    d = PromptLookupDrafter()
    d.begin(torch.tensor(ids[:1]))
    return d.propose(torch.tensor(ids), FixedPolicy(count), count, SamplingParams(), None).tokens.tolist()


def test_hints_are_prompt_lookups_draft_in_any_order():
    ids = repetitive(120, 30, seed=1)
    index, copied = hint_index(), 0
    for end in range(2, len(ids) + 1):  # one index over a growing context, as a request's rounds use it
        got = index.continuation(ids[:end], 5)
        assert got == lookup_draft(ids[:end], 5), end
        copied += bool(got)
    assert copied > 60  # the case really copies
    rows = [ids, repetitive(80, 30, seed=2)]
    seq, anchor = [1, 0, 0, 1, 0], [70, 90, 10, 5, 44]  # out of order: each sequence is still indexed once, rising
    slots = lookup_hint_slots(rows, seq, anchor, 6, fill=-7)
    for m, (n, a) in enumerate(zip(seq, anchor)):
        want = lookup_draft(rows[n][: a + 1], 5)
        assert slots[m].tolist() == want + [-7] * (5 - len(want))


def hinted(target_model, hints=True, block_size=5, seed=0):
    torch.manual_seed(seed)
    cfg = ConditionedConfig.for_target(target_model.config, mask_token_id=0, num_hidden_layers=2, block_size=block_size,
                                       num_features=2, lookup_hints=hints)
    model = ConditionedDraftModel(cfg).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return model


@torch.no_grad()
def test_the_served_pass_reads_prompt_lookups_copy_in_its_block():
    target_model = make_model(40, seed=3, layers=3)
    target = Target(target_model)
    model = hinted(target_model)
    drafter = ConditionedDrafter(model)
    drafter.attach(target)
    ids = torch.tensor(repetitive(60, 40, seed=3))
    hidden = target.forward(ids, hidden_layers=model.cfg.target_layer_ids).hidden_states
    target.reset()
    embed, head = target_model.get_input_embeddings(), target_model.get_output_embeddings().weight.detach()
    drafter.begin(ids[:1])
    seen, differ = 0, 0
    for a in range(8, 59, 3):
        drafter.observe(hidden[seen:a], seen)
        seen = a
        got = drafter.block_logits(ids[: a + 1])
        B = model.cfg.block_size
        copy = lookup_draft(ids[: a + 1].tolist(), B - 1)
        block = torch.tensor([int(ids[a])] + copy + [0] * (B - 1 - len(copy)))
        kv = model.context_keys_values(hidden[:a].double(), torch.arange(a))
        want = model(embed(block).double(), torch.arange(a, a + B), kv)[1:] @ head.double().T
        torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
        masks = torch.tensor([int(ids[a])] + [0] * (B - 1))
        differ += bool(copy) and not torch.allclose(got, model(embed(masks).double(), torch.arange(a, a + B), kv)[1:]
                                                    @ head.double().T)
    assert differ >= 5  # the copy was really in the block


@pytest.mark.parametrize("greedy_path_only", [False, True])
def test_batched_loss_on_hinted_blocks_equals_the_per_sequence_loss_fp64(greedy_path_only):
    torch.manual_seed(0)
    target = make_model(50, seed=3, layers=4, hidden=32)
    model = hinted(target, block_size=5)
    embed, head_w = target.get_input_embeddings(), target.get_output_embeddings().weight.detach()
    seqs = [(torch.tensor(repetitive(n, 50, seed=n)), p) for n, p in ((43, 5), (31, 3), (37, 9))]
    batch = pad_batch(seqs, [0, 1, 2], pad_id=0)
    hidden, target_next = target_features(target, batch, model.cfg.target_layer_ids)
    anchors, valid = sample_anchors(batch, max_anchors=12, seed=0, epoch=0)
    parts = AnchoredLoss(model, "target", 3.0, greedy_path_only=greedy_path_only)(
        batch.tokens, batch.lengths, hidden, target_next, anchors, valid, embed.weight, head_w)
    ref_sum, ref_w, hinted_blocks = 0.0, 0.0, 0
    for n, (ids, p) in enumerate(seqs):
        T, chosen = ids.shape[0], anchors[n][valid[n]].tolist()
        hints = [lookup_draft(ids[: a + 1].tolist(), model.cfg.block_size - 1) for a in chosen]
        hinted_blocks += sum(map(bool, hints))
        s, w = reference_sequence_parts(model, ids, hidden[n, :T], target_next[n, :T], p, chosen, embed, head_w, 3.0,
                                        greedy_path_only=greedy_path_only, hints=hints)
        ref_sum, ref_w = ref_sum + s, ref_w + w
    assert hinted_blocks >= 10
    assert abs(float(parts.weight) - float(ref_w)) < 1e-9
    assert abs(float(parts.weighted_ce / parts.weight) - float(ref_sum / ref_w)) < 1e-6


def test_a_hinted_drafter_is_lossless_and_its_setting_survives_a_save(tmp_path, target, tiny_model):
    model = hinted(tiny_model, block_size=6, seed=4)
    drafter = ConditionedDrafter(model)
    assert "prompt-lookup hints" in drafter.describe()
    prompt = [5, 6, 7, 5, 6, 7, 5, 6]
    r = SpeculativeEngine(target, drafter, FixedPolicy(5)).generate(prompt, max_new_tokens=40, stop_token_ids=[])
    assert r.token_ids == reference_greedy(tiny_model, prompt, 40, stop_ids=())
    path = save_drafter(drafter, tmp_path / "d", dtype=torch.float64)
    assert not is_dflash_folder(path)
    again = load_drafter(path, dtype=torch.float64)
    assert again.cfg.lookup_hints and again.cfg == drafter.cfg
    for k, v in drafter.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[k], v)
    with pytest.raises(DiffspecError, match="lookup hints"):
        export_dflash(drafter, tmp_path / "dflash", target)
    plain = ConditionedDrafter(hinted(tiny_model, hints=False))
    assert not load_drafter(save_drafter(plain, tmp_path / "p"), dtype=torch.float64).cfg.lookup_hints
    good = (path / "config.json").read_text()
    (path / "config.json").write_text(good.replace('"lookup_hints": true', '"lookup_hints": "yes"'))
    with pytest.raises(DiffspecError, match="lookup_hints must be true or false"):
        load_drafter(path)
    (path / "config.json").write_text(good.replace("n-grams 3 down to 2", "n-grams 4 down to 2"))
    with pytest.raises(DiffspecError, match="was trained with lookup hints from"):  # other hints than it learned
        load_drafter(path)


def test_the_engine_drafts_from_hinted_blocks(monkeypatch, target, tiny_model):
    """Through the engine (not only block_logits): the rounds build hinted blocks from the request's context, and a
    second, shorter request is hinted from its own context only."""
    from diffspec.drafters.prompt_lookup import NgramIndex

    seen, real = [], NgramIndex.continuation
    monkeypatch.setattr(NgramIndex, "continuation", lambda self, ids, count: seen.append(list(ids)) or real(self, ids, count))
    drafter = ConditionedDrafter(hinted(tiny_model, block_size=6, seed=4))
    engine = SpeculativeEngine(target, drafter, FixedPolicy(5))
    first, second = [5, 6, 7, 5, 6, 7, 5, 6] * 3, [9, 8, 9, 8]
    for prompt in (first, second):
        seen.clear()
        r = engine.generate(prompt, max_new_tokens=16, stop_token_ids=[])
        assert r.drafter_forward_passes == len(seen) > 0
        contexts = [prompt + r.token_ids[: len(ctx) - len(prompt)] for ctx in seen]
        assert seen == contexts  # every round's hints came from exactly the request's tokens so far
        assert any(real(hint_index(), ctx, 5) for ctx in seen)  # and some rounds had a copy to hint


def test_train_drafter_refuses_hints_for_the_block_kind_and_reads_the_flag():
    from diffspec.cli import build_parser
    from diffspec.training.run import TrainRequest, validate

    with pytest.raises(DiffspecError, match="--lookup-hints applies to --kind conditioned"):
        validate(TrainRequest(out="x", kind="block", lookup_hints=True, steps=1))
    parse = build_parser().parse_args
    assert [parse(["train-drafter", "--out", "x", *flag]).lookup_hints
            for flag in ([], ["--lookup-hints"], ["--no-lookup-hints"])] == [None, True, False]
