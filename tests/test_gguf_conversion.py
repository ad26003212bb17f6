"""A GGUF's first conversion parses its header once (models._one_gguf_parse). transformers parses it anew
for the tokenizer, the config and the weights: ~10 s each for Gemma 3's 262k-token vocabulary on a 2-core
CPU; its whole conversion went from 51-56 s to 32-36 s, to byte-identical files
(`benchmarks/results/issue15_test_suite/gguf_one_parse_avx512.txt`). Checked here on the real default GGUF's
tokenizer and config (`gguf_text_side`, the same memo around the same transformers loads as a full
conversion, without its ~15 s of dequantising): one parse instead of two, and the same files. Slow."""

import contextlib
import filecmp

import gguf
import pytest

from diffspec import models

pytestmark = pytest.mark.slow


def test_a_ggufs_tokenizer_and_config_come_from_one_header_parse_unchanged(tmp_path, monkeypatch):
    parsed = []
    original = gguf.GGUFReader

    def counting(path, mode="r"):
        parsed.append(str(path))
        return original(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counting)
    source = models.builtin_gguf_path(models.DEFAULT_MODEL)
    one_parse, parses, outputs = models._one_gguf_parse, {}, {}
    for memo in (False, True):
        monkeypatch.setattr(models, "_one_gguf_parse", one_parse if memo else contextlib.nullcontext)
        monkeypatch.setenv("DIFFSPEC_CACHE", str(tmp_path / f"memo-{memo}"))
        parsed.clear()
        tokenizer, config = models.gguf_text_side(source, quiet=True)
        parses[memo] = len(parsed)
        outputs[memo] = (tokenizer.vocab_size, {k: v for k, v in config.to_dict().items() if k != "_name_or_path"})
    assert parses == {False: 2, True: 1}  # the tokenizer's parse and the config's: one between them
    assert gguf.GGUFReader is counting  # the memo put the reader back
    assert outputs[False] == outputs[True]
    folders = [next((tmp_path / f"memo-{memo}" / "models").glob("*-text")) for memo in (False, True)]
    names = sorted(p.name for p in folders[0].iterdir())
    assert "tokenizer.json" in names and names == sorted(p.name for p in folders[1].iterdir())
    assert filecmp.cmpfiles(*folders, names, shallow=False)[1:] == ([], [])
