"""The DFlash checkpoint layout against z-lab's reference package (PyPI `dflash` 0.1.0).

Needs `pip install --no-deps dflash==0.1.0` (scripts/setup.sh installs it): these tests import it
at module level on purpose, so CI fails instead of skipping when it is missing.

- export: a diffspec conditioned drafter -> DFlash folder -> the reference's from_pretrained
  drafts the same block (token ids equal, logits allclose) as diffspec's own pass;
- generation: the reference's dflash_generate == diffspec's engine == plain greedy;
- import: a folder written by the reference's save_pretrained loads in diffspec and drafts the
  same block; greedy (fixed, FailFast) and sampling (chi-square) stay the target's;
- what the layout cannot hold is refused with its name (reduced draft vocabulary, other kinds,
  DFlash features diffspec does not compute, another target).
"""

import json
import sys

import pytest
import torch
from dflash.model import DFlashDraftModel, dflash_generate, extract_context_feature  # required: see above
from transformers import Qwen3Config

from conftest import make_model, reference_greedy
from test_diffusion_drafters import conditioned_for
from helpers import cli
from diffspec import DiffspecError, FailFastPolicy, FixedPolicy, SamplingParams, SpeculativeEngine, Target
from diffspec.bench.specs import build_runner, parse_method
from diffspec.checkpoint import load_drafter, save_drafter
from diffspec.dflash_format import export_dflash, without_draft_vocab
from diffspec.dflash_layout import unsupported_features
from diffspec.drafter_names import make_drafter
from diffspec.drafters import (BlockDiffusionConfig, BlockDiffusionDrafter, ConditionedConfig, ConditionedDrafter,
                               ConditionedDraftModel)

CONTEXT = [5, 9, 13, 7, 22, 5, 9, 31, 40, 12, 8, 5]


def diffspec_block(drafter, target, context):
    """diffspec's own drafter pass for `context`: (tokens, logits) of the block after it."""
    drafter.attach(target)
    drafter.begin(None)
    out = Target(target.model).forward(torch.tensor(context[:-1]), hidden_layers=drafter.target_layer_ids)
    drafter.observe(out.hidden_states, 0)
    logits = drafter.block_logits(torch.tensor(context))
    return logits.argmax(-1), logits


def reference_block(ref, target_model, context):
    """The reference's drafter pass as dflash_generate makes it, for the same context."""
    with torch.inference_mode():
        out = target_model(torch.tensor([context[:-1]]), output_hidden_states=True)
        features = extract_context_feature(out.hidden_states, ref.target_layer_ids)
        block = torch.full((1, ref.block_size), ref.mask_token_id)
        block[0, 0] = context[-1]
        hidden = ref(target_hidden=features, noise_embedding=target_model.get_input_embeddings()(block),
                     position_ids=torch.arange(len(context) - 1 + ref.block_size)[None])
        logits = ref.compute_logits(hidden[:, 1:], target_model.lm_head)[0]
    return logits.argmax(-1), logits


def reference_model(path, dtype=torch.float64):
    return DFlashDraftModel.from_pretrained(str(path), dtype=dtype).eval()


def reference_generate(ref, target_model, prompt, n, stops=(2,)):
    out = dflash_generate(ref, target_model, torch.tensor([prompt]), n, list(stops))
    return out[0, len(prompt):].tolist()


def written_by_reference(path, target_model, layers=1, block_size=5, seed=3, mask=3):
    """A DFlash drafter made and saved by the reference package itself (random weights)."""
    c = target_model.config
    cfg = Qwen3Config(hidden_size=c.hidden_size, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                      intermediate_size=48, num_hidden_layers=layers, vocab_size=c.vocab_size, rms_norm_eps=1e-6,
                      max_position_embeddings=512, num_target_layers=c.num_hidden_layers, rope_theta=10000.0,
                      dflash_config={"block_size": block_size, "mask_token_id": mask,
                                     "target_layer_ids": list(range(c.num_hidden_layers))})
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).to(torch.float64)
    for p in model.parameters():  # larger weights: peakier drafts, so some get accepted
        p.data.normal_(0, 0.3) if p.dim() > 1 else None
    model.save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("layers, block_size", [(1, 6), (2, 4)])
