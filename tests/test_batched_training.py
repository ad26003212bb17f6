"""The online batched trainer's step: one drafter forward over all anchors of all sequences equals
the per-sequence computation through the serving pass; anchors and batches are reproducible."""

import pytest
import torch
import torch.nn.functional as F

from conftest import make_model
from diffspec.drafters.conditioned import ConditionedConfig, ConditionedDraftModel
from diffspec.training.anchored import AnchoredLoss, AnchorLayout, anchored_block_states
from diffspec.training.batches import (epoch_batches, pad_batch, rank_share, sample_anchors, slot_weights,
                                       target_features)


def reference_sequence_parts(model, tokens, hidden, target_next, first_supervised, anchors, embed, head_w, decay,
                             greedy_path_only=False, hints=None):
    """One sequence, through the serving forward (ConditionedDraftModel.forward with the context's
    keys/values and a dense boolean mask): -> (sum of w * CE, sum of w). With greedy_path_only, slot k
    counts only where tokens a+1..a+k-1 are the target's own choices (checked one by one here). hints: per
    anchor, the tokens its block's first slots carry instead of masks (lookup hints)."""
    cfg = model.cfg
    B, T = cfg.block_size, tokens.shape[0]
    a = torch.tensor(anchors)
    ctx_len = max(anchors)
    ctx_pos = torch.arange(ctx_len)
    kv = model.context_keys_values(hidden[:ctx_len], ctx_pos)
    block = torch.full((len(anchors), B), cfg.mask_token_id, dtype=torch.long)
    block[:, 0] = tokens[a]
    for i, copy in enumerate(hints or []):
        block[i, 1: 1 + len(copy)] = torch.tensor(copy, dtype=torch.long)
    positions = (a[:, None] + torch.arange(B)).reshape(-1)
    sees_ctx = ctx_pos[None, :] < a.repeat_interleave(B)[:, None]
    block_id = torch.arange(len(anchors)).repeat_interleave(B)
    mask = torch.cat([sees_ctx, block_id[:, None] == block_id[None, :]], 1)
    out = model(embed(block.reshape(-1)), positions, kv, attn_mask=mask).view(len(anchors), B, -1)
    pos = a[:, None] + torch.arange(1, B)
    valid = pos < T
    if greedy_path_only:
        for i, anchor in enumerate(anchors):
            for k in range(2, B):
                if any(int(tokens[anchor + j]) != int(target_next[anchor + j - 1]) for j in range(1, min(k, T - anchor))):
                    valid[i, k - 1] = False
    labels = target_next[(pos.clamp(max=T - 1) - 1)]
    logits = out[:, 1:] @ head_w.T
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none").view_as(pos)
    w = slot_weights(B, decay).double() * valid
    return (ce * w).sum(), w.sum()


def test_batched_loss_equals_per_sequence_loss_fp64():
    torch.manual_seed(0)
    target = make_model(50, seed=3, layers=4, hidden=32)
    cfg = ConditionedConfig.for_target(target.config, mask_token_id=0, num_hidden_layers=2, block_size=5)
    model = ConditionedDraftModel(cfg).double()
    for p in model.parameters():  # non-trivial norms and projections
        torch.nn.init.normal_(p, std=0.3)
    embed, head_w = target.get_input_embeddings(), target.get_output_embeddings().weight.detach()
    g = torch.Generator().manual_seed(1)
    seqs = [(torch.randint(1, 50, (n,), generator=g), p) for n, p in ((23, 5), (11, 3), (17, 9))]
    batch = pad_batch(seqs, [0, 1, 2], pad_id=0)
    hidden, target_next = target_features(target, batch, cfg.target_layer_ids)
    anchors, valid = sample_anchors(batch, max_anchors=6, seed=0, epoch=0)
    assert int(valid.sum()) == 6 + 6 + 6  # every sequence has >= 6 supervised anchors
    parts = AnchoredLoss(model, "target", 3.0, greedy_path_only=False)(batch.tokens, batch.lengths, hidden, target_next,
                                                                      anchors, valid, embed.weight, head_w)
    ref_sum, ref_w = 0.0, 0.0
    for n, (ids, p) in enumerate(seqs):
        T = ids.shape[0]
        s, w = reference_sequence_parts(model, ids, hidden[n, :T], target_next[n, :T], p,
                                        anchors[n][valid[n]].tolist(), embed, head_w, 3.0)
        ref_sum, ref_w = ref_sum + s, ref_w + w
    assert abs(float(parts.weight) - float(ref_w)) < 1e-9
    assert abs(float(parts.weighted_ce / parts.weight) - float(ref_sum / ref_w)) < 1e-6
    # the gradient flows to the drafter, never to the frozen target
    (parts.weighted_ce / parts.weight).backward()
    assert model.fc.weight.grad is not None and float(model.fc.weight.grad.abs().sum()) > 0
    assert target.get_output_embeddings().weight.grad is None


