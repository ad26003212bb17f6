"""Bad input gets a clear error naming the problem: DiffspecError in Python, one line + exit 2 in the CLI."""

import subprocess
import sys

import pytest

from conftest import make_model, make_tokenizer
from helpers import cli
from diffspec import AutoregressiveDrafter, DiffspecError, FixedPolicy, SpeculativeEngine, Target


@pytest.fixture()
def engine(target):
    return SpeculativeEngine(target, None, FixedPolicy(4))


@pytest.mark.parametrize("prompt", ["", "   \n", []])
def test_empty_prompt(engine, prompt):
    with pytest.raises(DiffspecError, match="prompt is empty"):
        engine.generate(prompt)


@pytest.mark.parametrize("n", [0, -5, 1.5, True])
def test_bad_max_new_tokens(engine, n):
    with pytest.raises(DiffspecError, match="max_new_tokens"):
        engine.generate([5, 6], max_new_tokens=n)


def test_prompt_longer_than_context(tiny_model, tokenizer):
    engine = SpeculativeEngine(Target(tiny_model, tokenizer, max_context=8), None)
    with pytest.raises(DiffspecError, match="context of 8"):
        engine.generate(list(range(5, 15)))


def test_bad_token_ids(engine):
    with pytest.raises(DiffspecError, match="token ids"):
        engine.generate([5, 10**6])


@pytest.mark.parametrize("spec", ["/no/such/model", "./missing-model", "missing.gguf"])
def test_missing_model(spec):
    with pytest.raises(DiffspecError, match="not found"):
        Target.load(spec)


def test_tokenizer_mismatch_is_refused(target):
    other_tok = make_tokenizer(prefix="x")
    drafter = AutoregressiveDrafter(make_model(len(other_tok), seed=2), other_tok)
    with pytest.raises(DiffspecError, match="tokenizer mismatch"):
        SpeculativeEngine(target, drafter)


def cli_process(*args):
    return subprocess.run([sys.executable, "-m", "diffspec.cli", *args], capture_output=True, text=True, timeout=120)


def test_the_cli_as_a_process_errors_in_one_line_and_exits_2(tiny_model_dir):
    """The real entry point once (the other CLI tests run main() in this process: helpers.cli): bad input is one
    line on stderr and exit 2 from `python -m diffspec.cli`, no traceback."""
    proc = cli_process("generate", "w1", "--top-p", "0", "--model", str(tiny_model_dir))
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("diffspec: error:")]
    assert len(lines) == 1 and "top_p" in lines[0] and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, word", [
    (["generate", ""], "prompt is empty"),
    (["generate", "w1", "--temperature", "-1"], "temperature"),
    (["generate", "w1", "--top-p", "0"], "top_p"),
    (["generate", "w1", "--top-p", "1.5"], "top_p"),
    (["generate", "w1", "--max-new-tokens", "0"], "max_new_tokens"),
    (["generate", "w1", "--model", "/no/such/model"], "not found"),
    (["generate", "w1 " * 40, "--raw", "--max-context", "16"], "context"),
    (["generate", "w1", "--drafter", "nonsense"], "unknown drafter"),
    (["generate", "w1", "--policy", "failfast", "--recalibrate"], "--recalibrate does not apply to the failfast"),
    (["generate", "w1", "--gamma", "4"], "--gamma does not apply to the auto policy"),
    (["generate", "w1", "--policy", "fixed", "--tau", "0.3", "--n", "4"], "--tau, --n do not apply to the fixed"),
    (["generate", "w1", "--drafter", "prompt-lookup+none"], "each part of A+B"),
    (["generate", "w1", "--top-k", "5"], "--top-k only shapes sampling: under greedy decoding"),
    (["generate", "w1", "--top-p", "0.9", "--seed", "3"], "--top-p, --seed only shape sampling"),
])
def test_cli_errors_are_one_line_and_exit_2(tiny_model_dir, args, word):
    if "--model" not in args:
        args = args + ["--model", str(tiny_model_dir)]
    proc = cli(*args)
    assert proc.returncode == 2, proc.stderr
    lines = [l for l in proc.stderr.splitlines() if l.startswith("diffspec: error:")]
    assert len(lines) == 1 and word in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_help_and_bad_arguments_answer_before_torch_loads(tmp_path):
    """`diffspec --help`, each command's --help and the argument errors that need no model (sampling settings too,
    and bench's and make-data's settings) answer without importing
    torch or transformers (2.7-4.5 s of imports on a 2-core CPU before; ~0.15 s now): the package's names load on
    first use and the parser's choices and defaults live in defaults.py. Run in a fresh interpreter (this one has
    torch loaded)."""
    script = """
import contextlib, io, sys
from diffspec.cli import main
out = io.StringIO()
codes = []
for argv in (["--help"], ["generate", "--help"], ["bench", "--help"], ["train-drafter", "--help"], ["serve", "--help"],
             ["eval-drafter", "--help"], ["make-data", "--help"], ["profile", "--help"], ["export-drafter", "--help"],
             ["generate", ""], ["generate", "hi", "--gamma", "4"], ["generate", "hi", "--max-new-tokens", "0"],
             ["generate", "hi", "--temperature", "-1"], ["generate", "hi", "--top-p", "0"],
             ["generate", "hi", "--top-k", "-2"], ["generate", "hi", "--temperature", "0.7", "--seed", "-1"],
             ["bench", "--out", "b", "--temperature", "-1"], ["bench", "--out", "b", "--temperature", "0.7", "--seed", "-1"],
             ["bench", "--out", "b", "--threads", "0"], ["bench", "--temperature", "0.5"],
             ["make-data", "--out", "s", "--temperatures", "-1"], ["make-data", "--out", "s", "--max-new-tokens", "0"],
             ["make-data", "--out", "s", "--batch-size", "0"], ["make-data", "--out", "s", "--max-time", "0"],
             ["make-data", "--out", "s", "--decode-step", "graph"],
             ["generate", "hi", "--drafter", "/no/such/drafter"], ["generate", "hi", "--drafter", EMPTY],
             ["generate", "hi", "--drafter", "prompt-lookup+/no/such/drafter"], ["eval-drafter", EMPTY],
             ["generate", "hi", "--policy", "fixed", "--gamma", "-2"], ["generate", "hi", "--policy", "failfast", "--tau", "nan"],
             ["generate", "hi", "--policy", "failfast", "--n", "0"],
             ["generate", "hi", "--policy", "failfast", "--n", "20", "--n-max", "5"],
             ["generate", "hi", "--seed", "3"], ["bench", "--out", "b", "--seed", "3"]):
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            codes.append(main(argv))
        except SystemExit as e:
            codes.append(e.code)
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
print(out.getvalue())
print(codes, heavy)
"""
    empty = tmp_path / "not-a-drafter"  # a folder without config.json: was refused only after the target loaded
    empty.mkdir()
    script = script.replace("EMPTY", repr(str(empty)))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[0, 0, 0, 0, 0, 0, 0, 0, 0" + ", 2" * 26 + "] []", proc.stdout
    for words in ("drafter folder not found: /no/such/drafter", "not-a-drafter has no config.json"):
        assert proc.stdout.count(words) == 2, proc.stdout
    for words in ("--gamma must be an integer >= 0, got -2", "must be in [0, 1], got nan", "must be an integer >= 1, got 0",
                  "--n-max must be >= --n: got N 20, N_max 5", "--seed only shapes sampling: under greedy"):
        assert words in proc.stdout, proc.stdout