def test_export_loads_in_the_reference_and_drafts_the_same_block(tmp_path, target, tiny_model, layers, block_size):
    drafter = conditioned_for(target, layers=layers, block_size=block_size)
    path = export_dflash(drafter, tmp_path / "d", target, dtype=torch.float64)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["diffspec"]["kind"] == "conditioned"
    assert cfg["dflash_config"]["mask_token"] == "<unk>"  # the mask id (3) as text, for SGLang
    assert cfg["block_size"] == cfg["dflash_config"]["block_size"] == block_size  # read at either place by engines
    assert cfg["rope_theta"] == cfg["rope_parameters"]["rope_theta"] == drafter.cfg.rope_theta  # vLLM defaults to 1e6
    ref = reference_model(path)
    assert (ref.block_size, ref.mask_token_id, list(ref.target_layer_ids)) == \
        (block_size, 3, list(drafter.cfg.target_layer_ids))
    for context in (CONTEXT, CONTEXT[:3], list(range(4, 60, 3))):
        ours, our_logits = diffspec_block(drafter, target, context)
        theirs, their_logits = reference_block(ref, tiny_model, context)
        assert ours.tolist() == theirs.tolist()
        assert torch.allclose(our_logits, their_logits, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("prompt", [[5, 6, 7, 8, 9, 10], [4, 4, 4, 4], [30]])
def test_reference_generate_equals_diffspec_equals_greedy(tmp_path, target, tiny_model, prompt):
    drafter = conditioned_for(target, block_size=5)
    path = export_dflash(drafter, tmp_path / "d", target, dtype=torch.float64)
    expected = reference_greedy(tiny_model, prompt, 40)
    assert reference_generate(reference_model(path), tiny_model, prompt, 40) == expected
    loaded = load_drafter(path, dtype=torch.float64)
    for policy in (FixedPolicy(4), FailFastPolicy(tau=0.3, n=2, n_max=4)):
        r = SpeculativeEngine(target, loaded, policy).generate(prompt, max_new_tokens=40)
        assert r.token_ids == expected and r.drafted_tokens > 0


def test_a_folder_saved_by_the_reference_loads_and_drafts_identically(tmp_path, target, tiny_model):
    ref = written_by_reference(tmp_path / "ref", tiny_model)
    drafter = load_drafter(tmp_path / "ref", dtype=torch.float64)
    assert drafter.cfg.block_size == 5 and drafter.cfg.draft_vocab == 0 and drafter.tokenizer_fingerprint is None
    for context in (CONTEXT, list(range(10, 50, 2))):
        ours, our_logits = diffspec_block(drafter, target, context)
        theirs, their_logits = reference_block(ref, tiny_model, context)
        assert ours.tolist() == theirs.tolist()
        assert torch.allclose(our_logits, their_logits, atol=1e-9, rtol=1e-9)
    expected = reference_greedy(tiny_model, CONTEXT, 30)
    for policy in (FixedPolicy(4), FailFastPolicy()):
        r = SpeculativeEngine(target, drafter, policy).generate(CONTEXT, max_new_tokens=30)
        assert r.token_ids == expected and r.drafted_tokens > 0
    sampled = SpeculativeEngine(target, drafter, FixedPolicy(4)).generate(
        CONTEXT, max_new_tokens=30, sampling=SamplingParams(temperature=0.8, seed=1))
    assert len(sampled.token_ids) > 0 and sampled.drafted_tokens > 0


def test_a_reference_drafter_samples_the_target_distribution(tmp_path):
    """Rejection sampling with an imported DFlash drafter's q: the chi-square test of test_engine_sampling."""
    from test_engine_sampling import SETTINGS, V, chi_square_pvalue, cpu_target, exact_joint, sample_counts

    model = make_model(V, seed=5, std=0.6)
    written_by_reference(tmp_path / "ref", model, block_size=4, mask=3)
    engine = SpeculativeEngine(cpu_target(model), load_drafter(tmp_path / "ref", dtype=torch.float64), FixedPolicy(3))
    params = SETTINGS["temperature"]
    assert chi_square_pvalue(sample_counts(engine, params, 2500), exact_joint(model, params)) > 1e-3


def reduced_vocab_drafter(target, size=20):
    torch.manual_seed(2)
    cfg = ConditionedConfig.for_target(target.model.config, mask_token_id=3, block_size=5, num_features=2,
                                       draft_vocab=size)
    model = ConditionedDraftModel(cfg).to(torch.float64)
    model.draft_token_ids.copy_(torch.arange(10, 10 + size))
    return ConditionedDrafter(model, name="reduced")


def test_a_reduced_draft_vocabulary_is_refused_by_name_or_dropped_on_request(tmp_path, target, tiny_model):
    drafter = reduced_vocab_drafter(target)
    saved = json.loads((save_drafter(drafter, tmp_path / "own") / "config.json").read_text())
    assert saved["architectures"] == ["DiffspecConditionedDraftModel"]  # not claimed to be a DFlash checkpoint
    with pytest.raises(DiffspecError, match=r"reduced vocabulary of 20 tokens.*--draft-vocab 0.*--full-vocab"):
        export_dflash(drafter, tmp_path / "refused", target)
    assert not (tmp_path / "refused").exists()
    path = export_dflash(drafter, tmp_path / "full", target, dtype=torch.float64, full_vocab=True)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["diffspec"]["draft_vocab"] == 0 and cfg["diffspec"]["draft_vocab_dropped"] == 20
    ours, _ = diffspec_block(without_draft_vocab(drafter), target, CONTEXT)
    theirs, _ = reference_block(reference_model(path), tiny_model, CONTEXT)
    assert ours.tolist() == theirs.tolist()


def test_other_drafter_kinds_are_refused(tmp_path, target, tokenizer):
    from test_diffusion_drafters import dllm

    v = len(tokenizer)
    block = BlockDiffusionDrafter(dllm(v), BlockDiffusionConfig(mask_token_id=v))
    with pytest.raises(DiffspecError, match="block-diffusion drafter"):
        export_dflash(block, tmp_path / "b", target)


@pytest.mark.parametrize("change, named", [
    ({"architectures": ["DFlash2DraftModel"]}, "DFlash 2"),
    ({"layer_types": ["sliding_attention"], "sliding_window": 4}, "sliding-window"),
    ({"dflash_config": {"block_size": 5, "mask_token_id": 3, "target_layer_ids": [0, 1], "causal": True}}, "causal"),
    ({"dflash_config": {"block_size": 5, "mask_token_id": 3, "target_layer_ids": [0, 1],
                        "final_logit_softcapping": 30.0}}, "softcapping"),
    ({"dflash_config": {"block_size": 5, "mask_token_id": 3, "target_layer_ids": [0, 1],
                        "input_embedding_scale": 2.0}}, "input_embedding_scale"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0}}, "RoPE type 'llama3'"),
    ({"dflash_config": {"block_size": 5, "target_layer_ids": [0, 1]}}, "no mask_token_id"),
])
def test_dflash_features_diffspec_does_not_compute_are_named(tmp_path, tiny_model, change, named):
    written_by_reference(tmp_path / "ref", tiny_model)
    cfg_file = tmp_path / "ref" / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg.update(change)
    cfg_file.write_text(json.dumps(cfg))
    assert unsupported_features(cfg)
    with pytest.raises(DiffspecError, match=named) as e:
        load_drafter(tmp_path / "ref")
    assert str(tmp_path / "ref") in str(e.value)