def greedy_with_detours(target, prompt, length, detours, vocab, generator):
    """The target's own greedy continuation of `prompt` up to `length` tokens, except at the positions in
    `detours`, where a random token other than the target's choice is written (and greedy goes on from it)."""
    ids = prompt.clone()
    with torch.no_grad():
        while ids.shape[0] < length:
            choice = int(target(input_ids=ids[None]).logits[0, -1].argmax())
            if ids.shape[0] in detours:
                choice = (choice + int(torch.randint(1, vocab - 1, (1,), generator=generator))) % (vocab - 1) + 1
            ids = torch.cat([ids, torch.tensor([choice])])
    return ids


def detour_case(third_detours: set) -> tuple:
    """A fp64 drafter (non-trivial weights) over three greedy answers of a tiny target with detours at the
    given positions (the third's as asked) -> (target, cfg, model, embed, head_w, seqs, batch)."""
    torch.manual_seed(0)
    target = make_model(50, seed=3, layers=4, hidden=32).double()
    cfg = ConditionedConfig.for_target(target.config, mask_token_id=0, num_hidden_layers=2, block_size=6)
    model = ConditionedDraftModel(cfg).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    embed, head_w = target.get_input_embeddings(), target.get_output_embeddings().weight.detach()
    g = torch.Generator().manual_seed(5)
    seqs = [(greedy_with_detours(target, torch.randint(1, 50, (p,), generator=g), n, detours, 50, g), p)
            for n, p, detours in ((30, 4, {9, 16, 17}), (22, 3, {12}), (20, 5, third_detours))]
    return target, cfg, model, embed, head_w, seqs, pad_batch(seqs, [0, 1, 2], pad_id=0)


