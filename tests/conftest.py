"""Tiny random models and tokenizers built in fixtures: no downloads, seconds on CPU.

Models run in float64 so that a k-token verify pass and one-token decoding agree exactly.
"""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Two workers share two cores. OpenMP threads that wait by spinning (the default) take the other
    # worker's core: llama.cpp's two-thread tests ran 3-10x slower beside a busy worker (179 s against 62
    # with passive waiting, benchmarks/results/issue15_test_suite/omp_wait_policy_amx.txt). Read by the
    # OpenMP runtime when it loads, so before torch is imported. Tests only: a process alone keeps spinning.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from tokenizers import Tokenizer, models, pre_tokenizers, decoders

from diffspec import Target

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]


def make_tokenizer(n_words: int = 60, prefix: str = "w") -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    for i in range(n_words):
        vocab[f"{prefix}{i}"] = len(vocab)
    for word in ("system", "user", "assistant"):
        vocab.setdefault(word, len(vocab))
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tk.decoder = decoders.WordPiece(prefix="##")  # joins tokens with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", pad_token="<pad>", eos_token="<|im_end|>",
                                  additional_special_tokens=["<|im_start|>"])
    tok.chat_template = CHATML
    return tok


def make_model(vocab_size: int, seed: int = 0, layers: int = 2, hidden: int = 32, std: float = 0.3,
               dtype=torch.float64, max_pos: int = 256) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=max_pos, initializer_range=std, eos_token_id=2,
                      bos_token_id=1, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = 2
    return model


def pytest_configure(config):
    """Under pytest-xdist each worker has one core: one thread from the start, fixtures included.
    Cost tables timed during tests (the auto policy's) go to a folder of this run, never to the
    user's cache: timings taken while tests share the cores would mislead later runs."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)
    if not os.environ.get("DIFFSPEC_COST_CACHE"):
        import tempfile

        os.environ["DIFFSPEC_COST_CACHE"] = tempfile.mkdtemp(prefix="diffspec-test-costs-")
        os.environ.setdefault("DIFFSPEC_PLAN_REPS", "1")  # plans timed once each: they stay in this run's folder
        os.environ.setdefault("DIFFSPEC_CALIBRATION_REPS", "1")  # verify costs likewise (llama.cpp's: 38 s at 3)


@pytest.fixture(autouse=True)
def one_thread(request):
    """Tiny models run on one thread: their matmuls are smaller than thread synchronisation costs, and
    on a busy 2-core machine two threads made a tiny forward ~10x slower (96 vs 12 ms). Tests marked
    slow (real weights) keep torch's default, except under pytest-xdist (`-n 2`, the README's
    command): there each worker has one core, and a second thread would only fight the other worker."""
    if request.node.get_closest_marker("slow") and not os.environ.get("PYTEST_XDIST_WORKER"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


@pytest.fixture(scope="session")
def tiny_model(tokenizer):
    return make_model(len(tokenizer), seed=0)


@pytest.fixture(scope="session")
def other_model(tokenizer):
    """A different model over the same vocabulary (a weak but real AR drafter)."""
    return make_model(len(tokenizer), seed=1, layers=1)


@pytest.fixture()
def target(tiny_model, tokenizer):
    return Target(tiny_model, tokenizer, name="tiny")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, tokenizer):
    """The tiny model saved as a local folder (what --model PATH loads), float32 on disk."""
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def reference_greedy(model, prompt_ids, max_new_tokens, stop_ids=(2,)):
    """Greedy decoding by full recomputation (no cache, no engine): the ground truth."""
    ids = list(prompt_ids)
    out = []
    with torch.inference_mode():
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            tok = int(logits.argmax())
            ids.append(tok)
            out.append(tok)
            if tok in stop_ids:
                break
    return out
