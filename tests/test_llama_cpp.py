"""The llama.cpp target backend (backends/llama_cpp.py): the target contract on a real GGUF, lossless
speculative decoding on it (greedy token for token against its own plain decoding; sampling by a
chi-square test), rollback at every acceptance length, and the refusals (a missing llama_cpp, settings
the backend would not honour, drafters it cannot feed, transformers-only bench methods)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from diffspec.backends import check_backend_settings, load_target
from diffspec.drafters import PromptLookupDrafter, make_drafter
from diffspec.engine import SpeculativeEngine
from diffspec.errors import DiffspecError
from diffspec.policies import make_policy
from diffspec.sampling import probs_from_logits
from diffspec.types import SamplingParams

from helpers import ScriptedDrafter

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number, with a docstring and an example.",
           "List three facts about the Moon, then repeat the list in reverse order."]
THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else None  # one core per xdist worker


# --- refusals (no model needed) ----------------------------------------------------------------
def test_missing_llama_cpp_names_the_extra(monkeypatch):
    from diffspec.backends import llama_cpp

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # `import llama_cpp` now raises ImportError
    with pytest.raises(DiffspecError, match=r"llama-cpp-python.*scripts/setup.sh"):
        llama_cpp.import_llama_cpp()
    assert not llama_cpp.available()
    with pytest.raises(DiffspecError, match="llama-cpp-python"):
        check_backend_settings("llama.cpp", None, torch.float32, "cpu")


def test_backend_settings_refused_by_name(tiny_model_dir):
    with pytest.raises(DiffspecError, match="unknown backend 'llamacpp'"):
        check_backend_settings("llamacpp", None, torch.float32, "cpu")
    with pytest.raises(DiffspecError, match="is not one"):  # a transformers folder is no GGUF file
        check_backend_settings("llama.cpp", str(tiny_model_dir), torch.float32, "cpu")
    with pytest.raises(DiffspecError, match="--dtype bfloat16 applies to the transformers backend"):
        check_backend_settings("llama.cpp", None, torch.bfloat16, "cpu")
    with pytest.raises(DiffspecError, match="--device cuda needs --backend transformers"):
        check_backend_settings("llama.cpp", None, torch.float32, "cuda")
    with pytest.raises(DiffspecError, match="model file not found"):
        check_backend_settings("llama.cpp", "/nonexistent/model.gguf", torch.float32, "cpu")


def test_auto_backend_keeps_transformers_for_a_folder(tiny_model_dir):
    target = load_target(str(tiny_model_dir), backend="auto", quiet=True)
    assert target.backend == "transformers"


def test_cli_refuses_before_loading(tiny_model_dir):
    proc = subprocess.run([sys.executable, "-m", "diffspec", "generate", "hi", "--backend", "llama.cpp",
                           "--model", str(tiny_model_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("diffspec: error: the llama.cpp backend runs GGUF files")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_transformers_only_bench_methods_refused_by_name():
    from diffspec.bench.methods import METHODS

    class Fake:
        backend, name = "llama.cpp", "fake"

    for name in ("hf-generate", "hf-prompt-lookup", "dflash-ref"):
        values = {p.name: p.default for p in METHODS[name].params}
        with pytest.raises(DiffspecError, match=f"method '{name}' runs the target's transformers model"):
            METHODS[name].build(Fake(), values)


# --- the real GGUF -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_target():
    from diffspec.backends.llama_cpp import LlamaCppTarget

    return LlamaCppTarget.load(None, quiet=True, threads=THREADS)


def plain_ids(target, prompt_ids, n):
    return SpeculativeEngine(target, None, make_policy("fixed", gamma=1)).generate(
        prompt_ids, max_new_tokens=n).token_ids


@pytest.mark.slow
def test_contract_matches_the_transformers_backend_text_side(llama_target):
    from diffspec.target import Target

    hf = Target.load(None, quiet=True)
    assert llama_target.backend == "llama.cpp" and not llama_target.exposes_hidden_states
    assert llama_target.vocab_size == hf.vocab_size
    assert llama_target.stop_token_ids == hf.stop_token_ids
    assert llama_target.tokenizer_fingerprint == hf.tokenizer_fingerprint
    for p in PROMPTS:
        assert llama_target.encode_prompt(p) == hf.encode_prompt(p)
        assert llama_target.encode_prompt(p, chat=False) == hf.encode_prompt(p, chat=False)


@pytest.mark.slow
def test_verify_rows_equal_one_token_steps(llama_target):
    """A pass of 17 tokens gives each row the logits 17 one-token passes give (bitwise): the kernels take
    the same path, so verification can never leave plain decoding's path."""
    t = llama_target
    ids = t.encode_prompt(PROMPTS[0])
    cont = list(plain_ids(t, ids, 24))
    seq = ids[-1:] + cont[:16]
    t.reset()
    t.forward(torch.tensor(ids[:-1]), logits=False)
    batched = t.forward(torch.tensor(seq)).logits
    t.truncate(len(ids) - 1)
    single = torch.cat([t.forward(torch.tensor([x])).logits for x in seq])
    assert batched.shape == single.shape == (17, t.vocab_size)
    assert torch.equal(batched, single)
    assert batched.argmax(-1).tolist() == cont[:17]


