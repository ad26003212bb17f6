"""The drafter folder format: save/load round trips, presets for published layouts, names, errors."""

import json

import pytest
import torch

from conftest import make_model, reference_greedy
from test_diffusion_drafters import conditioned_for, dllm
from helpers import cli
from diffspec import DiffspecError, FailFastPolicy, FixedPolicy, SamplingParams, SpeculativeEngine, Target
from diffspec.checkpoint import load_drafter, save_drafter
from diffspec.drafter_names import make_drafter
from diffspec.drafters import BlockDiffusionConfig, BlockDiffusionDrafter, MaskedDiffusionConfig, MaskedDiffusionDrafter


def drafts(drafter, target, context, policy=None):
    drafter.attach(target)
    drafter.begin(None)
    if drafter.capabilities.needs_target_hidden_states:
        out = Target(target.model).forward(torch.tensor(context[:-1]), hidden_layers=drafter.target_layer_ids)
        drafter.observe(out.hidden_states, 0)
    return drafter.propose(torch.tensor(context), policy or FixedPolicy(5), 100, SamplingParams(), None)


def all_kinds(target, tokenizer):
    v = len(tokenizer)
    fp = target.tokenizer_fingerprint
    return {
        "block-diffusion": BlockDiffusionDrafter(dllm(v), BlockDiffusionConfig(mask_token_id=v, block_size=4,
                                                                               sub_block_size=2), fp),
        "masked-diffusion": MaskedDiffusionDrafter(dllm(v), MaskedDiffusionConfig(mask_token_id=v, steps=2), fp),
        "conditioned": conditioned_for(target),
    }


@pytest.mark.parametrize("kind", ["block-diffusion", "masked-diffusion", "conditioned"])
def test_save_load_round_trip_drafts_identically(tmp_path, target, tokenizer, kind):
    drafter = all_kinds(target, tokenizer)[kind]
    ctx = list(range(5, 19))
    before = drafts(drafter, target, ctx)
    path = save_drafter(drafter, tmp_path / kind, target_name="tiny", dtype=torch.float64)
    meta = json.loads((path / "config.json").read_text())["diffspec"]
    assert meta["kind"] == kind and meta["target"] == "tiny" and meta["format_version"] == 1
    assert (path / "model.safetensors").is_file()
    loaded = load_drafter(path, dtype=torch.float64)
    after = drafts(loaded, target, ctx)
    assert after.tokens.tolist() == before.tokens.tolist()
    assert torch.allclose(after.confidences, before.confidences)


def test_conditioned_folder_is_in_dflash_layout_without_target_weights(tmp_path, target):
    path = save_drafter(conditioned_for(target), tmp_path / "c")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["num_target_layers"] == target.num_layers
    assert set(cfg["dflash_config"]) == {"block_size", "mask_token_id", "target_layer_ids"}
    from safetensors.torch import load_file
    names = set(load_file(str(path / "model.safetensors")))
    assert "fc.weight" in names and "layers.0.self_attn.q_norm.weight" in names and "hidden_norm.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)  # shared with the target, never stored


def test_fp16_storage_loads_and_stays_lossless(tmp_path, target, tiny_model, tokenizer):
    path = save_drafter(all_kinds(target, tokenizer)["block-diffusion"], tmp_path / "b16")  # default fp16
    engine = SpeculativeEngine(target, load_drafter(path), FailFastPolicy())
    assert engine.generate([5, 6, 7, 5, 6], max_new_tokens=20).token_ids == reference_greedy(tiny_model, [5, 6, 7, 5, 6], 20)


def test_tokenizer_mismatch_refused_for_drafter_folder(tmp_path, target, tokenizer):
    v = len(tokenizer)
    d = BlockDiffusionDrafter(dllm(v), BlockDiffusionConfig(mask_token_id=v), tokenizer_fingerprint="0" * 16)
    path = save_drafter(d, tmp_path / "bad")
    with pytest.raises(DiffspecError, match="tokenizer mismatch"):
        SpeculativeEngine(target, load_drafter(path))


