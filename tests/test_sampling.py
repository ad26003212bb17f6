import pytest
import torch

from diffspec import DiffspecError, SamplingParams
from diffspec.sampling import filter_logits, probs_from_logits


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0, 0.0]])
    x = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.isfinite(x).tolist() == [[False, True, True, False, False]]


def test_top_p_keeps_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    x = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.isfinite(x).tolist() == [[True, True, False, False]]  # 0.5 + 0.3 reaches 0.8
    x = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.isfinite(x).tolist() == [[True, True, True, False]]
    x = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.1))
    assert torch.isfinite(x).tolist() == [[True, False, False, False]]  # the top token always stays


def test_temperature_sharpens_and_flattens():
    logits = torch.tensor([[2.0, 1.0, 0.0]])
    cold = probs_from_logits(logits, SamplingParams(temperature=0.5))
    hot = probs_from_logits(logits, SamplingParams(temperature=2.0))
    base = torch.softmax(logits, -1)
    assert cold[0, 0] > base[0, 0] > hot[0, 0]
    assert torch.allclose(cold.sum(-1), torch.ones(1))


@pytest.mark.parametrize("kwargs, word", [({"temperature": -0.1}, "temperature"), ({"top_p": 0.0}, "top_p"),
                                          ({"top_p": 1.5}, "top_p"), ({"top_k": -1}, "top_k"),
                                          ({"temperature": float("nan")}, "temperature"), ({"seed": -3}, "seed")])
def test_invalid_sampling_values_are_named(kwargs, word):
    with pytest.raises(DiffspecError, match=word):
        SamplingParams(**kwargs)