@pytest.mark.parametrize("objective", ["target", "distill"])
def test_off_path_slots_are_not_labels(objective):
    """On text that follows the target's greedy path with a few detours, the batched loss keeps slot k
    exactly where the data's tokens a+1..a+k-1 are the target's own choices (checked one by one by the
    serving-pass reference), drops the rest, and keeps every slot of a detour-free greedy answer."""
    from diffspec.training.batches import soft_labels
    target, cfg, model, embed, head_w, seqs, batch = detour_case(third_detours=set())
    hidden, target_next, (probs, index) = target_features(target, batch, cfg.target_layer_ids, top_k=50)
    anchors, valid = sample_anchors(batch, max_anchors=40, seed=0, epoch=0)  # every response anchor
    args = (batch.tokens, batch.lengths, hidden, target_next, anchors, valid, embed.weight, head_w)
    extra = (probs, index) if objective == "distill" else ()
    masked = AnchoredLoss(model, objective, 3.0)(*args, *extra)
    full = AnchoredLoss(model, objective, 3.0, greedy_path_only=False)(*args, *extra)
    ref_w, full_w = 0.0, 0.0
    for n, (ids, p) in enumerate(seqs):
        T, picked = ids.shape[0], anchors[n][valid[n]].tolist()
        ref_w += float(reference_sequence_parts(model, ids, hidden[n, :T], target_next[n, :T], p, picked, embed,
                                                head_w, 3.0, greedy_path_only=True)[1])
        full_w += float(reference_sequence_parts(model, ids, hidden[n, :T], target_next[n, :T], p, picked, embed,
                                                 head_w, 3.0)[1])
    assert abs(float(masked.weight) - ref_w) < 1e-9 and abs(float(full.weight) - full_w) < 1e-9
    assert int(masked.slots) < int(full.slots)       # the detours cost labels ...
    assert int(masked.slot1_count) == int(full.slot1_count)  # ... never slot 1
    if objective == "target":  # the loss over the kept slots is the serving pass's loss over them
        ref_sum = sum(float(reference_sequence_parts(model, ids, hidden[n, :ids.shape[0]], target_next[n, :ids.shape[0]],
                                                     p, anchors[n][valid[n]].tolist(), embed, head_w, 3.0,
                                                     greedy_path_only=True)[0]) for n, (ids, p) in enumerate(seqs))
        assert abs(float(masked.weighted_ce) - ref_sum) < 1e-6
    # the detour-free greedy answer (sequence 2) loses nothing
    only_greedy = valid.clone()
    only_greedy[:2] = False
    assert int(AnchoredLoss(model, objective, 3.0)(*args[:5], only_greedy, *args[6:], *extra).slots) == \
        int(AnchoredLoss(model, objective, 3.0, greedy_path_only=False)(*args[:5], only_greedy, *args[6:], *extra).slots)


def test_the_head_runs_on_supervised_rows_only_and_the_gradients_are_the_serving_pass_gradients():
    """Off-path slots carry no weight, so the step applies the LM head (its largest matmul) to the
    supervised rows only; the gradients equal those of the serving pass's loss over the kept slots."""
    target, cfg, model, embed, head_w, seqs, batch = detour_case(third_detours={8, 13})
    hidden, target_next = target_features(target, batch, cfg.target_layer_ids)
    anchors, valid = sample_anchors(batch, max_anchors=40, seed=0, epoch=0)

    head_rows = []

    class HeadRows(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__) and args[1].shape[-1] == 50:  # [rows, h] @ [h, V]
                head_rows.append(args[0].reshape(-1, args[0].shape[-1]).shape[0])
            return out

    with HeadRows():
        parts = AnchoredLoss(model, "target", 3.0)(batch.tokens, batch.lengths, hidden, target_next, anchors, valid,
                                                   embed.weight, head_w)
    in_blocks = int(valid.sum()) * (cfg.block_size - 1)
    assert head_rows == [int(parts.slots)] and int(parts.slots) < in_blocks * 0.8   # the detours cost rows
    (parts.weighted_ce / parts.weight).backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref_sum, ref_w = 0.0, 0.0
    for n, (ids, p) in enumerate(seqs):
        T = ids.shape[0]
        s, w = reference_sequence_parts(model, ids, hidden[n, :T], target_next[n, :T], p,
                                        anchors[n][valid[n]].tolist(), embed, head_w, 3.0, greedy_path_only=True)
        ref_sum, ref_w = ref_sum + s, ref_w + w
    (ref_sum / ref_w).backward()
    for (name, p), mine in zip(model.named_parameters(), got):
        assert torch.allclose(mine, p.grad, atol=1e-9, rtol=1e-7), name