@pytest.mark.parametrize("bad", ["missing", "noconfig", "foreign", "badkind"])
def test_bad_drafter_folders_are_named(tmp_path, bad):
    p = tmp_path / bad
    if bad != "missing":
        p.mkdir()
    if bad == "foreign":
        (p / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if bad == "badkind":
        (p / "config.json").write_text(json.dumps({"diffspec": {"kind": "telepathy"}}))
    with pytest.raises(DiffspecError) as e:
        load_drafter(p)
    assert str(p) in str(e.value) or "not found" in str(e.value)


@pytest.mark.parametrize("preset, mask", [("fast-dllm-v2", 151665), ("dream", 151666)])
def test_published_layout_presets(tmp_path, preset, mask):
    """A tiny random checkpoint written in the published layout (Qwen2 config.json + safetensors)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = 151936
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp_path / preset)
    raw = json.loads((tmp_path / preset / "config.json").read_text())
    raw["architectures"] = ["Fast_dLLM_QwenForCausalLM" if preset == "fast-dllm-v2" else "DreamModel"]
    (tmp_path / preset / "config.json").write_text(json.dumps(raw))
    drafter = make_drafter(f"{preset}:{tmp_path / preset}")
    assert drafter.config.mask_token_id == mask
    if preset == "fast-dllm-v2":
        assert (drafter.config.block_size, drafter.config.sub_block_size, drafter.config.logit_shift) == (32, 8, True)
    target_model = make_model(vocab, seed=1, hidden=16, max_pos=512)
    target = Target(target_model)
    prompt = [100, 200, 300, 100, 200]
    r = SpeculativeEngine(target, drafter, FailFastPolicy()).generate(prompt, max_new_tokens=12, stop_token_ids=[])
    assert r.token_ids == reference_greedy(target_model, prompt, 12, stop_ids=())
    assert r.drafted_tokens > 0


@pytest.mark.parametrize("kind", ["block-diffusion", "masked-diffusion", "conditioned"])
def test_registered_names_without_weights_run_random_with_a_warning(target, tiny_model, kind):
    target.name = "tiny-without-shipped-weights"
    with pytest.warns(UserWarning, match="random weights"):
        drafter = make_drafter(kind, target, dtype=torch.float64)
    r = SpeculativeEngine(target, drafter, FailFastPolicy()).generate([5, 6, 7, 8], max_new_tokens=15)
    assert r.token_ids == reference_greedy(tiny_model, [5, 6, 7, 8], 15)


@pytest.mark.parametrize("kind", ["block-diffusion", "masked-diffusion", "conditioned"])
def test_cli_every_kind_with_failfast_matches_plain(tiny_model_dir, kind):
    base = json.loads(cli("generate", "w5 w6 w7", "--model", str(tiny_model_dir), "--json", "--drafter", "none",
                          "--max-new-tokens", "16").stdout)
    proc = cli("generate", "w5 w6 w7", "--model", str(tiny_model_dir), "--json", "--drafter", kind,
               "--policy", "failfast", "--max-new-tokens", "16")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["token_ids"] == base["token_ids"]
    assert out["stats"]["drafter_forward_passes"] > 0
    assert "random weights" in proc.stderr


def test_cli_drafter_folder(tiny_model_dir, tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM
    target = Target(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tokenizer)
    v = len(tokenizer)
    path = save_drafter(BlockDiffusionDrafter(dllm(v), BlockDiffusionConfig(mask_token_id=v),
                                              target.tokenizer_fingerprint), tmp_path / "folder")
    base = json.loads(cli("generate", "w5 w6", "--model", str(tiny_model_dir), "--json", "--drafter", "none",
                          "--max-new-tokens", "12").stdout)
    proc = cli("generate", "w5 w6", "--model", str(tiny_model_dir), "--json", "--drafter", str(path),
               "--max-new-tokens", "12")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == base["token_ids"]
    listing = cli("generate", "--list-drafters", "--model", str(tiny_model_dir)).stdout
    for name in ("block-diffusion", "masked-diffusion", "conditioned", "fast-dllm-v2:PATH", "dream:PATH"):
        assert name in listing


def test_fp16_storage_keeps_token_ids_exact(tmp_path, target):
    """Regression: the draft-vocabulary ids were cast to fp16 with the weights and lost precision above 2048."""
    from diffspec.drafters import ConditionedConfig, ConditionedDrafter, ConditionedDraftModel
    cfg = ConditionedConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            intermediate_size=64, num_target_layers=2, target_layer_ids=(0, 1), vocab_size=50000,
                            mask_token_id=3, draft_vocab=64)
    model = ConditionedDraftModel(cfg)
    ids = torch.arange(49000, 49064)  # not representable in fp16
    model.draft_token_ids.copy_(ids)
    path = save_drafter(ConditionedDrafter(model), tmp_path / "ids")  # fp16 weights by default
    assert torch.equal(load_drafter(path).model.draft_token_ids, ids)


def test_auto_takes_a_shipped_drafter_only_when_its_folder_says_default(tmp_path, monkeypatch):
    import json

    from diffspec import drafter_names
    from diffspec.drafter_names import default_drafter_name

    folder = tmp_path / "conditioned"
    folder.mkdir()
    monkeypatch.setattr(drafter_names, "shipped_drafter_path", lambda target, kind: folder if kind == "conditioned" else None)
    for flag, expected in ((None, "prompt-lookup"), (False, "prompt-lookup"), (True, "conditioned")):
        meta = {"kind": "conditioned"} if flag is None else {"kind": "conditioned", "default": flag}
        (folder / "config.json").write_text(json.dumps({"diffspec": meta}))
        assert default_drafter_name("some-target") == expected


def test_block_drafter_with_a_draft_vocabulary_keeps_it_through_a_round_trip(tmp_path, target, tokenizer):
    """The reduced head: the full head's logits on the draft ids, -inf elsewhere, in as many passes; the ids
    survive save/load; a folder that lost them or a bad id is named."""
    v = len(tokenizer)
    body = dllm(v)
    ids = torch.tensor(sorted({3, 5, 8, 13, 21, 34, v - 1}))
    config = BlockDiffusionConfig(mask_token_id=v, block_size=4, sub_block_size=2)
    full, reduced = (BlockDiffusionDrafter(body, config, target.tokenizer_fingerprint, draft_token_ids=d)
                     for d in (None, ids))
    ctx = list(range(5, 19))
    for d in (full, reduced):
        d.attach(target)
        d.begin(None)
        d._sync(ctx)
    block = ctx[12:] + [v] * 2
    wide, small = full._block_logits(block, [2, 3]), reduced._block_logits(block, [2, 3])
    assert small.dtype == wide.dtype == torch.float64  # a float64 drafter keeps float64 logits either way
    assert torch.allclose(small[:, ids], wide[:, ids], atol=1e-5)
    outside = torch.ones(small.shape[1], dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(small[:, outside]).all())
    assert full._passes == reduced._passes
    d = drafts(reduced, target, ctx, FixedPolicy(3))
    assert set(d.tokens.tolist()) <= set(ids.tolist())
    path = save_drafter(reduced, tmp_path / "block", dtype=torch.float64)
    meta = json.loads((path / "config.json").read_text())["diffspec"]
    assert meta["draft_vocab"] == len(ids)
    loaded = load_drafter(path, dtype=torch.float64)
    assert torch.equal(loaded.draft_token_ids.cpu(), ids)
    assert drafts(loaded, target, ctx, FixedPolicy(3)).tokens.tolist() == d.tokens.tolist()
    assert "draft vocabulary 7" in loaded.describe()
    (path / "draft_token_ids.safetensors").unlink()
    with pytest.raises(DiffspecError, match="draft_token_ids.safetensors"):
        load_drafter(path)
    with pytest.raises(DiffspecError, match="mask token"):
        BlockDiffusionDrafter(dllm(v), config, draft_token_ids=torch.tensor([1, v]))
    with pytest.raises(DiffspecError, match="distinct"):
        BlockDiffusionDrafter(dllm(v), config, draft_token_ids=torch.tensor([1, 1]))


def test_a_reduced_draft_vocabulary_is_refused_where_the_head_transforms_its_logits_otherwise():
    """The reduced head reproduces a softcap (Gemma 2/3); a head transform it does not know (Cohere's
    logit_scale) would silently lower acceptance, so such a model is refused by name."""
    from transformers import CohereConfig, CohereForCausalLM, Gemma2Config, Gemma2ForCausalLM

    small = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=2, head_dim=16)
    config = BlockDiffusionConfig(mask_token_id=39, block_size=4, sub_block_size=2)
    ids = torch.tensor([1, 2, 5, 7])
    torch.manual_seed(0)
    cohere = CohereForCausalLM(CohereConfig(**small, logit_scale=0.0625, tie_word_embeddings=False)).eval()
    with pytest.raises(DiffspecError, match=r"CohereForCausalLM\) transforms its logits"):
        BlockDiffusionDrafter(cohere, config, draft_token_ids=ids)
    cohere.logit_scale = 1.0  # an identity scale: nothing to reproduce
    assert torch.equal(BlockDiffusionDrafter(cohere, config, draft_token_ids=ids).draft_token_ids, ids)
    gemma = Gemma2ForCausalLM(Gemma2Config(**small, final_logit_softcapping=0.5, sliding_window=64,
                                           layer_types=["full_attention"])).eval()
    assert torch.equal(BlockDiffusionDrafter(gemma, config, draft_token_ids=ids).draft_token_ids, ids)


def _without(path, section, *keys):
    cfg = json.loads((path / "config.json").read_text())
    for k in keys:
        (cfg[section] if section else cfg).pop(k, None)
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("kind", ["block-diffusion", "conditioned"])
def test_a_folder_without_its_block_size_is_refused_not_defaulted(tmp_path, target, tokenizer, kind):
    """A folder whose config lost its block size loaded with a default one (16 for the conditioned kind, 32 for the
    block kind) and drafted blocks of a length it was never trained on: lossless, accepted far less, and nothing
    said why. It is refused by name, before any weight is read (the weights are gone here too)."""
    path = save_drafter(all_kinds(target, tokenizer)[kind], tmp_path / kind, dtype=torch.float64)
    if kind == "conditioned":
        _without(path, "dflash_config", "block_size")
        _without(path, None, "block_size")
    else:
        _without(path, "diffspec", "block_size", "sub_block_size")
    (path / "model.safetensors").unlink()
    with pytest.raises(DiffspecError, match="block_size"):
        load_drafter(path, dtype=torch.float64)


def test_block_settings_that_cannot_be_are_named_at_load(tmp_path, target, tokenizer):
    path = save_drafter(all_kinds(target, tokenizer)["block-diffusion"], tmp_path / "b", dtype=torch.float64)
    cfg = json.loads((path / "config.json").read_text())
    cfg["diffspec"]["sub_block_size"] = 3  # does not divide the block of 4
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DiffspecError, match="settings are not valid.*sub_block_size"):
        load_drafter(path, dtype=torch.float64)
    _without(path, "diffspec", "mask_token_id")
    with pytest.raises(DiffspecError, match="lacks mask_token_id"):
        load_drafter(path, dtype=torch.float64)


def test_the_preset_names_checked_before_torch_are_the_presets_loaded():
    from diffspec.checkpoint import PRESETS
    from diffspec.defaults import PRESET_NAMES

    assert set(PRESET_NAMES) == set(PRESETS)