def test_a_dflash_drafter_for_another_target_is_refused(tmp_path, target):
    other = make_model(target.vocab_size, seed=2, layers=3)
    written_by_reference(tmp_path / "ref", other)
    with pytest.raises(DiffspecError, match="built for a target of 3 layers"):
        SpeculativeEngine(target, load_drafter(tmp_path / "ref", dtype=torch.float64))


def test_hub_ids_are_fetched_and_offline_is_one_line(tmp_path, target, tiny_model, monkeypatch):
    import huggingface_hub

    written_by_reference(tmp_path / "snap", tiny_model)
    asked = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download",
                        lambda repo, allow_patterns=None: asked.append((repo, allow_patterns)) or str(tmp_path / "snap"))
    drafter = make_drafter("someone/tiny-DFlash-b5", target, dtype=torch.float64)
    assert drafter.cfg.block_size == 5 and asked[0][0] == "someone/tiny-DFlash-b5"
    assert set(asked[0][1]) == {"config.json", "*.safetensors"}

    def offline(*_, **__):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nmore")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(DiffspecError, match=r"'someone/x' is not a local folder and could not be fetched.*OSError"):
        make_drafter("someone/x", target)


def test_cli_export_drafter(tiny_model_dir, tmp_path):
    out = tmp_path / "exported"
    proc = cli("export-drafter", "conditioned", "--model", str(tiny_model_dir), "--format", "dflash",
               "--out", str(out), "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert "random weights" in proc.stderr  # no trained weights for this target: said, as generate says it
    line = json.loads(proc.stdout)
    assert line["folder"] == str(out) and line["num_speculative_tokens"] == line["block_size"] - 1
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["diffspec"]["exported_from"] == "conditioned (random weights)"
    ref = reference_model(out, torch.float32)
    assert ref.block_size == line["block_size"]

    again = cli("export-drafter", "conditioned", "--model", str(tiny_model_dir), "--out", str(out))
    assert again.returncode == 2 and "not an empty folder" in again.stderr


def test_cli_export_refuses_a_reduced_vocabulary_unless_asked(tiny_model_dir, tmp_path, tokenizer):
    from transformers import AutoModelForCausalLM

    target = Target(AutoModelForCausalLM.from_pretrained(tiny_model_dir), tokenizer)
    drafter = reduced_vocab_drafter(target)
    drafter.tokenizer_fingerprint = target.tokenizer_fingerprint
    src = save_drafter(drafter, tmp_path / "src", target_name="tiny", training={"steps": 7})
    proc = cli("export-drafter", str(src), "--model", str(tiny_model_dir), "--out", str(tmp_path / "no"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "reduced vocabulary of 20 tokens" in proc.stderr
    proc = cli("export-drafter", str(src), "--model", str(tiny_model_dir), "--out", str(tmp_path / "yes"),
               "--full-vocab")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads((tmp_path / "yes" / "config.json").read_text())["diffspec"]
    assert meta["training"] == {"steps": 7} and meta["target"] == "tiny" and meta["exported_from"] == str(src)
    assert meta["draft_vocab_dropped"] == 20 and meta["tokenizer_fingerprint"] == target.tokenizer_fingerprint


def test_bench_dflash_ref_runs_the_reference_on_the_same_weights(tmp_path, target, tiny_model):
    from diffspec.bench import BenchConfig, run_bench

    path = export_dflash(conditioned_for(target, block_size=5), tmp_path / "d", target, dtype=torch.float64)
    runner, notes = build_runner(parse_method(f"dflash-ref:drafter={path}"), target)
    prompt = [5, 6, 7, 8, 9, 10]
    o = runner.run(prompt, 30, SamplingParams())
    assert list(o.token_ids) == reference_greedy(tiny_model, prompt, 30) and not notes
    assert o.target_forward_passes == len(o.rounds) + 1 == o.drafter_forward_passes + 1  # prefill, then rounds
    assert sum(e for _, _, e in o.rounds) == len(o.token_ids) - 1  # the prefill emits the first token
    assert o.mean_accepted_length == (len(o.token_ids) - 1) / len(o.rounds)
    assert o.rounds[0][0] == 4 and all(d <= 4 for d, _, _ in o.rounds) and o.draft_time_s > 0 and o.verify_time_s > 0
    assert "block 5" in runner.weights
    short, _ = build_runner(parse_method(f"dflash-ref:drafter={path},block_size=3"), target)  # its own knob
    o = short.run(prompt, 30, SamplingParams())
    assert list(o.token_ids) == reference_greedy(tiny_model, prompt, 30) and max(d for d, _, _ in o.rounds) == 2
    with pytest.raises(DiffspecError, match="block_size must be >= 2"):
        build_runner(parse_method(f"dflash-ref:drafter={path},block_size=1"), target)

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "prompt": f"w{i} w{i + 1} w{i + 2}"}) for i in range(2)))
    config = BenchConfig(dataset=str(prompts), num_prompts=2, max_new_tokens=16,
                         methods=(f"conditioned:drafter={path}", f"dflash-ref:drafter={path}"))
    result = run_bench(config, target, out=str(tmp_path / "out"))
    assert result.exit_code == 0 and not result.failures
    assert {r["method"] for r in result.rows} == {"plain", f"conditioned:drafter={path}", f"dflash-ref:drafter={path}"}


