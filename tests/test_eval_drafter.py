"""`diffspec eval-drafter` / diffspec.evaluation: known-answer drafters, the hidden-state feed, every
drafter kind through the public contract, the continuation cache, the CLI's refusals and its outputs.
Tiny random targets with injected prompts: no real model, no packaged prompt set."""

import json
import warnings

import pytest
import torch

from conftest import make_model
from diffspec import DiffspecError, PromptLookupDrafter, Target
from diffspec.cli import main
from diffspec.drafters import (AutoregressiveDrafter, BlockDiffusionConfig, BlockDiffusionDrafter, ConditionedConfig,
                               ConditionedDrafter, ConditionedDraftModel, MaskedDiffusionConfig, MaskedDiffusionDrafter)
from diffspec.drafters.base import Drafter, DrafterCapabilities, DraftBuilder
import diffspec.evaluation as evaluation
from diffspec.evaluation import (Continuation, anchor_positions, evaluate_drafter, leading_matches, lookup_silent_at,
                                 summarize_leads, write_health)

PROMPTS = {"humaneval": [[1, 5, 6, 7, 8, 5, 6, 7], [1, 9, 10, 11]], "mtbench": [[1, 20, 21, 22, 23, 24, 25]],
           "champ": [[1, 30, 31, 32, 33]]}


class OracleDrafter(Drafter):
    """Drafts the target's own greedy continuation of the context (full recomputation), optionally
    spoiling slot `wrong_slot` (1-based; 0 = every slot)."""

    name = "oracle"

    def __init__(self, model, vocab_size, wrong_slot=None):
        self.model, self.vocab_size, self.wrong_slot = model, vocab_size, wrong_slot

    @torch.inference_mode()
    def propose(self, context, policy, limit, sampling, generator):
        ids = context.tolist()
        builder = DraftBuilder()
        for k in builder.increments(policy, limit):
            for _ in range(k):
                tok = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(tok)
                slot = len(builder) + 1
                if self.wrong_slot == 0 or self.wrong_slot == slot:
                    tok = (tok + 1) % self.vocab_size
                builder.add(tok, 1.0)
        return builder.build(len(builder))


class HiddenRecorder(OracleDrafter):
    """An oracle that needs the target's hidden states: checks it has exactly those of positions < a."""

    name = "hidden-recorder"
    capabilities = DrafterCapabilities(needs_target_hidden_states=True)
    target_layer_ids = (0, 1)

    def __init__(self, model, vocab_size):
        super().__init__(model, vocab_size)
        self.reference = Target(model)
        self.calls = []

    def begin(self, prompt_ids):
        self.features = []
        self.seen = 0

    def observe(self, hidden, start):
        assert start == self.seen, (start, self.seen)  # in order, no gap, no repeat
        assert hidden.shape[0] > 0 and hidden.shape[1] == 2 * self.model.config.hidden_size
        self.features.append(hidden.clone())
        self.seen += hidden.shape[0]
        self.calls.append(("observe", start, hidden.shape[0]))

    def propose(self, context, policy, limit, sampling, generator):
        a = context.shape[0] - 1
        assert self.seen == a, (self.seen, a)  # exactly positions < a
        self.reference.reset()
        ref = self.reference.forward(context[:-1], hidden_layers=self.target_layer_ids).hidden_states
        assert torch.allclose(torch.cat(self.features), ref, atol=1e-9)
        self.calls.append(("propose", a))
        return super().propose(context, policy, limit, sampling, generator)


def run(drafter, target, tmp_path, **kw):
    kw = {"prompts": PROMPTS, "max_new_tokens": 24, "anchors_per_sequence": 4, "cache_dir": tmp_path / "cache", **kw}
    return evaluate_drafter(drafter, target, **kw)