def test_padding_never_changes_a_sequence_loss():
    """A sequence alone and the same sequence beside a longer one give the same sums."""
    target = make_model(50, seed=3, layers=4, hidden=32)
    cfg = ConditionedConfig.for_target(target.config, mask_token_id=0, num_hidden_layers=1, block_size=4)
    model = ConditionedDraftModel(cfg).double()
    embed, head_w = target.get_input_embeddings(), target.get_output_embeddings().weight.detach()
    g = torch.Generator().manual_seed(2)
    short, long = (torch.randint(1, 50, (9,), generator=g), 2), (torch.randint(1, 50, (30,), generator=g), 4)
    sums = []
    for seqs, idx in (([short], [7]), ([short, long], [7, 8])):
        batch = pad_batch(seqs, idx, pad_id=0)
        hidden, nxt = target_features(target, batch, cfg.target_layer_ids)
        anchors, valid = sample_anchors(batch, 5, seed=0, epoch=0)
        valid[1:] = False  # only the short sequence counts
        sums.append(AnchoredLoss(model, "target", 7.0)(batch.tokens, batch.lengths, hidden, nxt, anchors, valid,
                                                       embed.weight, head_w))
    assert abs(float(sums[0].weighted_ce) - float(sums[1].weighted_ce)) < 1e-9
    assert int(sums[0].slots) == int(sums[1].slots)


def test_anchors_are_response_positions_and_depend_only_on_the_sequence():
    g = torch.Generator().manual_seed(3)
    seqs = [(torch.randint(1, 50, (n,), generator=g), p) for n, p in ((40, 10), (12, 11), (25, 3))]
    a1, v1 = sample_anchors(pad_batch(seqs, [4, 5, 6], 0), 8, seed=1, epoch=2)
    for n, (ids, p) in enumerate(seqs):
        picked = a1[n][v1[n]]
        assert len(set(picked.tolist())) == picked.numel() == min(8, ids.shape[0] - 1 - (p - 1))
        assert int(picked.min()) >= p - 1 and int(picked.max()) < ids.shape[0] - 1
    # the same sequence (by index) draws the same anchors in another batch: ranks agree with one process
    a2, v2 = sample_anchors(pad_batch([seqs[2]], [6], 0), 8, seed=1, epoch=2)
    assert torch.equal(a2[0][v2[0]], a1[2][v1[2]])
    a3, v3 = sample_anchors(pad_batch([seqs[2]], [6], 0), 8, seed=1, epoch=3)
    assert not torch.equal(a3[0][v3[0]], a1[2][v1[2]])


def test_epoch_batches_cover_every_sequence_once_and_ranks_split_them():
    lengths = [5 + (i * 7) % 40 for i in range(103)]
    batches = epoch_batches(lengths, 4, seed=0, epoch=0)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(103))
    assert batches == epoch_batches(lengths, 4, seed=0, epoch=0)
    assert batches != epoch_batches(lengths, 4, seed=0, epoch=1)
    b = batches[0]
    assert sorted(rank_share(b, 0, 2) + rank_share(b, 1, 2)) == sorted(b)