@pytest.mark.slow
def test_passes_of_64_rows_take_another_kernel_so_the_engine_verifies_fewer(llama_target):
    """From 64 query rows llama.cpp's CPU flash attention is tiled and its rows differ from one-token
    passes: the backend says so (max_verify_tokens = 63) and the engine never verifies wider, even when
    the drafter offers more; the output stays plain's."""
    t = llama_target
    ids = t.encode_prompt(PROMPTS[0])
    cont = list(plain_ids(t, ids, 140))
    seq = ids[-1:] + cont[:63]
    t.reset()
    t.forward(torch.tensor(ids[:-1]), logits=False)
    wide = t.forward(torch.tensor(seq + cont[63:64])).logits            # 65 rows: tiled
    t.truncate(len(ids) - 1)
    narrow = t.forward(torch.tensor(seq)).logits                        # 64 rows... also tiled
    t.truncate(len(ids) - 1)
    exact = t.forward(torch.tensor(seq[:63])).logits                    # 63 rows
    t.truncate(len(ids) - 1)
    single = torch.cat([t.forward(torch.tensor([x])).logits for x in seq])
    assert torch.equal(exact, single[:63])
    assert not torch.equal(wide[:64], single) and not torch.equal(narrow, single)
    assert t.max_verify_tokens == 63
    engine = SpeculativeEngine(t, ScriptedDrafter(ids + cont), make_policy("fixed", gamma=100), allow_inexact=True)
    got = engine.generate(ids, max_new_tokens=140)
    assert got.token_ids == cont
    assert max(r.drafted for r in got.rounds) == 62


@pytest.mark.slow
def test_rollback_at_every_acceptance_length(llama_target):
    """Verify k = 6 drafts, roll back to each acceptance length n, step on: the logits equal those of a
    cache that never held the rejected tokens."""
    t = llama_target
    ids = t.encode_prompt(PROMPTS[1])
    cont = list(plain_ids(t, ids, 12))
    wrong = [(c + 7) % t.vocab_size for c in cont]
    t.reset()
    t.forward(torch.tensor(ids[:-1]), logits=False)
    fresh = t.forward(torch.tensor(ids[-1:] + cont[:8])).logits  # row n predicts cont[n]
    c = len(ids) - 1
    for n in range(7):
        t.truncate(c)
        t.forward(torch.tensor(ids[-1:] + cont[:n] + wrong[n:6]))  # n accepted, 6 - n rejected
        t.truncate(c + 1 + n)
        assert t.cache_len == c + 1 + n
        row = t.forward(torch.tensor([cont[n]])).logits[0]
        assert torch.equal(row, fresh[n + 1]), f"rollback to {n} accepted drafts changed the next logits"
    with pytest.raises(ValueError):
        t.truncate(-1)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["fixed-4", "fixed-12", "failfast", "auto", "block-diffusion"])
def test_greedy_speculative_equals_plain(llama_target, method):
    t = llama_target
    if method == "block-diffusion":
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "random weights": intended here
            drafter = make_drafter("block-diffusion", t)
        policy = make_policy("fixed", gamma=6)
    else:
        drafter = PromptLookupDrafter()
        policy = {"fixed-4": lambda: make_policy("fixed", gamma=4), "fixed-12": lambda: make_policy("fixed", gamma=12),
                  "failfast": lambda: make_policy("failfast"), "auto": lambda: make_policy("auto")}[method]()
    engine = SpeculativeEngine(t, drafter, policy, allow_inexact=True)  # exact on these short contexts
    for p in PROMPTS[:1] if method == "block-diffusion" else PROMPTS:  # its random drafter costs more a round
        ids = t.encode_prompt(p)
        want = plain_ids(t, ids, 80)
        got = engine.generate(ids, max_new_tokens=80)
        assert got.token_ids == want
        if method.startswith("fixed"):
            assert got.drafted_tokens > 0  # speculation really ran