def test_bench_dflash_ref_exports_a_named_drafter_and_refuses_a_reduced_vocabulary(tmp_path, target):
    target.name = "tiny-without-shipped-weights"
    runner, notes = build_runner(parse_method("dflash-ref"), target)  # 'conditioned': random weights, said
    assert any("random weights" in n for n in notes)
    assert runner.run([5, 6, 7], 8, SamplingParams()).token_ids
    src = save_drafter(reduced_vocab_drafter(target), tmp_path / "reduced")
    with pytest.raises(DiffspecError, match="reduced vocabulary"):
        build_runner(parse_method(f"dflash-ref:drafter={src}"), target)


def test_bench_dflash_ref_without_the_package_says_how_to_install(target, monkeypatch):
    monkeypatch.setitem(sys.modules, "dflash.model", None)  # import dflash.model -> ImportError
    with pytest.raises(DiffspecError, match=r"pip install --no-deps dflash==0\.1\.0"):
        build_runner(parse_method("dflash-ref"), target)


@pytest.mark.slow
def test_reference_equals_diffspec_equals_greedy_on_smollm2(tmp_path):
    """SmolLM2-135M: the reference loop and the engine on the same exported weights, both = greedy."""
    import warnings

    from test_real_model import PROMPTS, hf_greedy

    smol = Target.load(None, quiet=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        shipped = make_drafter("conditioned", smol)
    candidates = {"shipped, full vocabulary": export_dflash(shipped, tmp_path / "s", smol, full_vocab=True)}
    smol.name = "no-shipped-weights"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        candidates["random"] = export_dflash(make_drafter("conditioned", smol), tmp_path / "r", smol)
    cases = [(ids, hf_greedy(smol, ids, 48)) for ids in (smol.encode_prompt(p) for p in PROMPTS[:2])]
    for what, path in candidates.items():
        ref = reference_model(path, torch.float32)
        drafter = load_drafter(path)
        # random: ~0 accepted, a 16-row verify a token, so 16 tokens (a prefix of greedy's 48) test it at a third
        # of the time (the test alone: 45 -> 36 s)
        n = 48 if what.startswith("shipped") else 16
        for ids, expected in cases if what.startswith("shipped") else cases[:1]:
            assert reference_generate(ref, smol.model, ids, n, sorted(smol.stop_token_ids)) == expected[:n], what
            for policy in (FixedPolicy(drafter.default_gamma), FailFastPolicy(n=4)):
                assert SpeculativeEngine(smol, drafter, policy).generate(ids, max_new_tokens=n).token_ids == expected[:n]


def test_shipped_folders_claim_the_dflash_architecture_only_when_they_are_exact():
    from pathlib import Path

    import diffspec

    for cfg_file in (Path(diffspec.__file__).parent / "weights").glob("*/conditioned/config.json"):
        cfg = json.loads(cfg_file.read_text())
        reduced = cfg["diffspec"].get("draft_vocab", 0) > 0
        assert cfg["architectures"] == (["DiffspecConditionedDraftModel"] if reduced else ["DFlashDraftModel"]), cfg_file