def test_distill_loss_is_the_expected_cross_entropy_and_hard_labels_are_its_one_hot_case():
    """objective 'distill' = sum_k w_k * (-sum_j p_j log q_j) over the target's top K; with p one-hot on
    the target's argmax it is exactly the hard-label ('target') loss; with the real top-K it is the
    cross-entropy computed by hand from the drafter's logits."""
    from diffspec.training.batches import soft_labels
    torch.manual_seed(0)
    target = make_model(50, seed=3, layers=4, hidden=32)
    cfg = ConditionedConfig.for_target(target.config, mask_token_id=0, num_hidden_layers=1, block_size=4)
    model = ConditionedDraftModel(cfg).double()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.3)
    embed, head_w = target.get_input_embeddings().weight, target.get_output_embeddings().weight.detach()
    g = torch.Generator().manual_seed(4)
    seqs = [(torch.randint(1, 50, (n,), generator=g), p) for n, p in ((19, 4), (13, 2))]
    batch = pad_batch(seqs, [0, 1], pad_id=0)
    hidden, nxt, (probs, index) = target_features(target, batch, cfg.target_layer_ids, top_k=8)
    assert probs.shape == index.shape == (2, 19, 8) and torch.allclose(probs.sum(-1), torch.ones(2, 19))
    assert torch.equal(index[..., 0], nxt)  # the most likely token first: the hard label
    anchors, valid = sample_anchors(batch, 5, seed=0, epoch=0)
    args = (batch.tokens, batch.lengths, hidden.double(), nxt, anchors, valid, embed, head_w)
    hard = AnchoredLoss(model, "target", 3.0, greedy_path_only=False)(*args)
    one_hot = torch.zeros_like(probs, dtype=torch.float64)
    one_hot[..., 0] = 1.0
    distill = AnchoredLoss(model, "distill", 3.0, greedy_path_only=False)
    assert torch.allclose(distill(*args, one_hot, index).weighted_ce, hard.weighted_ce, rtol=0, atol=1e-9)
    soft = distill(*args, probs.double(), index)
    # by hand: every supervised slot's drafter log-probabilities at the target's top 8
    total = 0.0
    w = slot_weights(4, 3.0).double()
    for n in range(2):
        for a in anchors[n][valid[n]].tolist():
            block = torch.tensor([batch.tokens[n, a].item()] + [0] * 3)
            ctx = hidden[n, :a].double()[None]
            states = anchored_block_states(model, torch.nn.functional.embedding(block, embed).double()[None],
                                           AnchorLayout(torch.tensor([0]), torch.tensor([0]), torch.tensor([a]), 1, 1),
                                           ctx)
            logq = torch.log_softmax(states[0, 1:] @ head_w.double().T, -1)
            for k in range(1, 4):
                if a + k < int(batch.lengths[n]):
                    row = a + k - 1
                    total += float(w[k - 1] * -(probs[n, row].double() * logq[k - 1, index[n, row]]).sum())
    assert abs(float(soft.weighted_ce) - total) < 1e-6
    assert float(soft.weighted_ce) != pytest.approx(float(hard.weighted_ce))  # the soft labels do change the loss


def test_a_label_outside_the_draft_vocabulary_ends_the_path():
    """With a reduced draft vocabulary, slot k is a label only if the target's choices for slots 1..k are all
    draftable (a greedy verification never passes a token the drafter cannot propose) and on the path."""
    torch.manual_seed(0)
    target = make_model(50, seed=3, layers=4, hidden=32).double()
    g = torch.Generator().manual_seed(6)
    ids = greedy_with_detours(target, torch.randint(1, 50, (4,), generator=g), 26, set(), 50, g)
    batch = pad_batch([(ids, 4)], [0], pad_id=0)
    hidden, target_next = target_features(target, batch, (0, 1))
    common = sorted(set(target_next[0, 4:20].tolist()))
    assert len(common) >= 2
    undraftable = set(common[: len(common) // 2])
    cfg = ConditionedConfig.for_target(target.config, mask_token_id=0, num_hidden_layers=1, block_size=6,
                                       num_features=2, draft_vocab=50 - len(undraftable))
    model = ConditionedDraftModel(cfg).double()
    model.draft_token_ids.copy_(torch.tensor([t for t in range(50) if t not in undraftable]))
    anchors, valid = sample_anchors(batch, max_anchors=40, seed=0, epoch=0)
    embed, head_w = target.get_input_embeddings().weight, target.get_output_embeddings().weight.detach()
    parts = AnchoredLoss(model, "target", 3.0)(batch.tokens, batch.lengths, hidden, target_next, anchors, valid,
                                              embed, head_w)
    expected, T = 0, ids.shape[0]
    for a in anchors[0][valid[0]].tolist():
        for k in range(1, 6):
            if a + k >= T:
                break
            if any(int(target_next[0, a + j - 1]) in undraftable for j in range(1, k + 1)):
                break
            if any(int(ids[a + j]) != int(target_next[0, a + j - 1]) for j in range(1, k)):
                break
            expected += 1
    assert int(parts.slots) == expected
    loose = AnchoredLoss(model, "target", 3.0, greedy_path_only=False)(batch.tokens, batch.lengths, hidden,
                                                                       target_next, anchors, valid, embed, head_w)
    assert int(parts.slots) < int(loose.slots)