def test_the_package_names_load_on_first_use():
    import diffspec

    assert diffspec.Target is __import__("diffspec.target", fromlist=["Target"]).Target
    assert diffspec.api.DEFAULT_DRAFTER == "auto" and callable(diffspec.generate)  # a submodule, as before
    assert set(diffspec.__all__) <= set(dir(diffspec))
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        diffspec.nonsense


def test_cli_tokenizer_mismatch(tiny_model_dir, tmp_path):
    other_tok = make_tokenizer(prefix="x")
    make_model(len(other_tok), seed=2).save_pretrained(tmp_path)
    other_tok.save_pretrained(tmp_path)
    proc = cli("generate", "w1 w2", "--model", str(tiny_model_dir), "--drafter", f"ar:{tmp_path}")
    assert proc.returncode == 2 and "tokenizer mismatch" in proc.stderr and "Traceback" not in proc.stderr


class _Vocab:
    def __init__(self, vocab, special):
        self.vocab, self.all_special_tokens = vocab, special

    def get_vocab(self):
        return dict(self.vocab)


def test_tokenizer_fingerprint_is_the_vocabulary_alone():
    """Which tokens are called special changes between transformers versions for one GGUF (5.17
    names <|im_start|> EOS, 5.23 <|im_end|>); the ids a drafter emits do not."""
    from diffspec.target import tokenizer_fingerprint

    a = _Vocab({"<|im_start|>": 1, "<|im_end|>": 2, "x": 3}, ["<|im_start|>"])
    b = _Vocab({"<|im_start|>": 1, "<|im_end|>": 2, "x": 3}, ["<|im_start|>", "<|im_end|>"])
    c = _Vocab({"<|im_start|>": 1, "<|im_end|>": 3, "x": 2}, ["<|im_start|>"])
    assert tokenizer_fingerprint(a) == tokenizer_fingerprint(b)
    assert tokenizer_fingerprint(a) != tokenizer_fingerprint(c)


def test_system_message_without_a_chat_template_is_refused(tiny_model, tokenizer):
    """A base model (Gemma 3 270M) or --raw has no place for a system message: say so, never drop it."""
    import copy

    with pytest.raises(DiffspecError, match="system message needs the chat template.*raw"):
        Target(tiny_model, tokenizer).encode_prompt("hi", chat=False, system="be brief")
    bare = copy.deepcopy(tokenizer)
    bare.chat_template = None
    with pytest.raises(DiffspecError, match="has no chat template"):
        Target(tiny_model, bare, name="base").encode_prompt("hi", system="be brief")
    assert Target(tiny_model, bare).encode_prompt("w1 w2") == bare("w1 w2")["input_ids"]  # no template: raw


