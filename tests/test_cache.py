"""Rollback: after truncating the cache, continuing gives the same logits as a fresh forward."""

import torch

from diffspec import Target


def test_truncate_then_continue_equals_fresh_forward(tiny_model, tokenizer):
    ids = torch.tensor([5, 9, 13, 7, 22, 31, 8, 14, 40, 3, 17, 25])
    fresh = Target(tiny_model, tokenizer).forward(ids).logits
    t = Target(tiny_model, tokenizer)
    t.forward(ids[:8])
    t.forward(torch.tensor([50, 51, 52]))       # a rejected draft
    assert t.cache_len == 11
    t.truncate(8)                                # roll back to the accepted length
    assert t.cache_len == 8
    cont = t.forward(ids[8:]).logits
    assert torch.allclose(cont, fresh[8:], atol=1e-10, rtol=0)


def test_truncate_to_longer_length_is_a_noop_and_negative_is_refused(tiny_model):
    t = Target(tiny_model)
    t.forward(torch.tensor([1, 2, 3]))
    t.truncate(10)
    assert t.cache_len == 3
    try:
        t.truncate(-1)
    except ValueError:
        pass
    else:
        raise AssertionError("negative length accepted")


def test_hidden_states_of_chosen_layers(tiny_model):
    t = Target(tiny_model)
    ids = torch.tensor([4, 5, 6, 7])
    out = t.forward(ids, hidden_layers=(0, 1))
    ref = tiny_model(ids.view(1, -1), output_hidden_states=True).hidden_states
    assert out.hidden_states.shape == (4, 2 * tiny_model.config.hidden_size)
    assert torch.equal(out.hidden_states[:, : tiny_model.config.hidden_size], ref[1][0])
    assert torch.equal(out.hidden_states[:, tiny_model.config.hidden_size:], ref[2][0])