def test_oracle_gets_every_slot_accepted(target, tiny_model, tokenizer, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not collapsed: no warning at all
        h = run(OracleDrafter(tiny_model, len(tokenizer)), target, tmp_path, block_size=6)
    assert [d.domain for d in h.domains] == ["code", "chat", "math"]
    for d in h.domains + (h.overall,):
        assert d.slot_acceptance == (1.0,) * 5 and d.tau == 6.0 and not d.collapsed
        assert d.leading_histogram == (0,) * 5 + (d.anchors,)
    assert h.overall.anchors == sum(d.anchors for d in h.domains) > 0
    assert h.overall.sequences == sum(d.sequences for d in h.domains)
    assert h.domain("code").sets == ("humaneval",) and not h.collapsed


def test_a_wrong_third_slot_stops_acceptance_there(target, tiny_model, tokenizer, tmp_path):
    h = run(OracleDrafter(tiny_model, len(tokenizer), wrong_slot=3), target, tmp_path, block_size=7)
    for d in h.domains + (h.overall,):
        assert d.slot_acceptance == (1.0, 1.0, 0.0, 0.0, 0.0, 0.0) and d.tau == 3.0


def test_an_always_wrong_drafter_collapses_with_a_warning(target, tiny_model, tokenizer, tmp_path):
    with pytest.warns(UserWarning) as caught:
        h = run(OracleDrafter(tiny_model, len(tokenizer), wrong_slot=0), target, tmp_path, block_size=5)
    assert "collapsed on code: tau 1.000 < 1.2" in str(caught[0].message)
    assert h.overall.tau == 1.0 and h.overall.slot_acceptance == (0.0,) * 4
    assert h.collapsed and all(d.collapsed for d in h.domains + (h.overall,))
    lines = [str(w.message) for w in caught if "collapsed" in str(w.message)]
    assert len(lines) == 4 and lines == h.warnings()  # code, chat, math, overall


def test_hidden_state_drafter_gets_exactly_the_positions_before_each_anchor(tiny_model, tokenizer, tmp_path):
    target = Target(tiny_model, tokenizer, name="tiny")
    drafter = HiddenRecorder(tiny_model, len(tokenizer))
    h = run(drafter, target, tmp_path, block_size=5, prompts={"humaneval": PROMPTS["humaneval"][:1]})
    proposes = [c for c in drafter.calls if c[0] == "propose"]
    assert len(proposes) == h.overall.anchors == 4
    assert drafter.calls[0] == ("observe", 0, len(PROMPTS["humaneval"][0]) - 1)  # the prompt but its last token
    assert h.overall.tau == 5.0


def conditioned(target, block_size=6):
    with torch.random.fork_rng():
        torch.manual_seed(4)
        cfg = ConditionedConfig.for_target(target.model.config, mask_token_id=3, num_hidden_layers=1,
                                           block_size=block_size, num_features=2)
        return ConditionedDrafter(ConditionedDraftModel(cfg).to(torch.float64))


def real_drafters(target, tokenizer, other_model):
    v = len(tokenizer)
    return {"conditioned": conditioned(target),
            "prompt-lookup": PromptLookupDrafter(),
            "block-diffusion": BlockDiffusionDrafter(make_model(v + 1, seed=3, std=0.5),
                                                     BlockDiffusionConfig(mask_token_id=v, block_size=8, sub_block_size=4)),
            "masked-diffusion": MaskedDiffusionDrafter(make_model(v + 1, seed=3, std=0.5),
                                                       MaskedDiffusionConfig(mask_token_id=v, steps=2)),
            "ar": AutoregressiveDrafter(other_model, tokenizer)}


def test_every_drafter_kind_runs_through_the_public_contract(target, tokenizer, other_model, tmp_path):
    for kind, drafter in real_drafters(target, tokenizer, other_model).items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # random drafters collapse
            h = run(drafter, target, tmp_path)
        expected_b = 6 if kind == "conditioned" else 16  # the drafter's round + 1, else 16
        assert h.block_size == expected_b, kind
        for d in h.domains + (h.overall,):
            p = d.slot_acceptance
            assert len(p) == expected_b - 1 and all(0 <= x <= 1 for x in p), kind
            assert all(a >= b for a, b in zip(p, p[1:])), kind
            assert d.tau == pytest.approx(1 + sum(p)) and d.anchors == sum(d.leading_histogram)


def test_conditioned_drafter_at_every_anchor(target, tmp_path):
    """Every anchor: features arrive one position at a time (the drafter raises on any gap or overlap)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        h = run(conditioned(target), target, tmp_path, anchors_per_sequence=None)
    conts = [c for s in PROMPTS for c in evaluation.cached_continuations(target, s, PROMPTS[s], 10, 24, tmp_path / "cache")]
    assert h.overall.anchors == sum(len(anchor_positions(c.prompt_len, len(c.ids), 6)) for c in conts) > 10


def test_continuations_are_cached_and_reused(target, tiny_model, tokenizer, tmp_path, monkeypatch):
    oracle = OracleDrafter(tiny_model, len(tokenizer))
    first = run(oracle, target, tmp_path, block_size=4)
    files = sorted((tmp_path / "cache").glob("*.json"))
    assert [f.name.split("-")[0] for f in files] == ["champ", "humaneval", "mtbench"]
    assert not list((tmp_path / "cache").glob(".*tmp"))  # written atomically: no leftovers
    monkeypatch.setattr(evaluation, "target_continuations", lambda *a, **k: pytest.fail("regenerated"))
    second = run(oracle, target, tmp_path, block_size=4)
    assert second.overall == first.overall
    with pytest.raises(pytest.fail.Exception, match="regenerated"):  # another length is another key
        run(oracle, target, tmp_path, block_size=4, max_new_tokens=20)


def test_default_cache_folder_follows_diffspec_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DIFFSPEC_CACHE", str(tmp_path))
    assert evaluation.eval_cache_dir() == tmp_path / "eval"


def test_pure_helpers():
    assert anchor_positions(5, 20, 4) == list(range(4, 17))
    assert anchor_positions(5, 20, 4, per_sequence=3) == [4, 10, 16]
    assert anchor_positions(5, 20, 4, per_sequence=1) == [4]
    assert anchor_positions(5, 7, 4) == []
    assert leading_matches([1, 2, 3], [1, 2, 4]) == 2 and leading_matches([], [1]) == 0
    h = summarize_leads("x", ("s",), [[0, 3], [1], []], 4)
    assert h.slot_acceptance == (2 / 3, 1 / 3, 1 / 3) and h.tau == 1 + 4 / 3 and h.sequences == 2
    assert h.leading_histogram == (1, 1, 0, 1)
    assert h.lookup_silent_anchors is None and h.lookup_silent_p1 is None  # not measured
    h = summarize_leads("x", ("s",), [[0, 3], [1], []], 4, silent_per_sequence=[[True, False], [True], []])
    assert (h.lookup_silent_anchors, h.lookup_silent_p1, h.lookup_silent_tau) == (2, 0.5, 1.5)
    h = summarize_leads("x", ("s",), [[0, 3]], 4, silent_per_sequence=[[False, False]])
    assert (h.lookup_silent_anchors, h.lookup_silent_p1, h.lookup_silent_tau) == (0, None, None)
    with pytest.raises(ValueError):  # a flag per anchor, no fewer
        summarize_leads("x", ("s",), [[0, 3]], 4, silent_per_sequence=[[True]])


def test_lookup_silence_is_where_the_context_has_no_earlier_match():
    # prompt 7 8 9 | answer 5 6 7 8 9 5 6: after "... 7 8" the bigram 7 8 was seen (followed by 9), after "5 6" at the
    # end too; after "9 5" nothing (5 never followed 9 before), after "8 9" the prompt's 8 9 has nothing after it
    cont = Continuation(ids=(7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 40, 41), prompt_len=3)
    anchors = list(range(2, 10))
    silent = lookup_silent_at(cont, anchors, 3)
    by_anchor = dict(zip(anchors, silent))
    assert by_anchor[6] is False and by_anchor[7] is False and by_anchor[9] is False  # ..7 8 | ..8 9 | ..5 6 recur
    assert by_anchor[2] is True and by_anchor[3] is True and by_anchor[4] is True  # nothing seen before


def test_the_drafter_is_scored_where_prompt_lookup_drafts_nothing(target, tiny_model, tokenizer, tmp_path):
    """The oracle is right everywhere, so also where lookup is silent; an always-wrong drafter nowhere; the
    anchors counted are lookup_silent_at's; prompt lookup itself is not scored beside itself."""
    right = run(OracleDrafter(tiny_model, len(tokenizer)), target, tmp_path, block_size=4, anchors_per_sequence=None)
    with pytest.warns(UserWarning):
        wrong = run(OracleDrafter(tiny_model, len(tokenizer), wrong_slot=0), target, tmp_path, block_size=4,
                    anchors_per_sequence=None)
    for h, p1 in ((right, 1.0), (wrong, 0.0)):
        o = h.overall
        assert 0 < o.lookup_silent_anchors <= o.anchors
        assert o.lookup_silent_p1 == p1 and o.lookup_silent_tau == (4.0 if p1 else 1.0)
        assert o.lookup_silent_anchors == sum(d.lookup_silent_anchors for d in h.domains)
    assert "where prompt lookup drafts nothing" in right.table()
    assert right.to_dict()["overall"]["lookup_silent_p1"] == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        itself = run(PromptLookupDrafter(), target, tmp_path, block_size=4)
    assert itself.overall.lookup_silent_anchors is None and "prompt lookup drafts nothing" not in itself.table()


@pytest.mark.filterwarnings("ignore:no anchors on")
def test_bad_library_arguments_are_named(target, tmp_path):
    for kw, match in (({"num_prompts": 0}, "--num-prompts"), ({"max_new_tokens": 1}, "--max-new-tokens"),
                      ({"block_size": 1}, "--block-size"), ({"anchors_per_sequence": 0}, "--anchors-per-sequence")):
        with pytest.raises(DiffspecError, match=match):
            run(PromptLookupDrafter(), target, tmp_path, **kw)
    with pytest.raises(DiffspecError, match="unknown dataset 'nope'"):
        evaluate_drafter(PromptLookupDrafter(), target, sets=["nope"])
    with pytest.raises(DiffspecError, match="no anchors"):
        run(PromptLookupDrafter(), target, tmp_path, max_new_tokens=2, block_size=8)


def test_health_json_and_png_are_written(target, tiny_model, tokenizer, tmp_path):
    h = run(OracleDrafter(tiny_model, len(tokenizer), wrong_slot=2), target, tmp_path, block_size=5)
    written = write_health(h, tmp_path / "out")
    assert [p.name for p in written] == ["health.json", "slot_acceptance.png"]
    data = json.loads((tmp_path / "out" / "health.json").read_text())
    assert data["block_size"] == 5 and set(data["domains"]) == {"code", "chat", "math"}
    assert data["overall"]["slot_acceptance"] == [1.0, 0.0, 0.0, 0.0] and data["overall"]["tau"] == 2.0
    assert (tmp_path / "out" / "slot_acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "p4" in h.table() and "overall" in h.table()


@pytest.fixture()
def no_model_loads(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(Target, "load", refuse)


@pytest.mark.parametrize("argv, message", [
    (["none"], "nothing to evaluate"),
    (["prompt-lookup", "--dataset", "humaneval", "nope"], "unknown dataset 'nope'"),
    (["prompt-lookup", "--num-prompts", "0"], "--num-prompts must be an integer >= 1"),
    (["prompt-lookup", "--max-new-tokens", "1"], "--max-new-tokens must be an integer >= 2"),
    (["prompt-lookup", "--block-size", "1"], "--block-size must be an integer >= 2"),
    (["prompt-lookup", "--anchors-per-sequence", "0"], "--anchors-per-sequence must be an integer >= 1"),
    (["./no/such/drafter"], "drafter folder not found"),
    (["/no/such/drafter"], "drafter folder not found"),
    (["ar:./no/such/model"], "drafter path not found"),
    (["conditionedd"], "unknown drafter 'conditionedd'"),
])
def test_cli_refuses_bad_input_before_loading_models(no_model_loads, capsys, argv, message):
    assert main(["eval-drafter"] + argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("diffspec: error: ") and message in err and len(err.strip().splitlines()) == 1


@pytest.mark.filterwarnings("ignore:drafter 'prompt-lookup")
def test_cli_runs_end_to_end_on_a_tiny_target(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DIFFSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(evaluation, "render_set_prompts", lambda target, s, n: PROMPTS[s][:n])
    rc = main(["eval-drafter", "prompt-lookup", "--model", str(tiny_model_dir), "--num-prompts", "1",
               "--max-new-tokens", "16", "--block-size", "4", "--out", str(tmp_path / "out"), "--json"])
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    data = json.loads(captured.out)
    assert data["block_size"] == 4 and data["num_prompts"] == 1 and len(data["overall"]["slot_acceptance"]) == 3
    assert (tmp_path / "out" / "health.json").is_file() and (tmp_path / "out" / "slot_acceptance.png").is_file()
    assert list((tmp_path / "cache" / "eval").glob("*.json"))
    rc = main(["eval-drafter", "prompt-lookup", "--model", str(tiny_model_dir), "--num-prompts", "1",
               "--max-new-tokens", "16", "--block-size", "4", "--dataset", "mtbench"])
    out = capsys.readouterr().out
    assert rc == 0 and out.splitlines()[1].split()[:2] == ["domain", "tau"] and "chat" in out