@pytest.mark.parametrize("kw, words", [(dict(policy="auto", gamma=4), "gamma does not apply to the auto policy"),
                                       (dict(policy="fixed", tau=0.3), "tau does not apply to the fixed policy"),
                                       (dict(policy="failfast", n=20, n_max=5), "must be >= --n"),
                                       (dict(policy="greedy"), "unknown policy 'greedy'")])
def test_the_python_api_refuses_a_policy_setting_it_would_ignore(kw, words, monkeypatch):
    """`diffspec.generate("hi", policy="auto", gamma=4)` ran, gamma silently unused (the CLI refused --gamma with
    auto by name). Refused now, before any model loads."""
    from diffspec import api

    monkeypatch.setattr(api, "load_target", lambda *a, **k: pytest.fail("loaded a model before the check"))
    monkeypatch.setattr(api, "_shared_target", lambda *a, **k: pytest.fail("loaded a model before the check"))
    with pytest.raises(DiffspecError, match=words):
        api.load_engine(model="/no/such/model", backend="transformers", **kw)


@pytest.mark.parametrize("max_context", [0, -1, 1])
def test_a_context_that_holds_no_new_token_is_refused_before_loading(max_context, monkeypatch):
    """--max-context 0 ran at the model's whole context and -1 failed after loading."""
    from diffspec import api

    monkeypatch.setattr(api, "_shared_target", lambda *a, **k: pytest.fail("loaded a model before the check"))
    with pytest.raises(DiffspecError, match=f"max_context .* must be >= 2.*got {max_context}"):
        api.load_engine(model="/no/such/model", backend="transformers", max_context=max_context)


def test_train_drafter_refuses_a_corpus_beside_a_store(tmp_path):
    """`--data STORE --corpus C` dropped --corpus (the store's prompts are its own): refused by name."""
    proc = cli("train-drafter", "--out", str(tmp_path / "run"), "--data", str(tmp_path / "store"), "--corpus",
               str(tmp_path / "c.jsonl"), "--steps", "1")
    assert proc.returncode == 2 and "--corpus applies without --data" in proc.stderr, proc.stderr


def test_a_system_message_with_no_place_is_refused_before_the_model_loads(tiny_model_dir, tmp_path, monkeypatch):
    """`generate --model gemma3-270m --system x` loaded the model and timed this machine's costs (80 s) before
    encode_prompt refused the system message. Now refused from the tokenizer alone, as encode_prompt words it."""
    import json
    import shutil

    from diffspec import api

    base = tmp_path / "base"  # the tiny model with its tokenizer's chat template taken out: a base model
    shutil.copytree(tiny_model_dir, base)
    (base / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((base / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (base / "tokenizer_config.json").write_text(json.dumps(config))
    loads = []

    def load_engine(*a, **k):
        loads.append(k)
        raise DiffspecError("the engine would load here")

    monkeypatch.setattr(api, "load_engine", load_engine)
    for args, words in ((["--model", str(base)], f"model '{base}' has no chat template"),
                        (["--model", str(tiny_model_dir), "--raw"], "the prompt goes in raw (--raw)")):
        proc = cli("generate", "w1", "--system", "be brief", *args)
        assert proc.returncode == 2, proc.stderr
        assert "a system message needs the chat template, but " + words in proc.stderr, proc.stderr
    assert loads == []
    # with a template the message is taken: the check lets it through to the engine
    proc = cli("generate", "w1", "--system", "be brief", "--model", str(tiny_model_dir))
    assert len(loads) == 1 and "the engine would load here" in proc.stderr, proc.stderr


def test_a_hub_id_that_cannot_be_fetched_is_refused_at_once_by_name(monkeypatch):
    """Offline (or the hub unreachable), a hub id not in the Hugging Face cache took transformers' retries, ~30 s,
    before its error; now one connection attempt decides, and the error names the model and why. A cached id never
    touches the network; HF_HUB_OFFLINE refuses without trying."""
    import socket
    import time

    import huggingface_hub
    from huggingface_hub import constants

    from diffspec import models

    attempts = []

    def unreachable(address, timeout=None):
        attempts.append((address, timeout))
        raise OSError("Network is unreachable")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    started = time.perf_counter()
    result = cli("generate", "hi", "--model", "someone/not-a-model", "--max-new-tokens", "2")
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "someone/not-a-model" in result.stderr and "cannot be reached" in result.stderr
    assert "Network is unreachable" in result.stderr
    assert time.perf_counter() - started < 10 and len(attempts) == 1 and attempts[0][1] <= 5

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(DiffspecError, match="HF_HUB_OFFLINE"):
        models.resolve_model_path("someone/not-a-model")
    assert len(attempts) == 1  # not tried
    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda repo, name: f"/cache/{repo}/{name}")
    assert models.resolve_model_path("someone/cached-model") == "someone/cached-model"  # cached: no network needed
    assert len(attempts) == 1
