"""Sliding-window targets (Gemma 2/3, Mistral): rollback stays exact past the window, and what
cannot be rolled back is refused by name. Tiny random Gemma 3 with a window of 6 tokens, so every
generation here runs far past it."""

import pytest
import torch
from transformers import Gemma3TextConfig, Gemma3ForCausalLM

from conftest import reference_greedy
from helpers import RandomDrafter
from diffspec import (AutoregressiveDrafter, FailFastPolicy, FixedPolicy, PromptLookupDrafter, SpeculativeEngine,
                      Target)
from diffspec.cache import RollbackError, check_rollback, new_cache, truncate_cache
from diffspec.errors import DiffspecError

WINDOW = 6
NEW = 24


def make_gemma(vocab: int, seed: int = 0, layers: int = 3) -> Gemma3ForCausalLM:
    """Layers: sliding, sliding, full (Gemma 3's pattern, shortened)."""
    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8,
                           sliding_window=WINDOW, sliding_window_pattern=3, max_position_embeddings=256,
                           initializer_range=0.3, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    model = Gemma3ForCausalLM(cfg).to(torch.float64).eval()
    model.generation_config.eos_token_id = 2
    return model


@pytest.fixture(scope="module")
def gemma(tokenizer):
    model = make_gemma(len(tokenizer))
    assert "sliding_attention" in model.config.layer_types and "full_attention" in model.config.layer_types
    return model


PROMPT = [5, 9, 13, 7, 22, 31, 8, 14, 40, 3, 17, 25, 5, 9, 13]  # longer than the window, with repeats


def test_rollback_past_the_window_equals_a_fresh_forward(gemma):
    ids = torch.tensor(PROMPT + [11, 12, 13, 14, 15, 16, 17, 18])
    fresh = gemma(ids.view(1, -1)).logits[0]
    t = Target(gemma)
    t.forward(ids[:10])
    for start in range(10, len(ids) - 1):  # one accepted token per round, each after a rejected 3-token draft
        out = t.forward(torch.cat([ids[start:start + 1], torch.tensor([50, 51, 52])]))
        assert torch.allclose(out.logits[0], fresh[start], atol=1e-10, rtol=0)
        t.truncate(start + 1)
    assert t.cache_len == len(ids) - 1
    last = t.forward(ids[-1:]).logits
    assert torch.allclose(last, fresh[-1:], atol=1e-10, rtol=0)


def test_rollback_beyond_what_the_window_holds_is_refused(gemma):
    cache = new_cache(gemma.config)
    with torch.inference_mode():
        gemma(torch.tensor([PROMPT]), past_key_values=cache, use_cache=True)
        truncate_cache(cache, len(PROMPT))  # trims the sliding layers back to their window
        with pytest.raises(RollbackError, match="sliding-window"):
            truncate_cache(cache, 3)


def test_greedy_equals_reference_past_the_window(gemma, tokenizer):
    """Prompt lookup, a random drafter (many rejections), an AR drafter with its own sliding cache,
    the target drafting for itself and a random conditioned drafter, under both policies: every
    output equals greedy recomputation from scratch, generated 3-4 windows past the prompt."""
    from diffspec.drafters import ConditionedConfig, ConditionedDrafter, ConditionedDraftModel

    target = Target(gemma, tokenizer)
    torch.manual_seed(3)
    cond = ConditionedDrafter(ConditionedDraftModel(ConditionedConfig.for_target(
        gemma.config, mask_token_id=3, block_size=4, num_features=2)).to(torch.float64))
    failfast = FailFastPolicy(tau=0.0, n=3, n_max=9)
    configs = [(PromptLookupDrafter(), failfast), (RandomDrafter(len(tokenizer), seed=2), FixedPolicy(4)),
               (AutoregressiveDrafter(make_gemma(len(tokenizer), seed=1)), failfast), (cond, FixedPolicy(3))]
    expected = reference_greedy(gemma, PROMPT, NEW, stop_ids=())
    for drafter, policy in configs:
        r = SpeculativeEngine(target, drafter, policy).generate(PROMPT, max_new_tokens=NEW, stop_token_ids=[])
        assert r.token_ids == expected, (drafter.name, policy.describe())
        assert r.drafted_tokens > r.accepted_tokens  # rejected drafts were really rolled back
    ar_self = SpeculativeEngine(target, AutoregressiveDrafter(gemma), FixedPolicy(5)).generate(
        PROMPT, max_new_tokens=NEW, stop_token_ids=[])
    assert ar_self.token_ids == expected and ar_self.accepted_tokens == ar_self.drafted_tokens > 0


def test_block_drafter_with_a_sliding_window_body_past_the_window(gemma, tokenizer):
    """A block-diffusion drafter whose body has sliding layers (a drafter trained for Gemma 3 copies
    its layer types) passes its own block-causal masks, which transformers applies as given: its
    cache keeps every position, so drafting goes on past the window (it crashed with a shape error)."""
    from diffspec.drafters import BlockDiffusionConfig, BlockDiffusionDrafter

    body = make_gemma(len(tokenizer) + 1, seed=4, layers=2)
    assert set(body.config.layer_types) == {"sliding_attention"}
    drafter = BlockDiffusionDrafter(body, BlockDiffusionConfig(mask_token_id=len(tokenizer), block_size=4,
                                                               sub_block_size=2))
    r = SpeculativeEngine(Target(gemma, tokenizer), drafter, FixedPolicy(5)).generate(
        PROMPT, max_new_tokens=NEW, stop_token_ids=[])
    assert r.token_ids == reference_greedy(gemma, PROMPT, NEW, stop_ids=()) and r.drafter_forward_passes > 0


def test_recurrent_state_models_are_refused_by_name():
    from transformers import Qwen3NextConfig

    cfg = Qwen3NextConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=64)
    with pytest.raises(DiffspecError, match="linear_attention.*cannot be rolled back"):
        check_rollback(cfg, name="model 'qwen3-next-tiny'")
    with pytest.raises(DiffspecError, match="cannot be rolled back"):
        new_cache(cfg)
