"""The llama.cpp target backend: a GGUF file run by llama.cpp (`llama-cpp-python`'s C API), under
the same target contract as the transformers backend (`target.TargetBase`).

- forward(tokens): ONE `llama_decode` of the n tokens at positions cache_len.., every row flagged
  for logits (only the last with logits=False); the logits come back as a float32 tensor [n, V].
- truncate(n): `llama_memory_seq_rm(seq 0, [n, inf))`, exact for full-attention layers; a
  sliding-window model keeps its whole cache (`swa_full`), so a rejected draft can always be taken
  back. A removal llama.cpp refuses raises RollbackError, never a silently different cache.
- text: the GGUF's own tokenizer and chat template, read by transformers (models.gguf_text_side),
  so prompts, stop tokens and decoding are the transformers backend's, token for token.
- hidden states: not exposed; drafters that need them are refused by name (TargetBase.check_drafter).

Exactness: the engine's plain decoding on this backend is the same loop with one-token passes, and
a verify pass must give every row the logits a one-token pass would give. llama.cpp's CPU attention
does so only with flash attention on (see __init__) and for passes under 64 tokens
(`max_verify_tokens`, which the engine honours); `benchmarks/llama_cpp_parity.py` measures it over
the bench prompts and tests/test_llama_cpp.py holds it bitwise. A prefill of 64 tokens or more takes
the tiled kernel for every request alike, plain or speculative, so it changes nothing between them.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

from ..cache import RollbackError
from ..errors import DiffspecError
from ..target import TargetBase, TargetOutput, chat_stop_token_ids

INSTALL_HINT = ("the llama.cpp backend needs llama-cpp-python: install it with `bash scripts/setup.sh` "
                "or `pip install -e .[llama-cpp]` (it compiles llama.cpp, ~8 minutes)")


def import_llama_cpp():
    """The llama_cpp module, or a DiffspecError naming the extra to install."""
    try:
        import llama_cpp
    except ImportError as e:
        raise DiffspecError(f"{INSTALL_HINT} ({e})") from None
    return llama_cpp


def available() -> bool:
    try:
        import_llama_cpp()
    except DiffspecError:
        return False
    return True


def usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


_QUIET_LOG = None  # the ctypes callback must outlive every call into llama.cpp


def _silence(lib) -> None:
    """llama.cpp logs every tensor it loads to stderr; keep errors only."""
    global _QUIET_LOG
    if _QUIET_LOG is None:
        def log(level, text, user_data):
            if level == 4 or level == 2:  # GGML_LOG_LEVEL_ERROR (4) / WARN (2) stay visible
                msg = text.decode(errors="replace") if text else ""
                if level == 4 and msg.strip():
                    os.write(2, msg.encode())
        _QUIET_LOG = lib.llama_log_callback(log)
        lib.llama_log_set(_QUIET_LOG, ctypes.c_void_p(0))


class LlamaCppTarget(TargetBase):
    """A GGUF model run by llama.cpp, one sequence, with a KV cache that can be rolled back."""

    backend = "llama.cpp"
    exposes_hidden_states = False
    # llama.cpp's CPU flash attention switches to a tiled kernel for 64 query rows or more
    # (GGML_FA_TILE_Q in ggml-cpu/common.h), whose rows differ from a one-token pass (logits by up to
    # 1.6, measured): a verify pass stays below that width, so k <= 62 drafted tokens a round
    max_verify_tokens = 63
    # NOT exact yet: on the bench (60 prompts x 256 tokens, AVX2, 2 threads) speculative outputs left plain's
    # path on 37 prompts, always late (new token ~150-240, contexts ~300-450), while teacher-forced passes
    # of 2-17 rows over plain's own continuation were bitwise equal on the 17 prompts checked. Suspects:
    # the KV cells a rolled-back pass leaves and llama.cpp's split of the KV range across threads for
    # one-token passes. Until found, the engine refuses a drafter here (allow_inexact=True for tests and
    # investigation) and `auto` never picks this backend.
    speculation_exact = False

    def __init__(self, gguf: Path, tokenizer, config, max_context: Optional[int] = None, name: str = "model",
                 threads: Optional[int] = None, batch: int = 512):
        lib = import_llama_cpp()
        self._lib = lib
        self.gguf = Path(gguf)
        if not self.gguf.is_file():
            raise DiffspecError(f"model file not found: {gguf}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise DiffspecError(f"threads must be a positive integer, got {threads!r}")
        self.tokenizer, self.name, self.config = tokenizer, name, config
        self.threads = threads or usable_cores()
        _silence(lib)
        lib.llama_backend_init()
        mparams = lib.llama_model_default_params()
        self._model = lib.llama_model_load_from_file(str(self.gguf).encode(), mparams)
        if not self._model:
            raise DiffspecError(f"llama.cpp could not load {gguf} (not a GGUF file it supports)")
        self._vocab = lib.llama_model_get_vocab(self._model)
        self._n_vocab = int(lib.llama_vocab_n_tokens(self._vocab))
        trained = int(lib.llama_model_n_ctx_train(self._model)) or 2048
        self.max_context = int(min(max_context, trained) if max_context else trained)
        self.num_layers = int(lib.llama_model_n_layer(self._model))
        self.hidden_size = int(lib.llama_model_n_embd(self._model))
        self._batch_cap = int(min(batch, self.max_context))
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = self.max_context
        cparams.n_batch = cparams.n_ubatch = self._batch_cap
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.swa_full = True       # keep every position of sliding-window layers: rollback stays possible
        cparams.no_perf = True
        # Flash attention ON, always (never `auto`): it is what makes a verify pass exact. With it off, the
        # CPU attention of a multi-token pass takes another kernel path than a one-token pass: logits
        # differed by up to 1.8 and argmaxes flipped (2 of 40 rows bitwise equal, measured on AVX2, SmolLM2
        # Q4_1); with it on, every row of passes 2, 5 and 17 wide was bitwise equal to one-token steps
        # (tests/test_llama_cpp.py holds this; benchmarks/llama_cpp_parity.py measures it on the bench).
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise DiffspecError(f"llama.cpp could not create a context of {self.max_context} tokens for {gguf}")
        self._mem = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(self._batch_cap, 0, 1)
        self.device = torch.device("cpu")
        self.dtype = torch.float32    # of the logits; the weights keep the GGUF's quantisation
        eos = config.eos_token_id if config is not None else None
        eos = {eos} if isinstance(eos, int) else set(eos or ())
        self.stop_token_ids = frozenset({int(e) for e in eos} | chat_stop_token_ids(tokenizer))
        self.forward_passes = 0
        self._len = 0
        self._fingerprint: Optional[str] = None

    @classmethod
    def load(cls, spec: Optional[str] = None, max_context: Optional[int] = None, quiet: bool = False,
             threads: Optional[int] = None) -> "LlamaCppTarget":
        """`threads`: None = every usable core."""
        from ..models import DEFAULT_MODEL, gguf_file, gguf_text_side

        import_llama_cpp()  # before any slow work
        path = gguf_file(spec)
        if path is None:
            raise DiffspecError(f"the llama.cpp backend runs GGUF files; model '{spec}' is not one "
                                f"(give a .gguf path or a registered GGUF model, or use --backend transformers)")
        tok, config = gguf_text_side(path, quiet=quiet)
        return cls(path, tok, config, max_context=max_context, name=spec or DEFAULT_MODEL, threads=threads)

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        try:
            if getattr(self, "_batch", None) is not None:
                lib.llama_batch_free(self._batch)
                self._batch = None
            if getattr(self, "_ctx", None):
                lib.llama_free(self._ctx)
                self._ctx = None
            if getattr(self, "_model", None):
                lib.llama_model_free(self._model)
                self._model = None
        except Exception:  # interpreter shutdown
            pass

    # --- cache -------------------------------------------------------------------------
    def reset(self) -> None:
        self._lib.llama_memory_clear(self._mem, True)
        self._len = 0

    @property
    def cache_len(self) -> int:
        return self._len

    def truncate(self, length: int) -> None:
        """Roll the KV cache back to its first `length` positions (no-op if it is not longer)."""
        if length < 0:
            raise ValueError(f"cache length must be >= 0, got {length}")
        if length >= self._len:
            return
        if not self._lib.llama_memory_seq_rm(self._mem, 0, length, -1):
            raise RollbackError(f"llama.cpp could not roll its cache back from {self._len} to {length} positions")
        self._len = length

    # --- forward -----------------------------------------------------------------------
    def _decode(self, ids: Sequence[int], start: int, logits_from: int) -> None:
        """One llama_decode of ids at positions start.., logits for rows >= logits_from."""
        b = self._batch
        n = len(ids)
        for i, t in enumerate(ids):
            b.token[i] = t
            b.pos[i] = start + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = 1 if i >= logits_from else 0
        b.n_tokens = n
        rc = self._lib.llama_decode(self._ctx, b)
        if rc != 0:
            # the cache may hold part of the batch now: cut it back to what it held before
            self._lib.llama_memory_seq_rm(self._mem, 0, start, -1)
            raise DiffspecError(f"llama.cpp failed to decode {n} tokens at position {start} (llama_decode returned {rc})")

    def forward(self, tokens: torch.Tensor, hidden_layers: Sequence[int] = (), logits: bool = True) -> TargetOutput:
        """Append `tokens` [n] to the cache; logits [n, V] (row i predicts the token after tokens[i]),
        or [1, V] for the last row only with logits=False. Passes wider than the batch capacity (a long
        prefill) run in chunks; each verify pass of a round is one llama_decode."""
        if hidden_layers:
            self.check_drafter("(a drafter reading hidden states)", True)
        ids = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
        n = len(ids)
        if n == 0:
            raise DiffspecError("forward needs at least one token")
        if self._len + n > self.max_context:
            raise DiffspecError(f"sequence of {self._len + n} tokens exceeds the model's context of {self.max_context}")
        if any(t < 0 or t >= self._n_vocab for t in ids):
            raise DiffspecError(f"token ids must be in [0, {self._n_vocab})")
        wanted = 0 if logits else n - 1
        rows = []
        for s in range(0, n, self._batch_cap):
            chunk = ids[s: s + self._batch_cap]
            first = max(0, wanted - s)
            if first >= len(chunk):
                first = len(chunk)  # no logits from this chunk
            self._decode(chunk, self._len, first)
            self._len += len(chunk)
            if first < len(chunk):
                out = len(chunk) - first
                ptr = self._lib.llama_get_logits(self._ctx)
                rows.append(torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(out * self._n_vocab,)).copy())
                            .view(out, self._n_vocab))
        self.forward_passes += 1
        return TargetOutput(torch.cat(rows) if len(rows) > 1 else rows[0], None)

    # --- facts -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def fingerprint(self) -> str:
        """The GGUF file (path, size, mtime), the backend and its thread count."""
        if self._fingerprint is None:
            import hashlib

            st = self.gguf.stat()
            blob = f"llama.cpp|{self.gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}|threads={self.threads}"
            self._fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:16]
        return self._fingerprint