@pytest.mark.slow
def test_sampled_output_matches_the_backends_distribution(llama_target):
    """First two sampled tokens (top-k 3, T 1.2) against the exact joint from the backend's own logits.
    The drafter proposes from q = uniform over the target's top 3 at each position: it is accepted often
    and rejected often, so a wrong acceptance or recovery rule (which would pull the output towards q)
    fails the test."""
    t = llama_target
    params = SamplingParams(temperature=1.2, top_k=3)
    ids = t.encode_prompt("My favourite colour is", chat=False)  # short: each of the n requests prefills it

    def dist(prefix):
        t.reset()
        return probs_from_logits(t.forward(torch.tensor(prefix)).logits[-1:], params)[0].double()

    p1 = dist(ids)
    top1 = p1.nonzero().flatten().tolist()
    p2 = {a: dist(ids + [a]) for a in top1}
    exact = {(a, b): float(p1[a] * p2[a][b]) for a in top1 for b in p2[a].nonzero().flatten().tolist()}

    class TopThreeUniform(ScriptedDrafter):
        """Drafts 2 tokens, each from uniform over the target's top 3 at that position."""
        from diffspec.drafters.base import DrafterCapabilities
        capabilities = DrafterCapabilities(gives_probabilities=True)

        def __init__(self):
            self.gen = torch.Generator().manual_seed(7)

        def propose(self, context, policy, limit, sampling, generator):
            from diffspec.drafters.base import DraftBuilder

            b = DraftBuilder()
            if len(context) != len(ids) or limit < 2:  # drafts only the first round
                return b.build(0)
            q1 = torch.zeros(t.vocab_size, dtype=torch.float64)
            q1[top1] = 1 / 3
            a = top1[int(torch.randint(3, (1,), generator=self.gen))]
            b.add(a, 1 / 3, q1)
            support = p2[a].nonzero().flatten().tolist()
            q2 = torch.zeros(t.vocab_size, dtype=torch.float64)
            q2[support] = 1 / len(support)
            b.add(support[int(torch.randint(len(support), (1,), generator=self.gen))], 1 / len(support), q2)
            return b.build(0)

    engine = SpeculativeEngine(t, TopThreeUniform(), make_policy("fixed", gamma=2), allow_inexact=True)
    n = 400
    counts = {k: 0 for k in exact}
    accepted = 0
    for i in range(n):
        sp = SamplingParams(params.temperature, params.top_p, params.top_k, seed=500 + i)
        r = engine.generate(ids, max_new_tokens=3, sampling=sp, stop_token_ids=[])
        counts[tuple(r.token_ids[:2])] += 1
        accepted += r.accepted_tokens
    keys = sorted(exact)
    obs = np.array([counts[k] for k in keys], dtype=float)
    exp = np.array([exact[k] for k in keys]) * n
    assert 0.2 * n < accepted < 1.8 * n  # both acceptance and rejection were exercised
    assert chisquare(obs, exp / exp.sum() * obs.sum()).pvalue > 1e-3
    # the test has power: the same counts reject the drafter's own joint (uniform over the top 3 x top 3)
    assert chisquare(obs, np.full(len(keys), obs.sum() / len(keys))).pvalue < 1e-3


@pytest.mark.slow
def test_speculation_refused_until_exact(llama_target):
    """Speculative output left plain's path on long contexts (README, issue 18): a drafter is refused by
    name, plain decoding runs, and `auto` keeps transformers."""
    from diffspec.backends import choose_backend

    with pytest.raises(DiffspecError, match="not exact yet.*--drafter none"):
        SpeculativeEngine(llama_target, PromptLookupDrafter(), make_policy("fixed", gamma=4))
    assert SpeculativeEngine(llama_target, None).generate("Hi", max_new_tokens=4).token_ids
    assert choose_backend(None, torch.float32, "cpu", None, quiet=True) == "transformers"


@pytest.mark.slow
def test_drafters_needing_hidden_states_are_refused_by_name(llama_target):
    with pytest.raises(DiffspecError, match="needs the target's hidden states and weights, which the llama.cpp backend"):
        make_drafter("conditioned", llama_target)
    # `auto` leaves the conditioned kind out on this backend
    assert "conditioned" not in make_drafter("auto", llama_target, combine=True).describe()


@pytest.mark.slow
def test_bench_runs_the_llama_cpp_peer_beside_the_engine(llama_target, tmp_path):
    from diffspec.bench import BenchConfig, run_bench

    refused = BenchConfig(dataset="humaneval", num_prompts=1, max_new_tokens=24, methods=("plain", "prompt-lookup"),
                          quiet=True)
    with pytest.raises(DiffspecError, match="not exact yet"):
        run_bench(refused, llama_target)
    config = BenchConfig(dataset="humaneval", num_prompts=1, max_new_tokens=24, methods=("plain", "llama.cpp"),
                         quiet=True)
    result = run_bench(config, llama_target, out=str(tmp_path))
    by = {r["method"]: r for r in result.rows}
    assert not result.failures
    assert by["plain"]["backend"] == "llama.cpp" and by["llama.cpp"]["backend"].startswith("llama.cpp (its own loop)")
    # the peer (its own loop and prefill layout) is compared with plain, not judged; on a short answer it agrees
    assert by["llama.cpp"]["lossless"] is None and by["plain"]["lossless"] is True
    assert by["llama.cpp"]["first_difference"] is None and by["llama.cpp"]["token_ids"] == by["plain"]["token_ids"]
    assert result.settings["target_backend"] == "llama.cpp"


@pytest.mark.slow
def test_verify_cost_table_on_the_backend(llama_target):
    from diffspec.costs import measure_verify_costs

    table = measure_verify_costs(llama_target, ks=(0, 1, 4), contexts=(32,), reps=1)
    assert table.ks == (0, 1, 4) and len(table.verify_s[0]) == 3
    assert all(a <= b for a, b in zip(table.verify_s[0], table.verify_s[0][1:]))
    assert llama_target.cache_len == 0
