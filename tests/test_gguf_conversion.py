"""A GGUF's first conversion parses its header once (models._one_gguf_parse). transformers parses it anew
for the tokenizer, the config and the weights: ~10 s each for Gemma 3's 262k-token vocabulary on a 2-core
CPU; its whole conversion went from 51-56 s to 32-36 s, to byte-identical files
(`benchmarks/results/issue15_test_suite/gguf_one_parse_avx512.txt`). Checked here on the real default GGUF's
tokenizer and config (`gguf_text_side`, the same memo around the same transformers loads as a full
conversion, without its ~15 s of dequantising): one parse instead of two, and the same files. The parse
itself reads a plain array instead of a memmap (models.gguf_reader: Gemma 3's conversion 52-55 -> 33-40 s on a
2-core AVX2 EPYC, byte-identical files; `benchmarks/results/issue15_test_suite/gguf_plain_array_avx2.txt`):
its fields and tensors are GGUFReader's own. Slow."""

import contextlib
import filecmp

import gguf
import numpy as np
import pytest
from gguf.gguf_reader import GGUFReader

from diffspec import models

pytestmark = pytest.mark.slow


def test_a_ggufs_tokenizer_and_config_come_from_one_header_parse_unchanged(tmp_path, monkeypatch):
    parsed = []
    original, original_init = gguf.GGUFReader, GGUFReader.__init__

    def counting(self, path, mode="r"):  # every parse, through gguf.GGUFReader or models.gguf_reader
        parsed.append(str(path))
        original_init(self, path, mode)

    monkeypatch.setattr(GGUFReader, "__init__", counting)
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
    assert gguf.GGUFReader is original  # the memo put the reader back
    assert outputs[False] == outputs[True]
    folders = [next((tmp_path / f"memo-{memo}" / "models").glob("*-text")) for memo in (False, True)]
    names = sorted(p.name for p in folders[0].iterdir())
    assert "tokenizer.json" in names and names == sorted(p.name for p in folders[1].iterdir())
    assert filecmp.cmpfiles(*folders, names, shallow=False)[1:] == ([], [])


def test_the_plain_array_reader_reads_what_gguf_reads():
    source = models.builtin_gguf_path(models.DEFAULT_MODEL)
    theirs, ours = gguf.GGUFReader(str(source)), models.gguf_reader(source)
    assert type(theirs.data) is np.memmap and type(ours.data) is np.ndarray  # what makes it faster
    # the file's mapping itself, read-only, not a copy of it; tensors stay views of it
    assert isinstance(ours.data.base, np.memmap) and not ours.data.flags.writeable
    assert np.shares_memory(ours.data, ours.tensors[0].data)
    with models._one_gguf_parse():  # what transformers gets there
        assert type(gguf.GGUFReader(str(source)).data) is np.ndarray
    assert list(theirs.fields) == list(ours.fields) and len(theirs.fields["tokenizer.ggml.tokens"].data) > 40000
    for name, field in theirs.fields.items():
        other = ours.fields[name]
        assert (field.offset, field.data, field.types) == (other.offset, other.data, other.types), name
        assert len(field.parts) == len(other.parts), name
        for a, b in zip(field.parts, other.parts):
            assert a.dtype == b.dtype and np.array_equal(a, b), name
    assert [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in theirs.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.data_offset) for t in ours.tensors]
    for a, b in zip(theirs.tensors, ours.tensors):
        assert a.data.dtype == b.data.dtype and np.array_equal(a.data, b.data), a.name


def test_weight_names_build_gguf_s_name_table_once_and_the_same(monkeypatch):
    """transformers names a GGUF's weights module by module, asking gguf for the architecture's tensor-name table
    at each (397 tables for SmolLM2: 15 of its conversion's 26 s). Inside _one_gguf_parse the table is built once
    per (architecture, layers), and the names are the same as without."""
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from conftest import make_model

    built = []
    original = gguf.get_tensor_name_map

    def counting(arch, n_blocks):
        built.append((arch, n_blocks))
        return original(arch, n_blocks)

    monkeypatch.setattr(gguf, "get_tensor_name_map", counting)
    three, two = make_model(70, layers=3), make_model(70, layers=2)
    plain = [get_gguf_hf_weights_map(m, TensorProcessor()) for m in (three, two)]
    once = len(built)
    built.clear()
    with models._one_gguf_parse():
        memoised = [get_gguf_hf_weights_map(m, TensorProcessor()) for m in (three, two, three)]
    assert gguf.get_tensor_name_map is counting  # put back
    assert once > 20 and len(built) == 2  # one table a module before; one for each layer count now
    assert memoised == plain + plain[:1]
    assert "blk.2.attn_q.weight" in plain[0] and "blk.2.attn_q.weight" not in plain[1]


def test_conversions_in_two_threads_take_turns_and_leave_gguf_as_it_was():
    """Two threads' overlapping conversions would each put back what the other had patched in (gguf left patched
    for good, holding a memo of every file it read): they take turns through _one_gguf_parse."""
    import threading

    original = (gguf.GGUFReader, gguf.get_tensor_name_map)
    first_in, second_tried, seen = threading.Event(), threading.Event(), []

    def first():
        with models._one_gguf_parse():
            first_in.set()
            second_tried.wait(5)
            seen.append(("first", gguf.GGUFReader))

    def second():
        first_in.wait(5)
        second_tried.set()
        with models._one_gguf_parse():
            seen.append(("second", gguf.GGUFReader))

    threads = [threading.Thread(target=f) for f in (first, second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert [who for who, _ in seen] == ["first", "second"]  # the second waited for the first to leave
    assert all(reader is not original[0] for _, reader in seen)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == original
