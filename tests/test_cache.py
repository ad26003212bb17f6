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


def test_a_float16_store_keeps_rounded_keys_and_hands_the_passes_dtype_back():
    """A position-indexed layer holding float16 (`storage`, --kernels q8's cache): a pass's keys and values go in
    rounded to nearest even, `update` returns everything held in the pass's dtype (what a torch attention reads),
    growth keeps what is held, and a rollback is a length as before."""
    from diffspec.cache import PositionalLayer
    layer = PositionalLayer(4, storage=torch.float16)
    g = torch.Generator().manual_seed(0)
    k1, v1 = torch.randn(1, 2, 3, 8, generator=g), torch.randn(1, 2, 3, 8, generator=g)
    keys, values = layer.update(k1, v1)
    assert layer._keys.dtype == torch.float16 and keys.dtype == values.dtype == torch.float32
    assert torch.equal(keys, k1.half().float()) and torch.equal(values, v1.half().float())
    k2, v2 = torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g)  # past the capacity of 4
    keys, values = layer.update(k2, v2)
    assert layer.capacity >= 8 and torch.equal(keys, torch.cat([k1, k2], 2).half().float())
    layer.crop(-5)
    keys, _ = layer.update(k2[:, :, :1], v2[:, :, :1])
    assert keys.shape[2] == 4 and torch.equal(keys[:, :, 3], k2[:, :, 0].half().float())
