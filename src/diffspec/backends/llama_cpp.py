"""The llama.cpp target backend: a GGUF file run by llama.cpp (`llama-cpp-python`'s C API), under
the same target contract as the transformers backend (`target.TargetBase`).

- forward(tokens): ONE `llama_decode` of the n tokens at positions cache_len.., every row flagged
  for logits (only the last with logits=False); the logits come back as a float32 tensor [n, V].
- truncate(n): `llama_memory_seq_rm(seq 0, [n, inf))`, exact for full-attention layers; a
  sliding-window model keeps its whole cache (`swa_full`), so a rejected draft can always be taken
  back. A removal llama.cpp refuses raises RollbackError, never a silently different cache.
- text: the GGUF's own tokenizer and chat template, read by transformers (models.gguf_text_side),
  so prompts, stop tokens and decoding are the transformers backend's, token for token.
- hidden states (for drafters conditioned on them): read during llama_decode by llama.cpp's eval
  callback, from the graph's per-layer outputs (`l_out-<i>`; the last layer's is `result_norm`, as
  transformers returns it normed), in a second llama.cpp context that has the callback; plain
  requests never pay for it. The embeddings and output head such a drafter shares with the target
  are the GGUF's own, dequantized once (`gguf`).

Exactness: the engine's plain decoding on this backend is the same loop with one-token passes, and
a verify pass must give every row the logits a one-token pass would give. llama.cpp's CPU attention
has three kernels, chosen by the shape of a pass (ggml-cpu/ops.cpp, flash attention): one query row
with 512 or more cache cells splits the cache across threads and adds the parts up (one-token steps
past position ~256, as the cache is padded to 256 cells); 64 query rows or more take a tiled kernel;
everything else runs one row at a time. Each adds in another order, so the same row differed by
0.5-1.1 in its logits, and greedy speculative output left plain's path on 28 of 120 bench runs. The
split and tiled kernels run only when the K and V caches are both f16 (or f32); this backend keeps K
in q8_0 and V in f16 (KV_CACHE_TYPES), so every pass shape takes the row-at-a-time kernel and a
verify pass is bitwise a run of one-token steps. The price is numeric, not speed: logits move by
~3e-3 nats (mean KL) from an all-f16 cache, and the one-token step measured as fast (see
KV_CACHE_TYPES).

Nothing here is taken on trust: `parity_probe` measures, on this machine and model, that passes of
every width up to `max_verify_tokens` equal one-token steps bitwise, after a short and after a long
context (past the 512-cell threshold), with rollbacks between them. `speculation_exact` is its
answer, measured once per machine x file x llama.cpp version x threads x cache types x what the
context size lets it check, and cached; the engine refuses a drafter where it is False (another CPU's
or model's matmul kernels can differ by batch size: Gemma 3 270M Q4_K_M fails it on AVX2). Passes that
read hidden states run in another context, split where the callback reads: they have a probe of their
own (`parity_record(hidden_states=True)`), which a drafter reading them must pass.
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


#: the KV cache's element types (K, V). Mixed on purpose: llama.cpp's CPU flash attention takes its
#: split-KV kernel (one query row, >= 512 cells) and its tiled kernel (>= 64 rows) only when K and V are
#: both f16 or f32; with K in q8_0 every pass shape runs the row-at-a-time kernel, so a verify pass is
#: bitwise a run of one-token steps. Measured on AVX2, 2 threads (ms for a one-token step / a 16-row pass
#: at 150 and 900 tokens of context): f16+f16 8.3/73.8 and 12.9/126.8; q8_0+f16 8.5/73.9 and 11.7/124.8;
#: f16+q8_0 and f16+bf16 were slower (16.2 and 15.8 ms a step at 900). Logits move from an all-f16 cache
#: by ~3e-3 nats (mean KL over 2,412 rows), as any of those mixes did.
KV_CACHE_TYPES = ("q8_0", "f16")
GGML_TYPES = {"f32": 0, "f16": 1, "q8_0": 8, "bf16": 30}
#: the parity probe: passes of these widths (after a rollback each) against one-token steps, after a
#: short context (cache padded to 256 cells) and after one past llama.cpp's 512-cell split threshold
PARITY_WIDTHS = (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 63, 64)
PARITY_CONTEXTS = (40, 500)


class _TensorHead(ctypes.Structure):
    """`struct ggml_tensor` (ggml.h) up to its name: what the eval callback reads of a graph node. The
    layout is checked against the library at the first call (ggml_get_name's address, ggml_nelements)."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


_NAME_OFFSET = _TensorHead.name.offset
GGML_TYPE_F32 = 0


def _ggml_library():
    """libggml-base from llama-cpp-python's own folder (the one llama.cpp was built with)."""
    lib = import_llama_cpp()
    folder = Path(lib.__file__).parent / "lib"
    for path in sorted(folder.glob("libggml-base.*")) + sorted(folder.glob("ggml-base.*")):
        try:
            ggml = ctypes.CDLL(str(path))
        except OSError:
            continue
        ggml.ggml_get_name.restype = ctypes.c_void_p
        ggml.ggml_get_name.argtypes = [ctypes.c_void_p]
        ggml.ggml_nelements.restype = ctypes.c_int64
        ggml.ggml_nelements.argtypes = [ctypes.c_void_p]
        ggml.ggml_backend_tensor_get.restype = None
        ggml.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        return ggml
    raise DiffspecError(f"reading hidden states on the llama.cpp backend needs libggml-base in {folder}; not found")


class _HiddenCapture:
    """llama.cpp's eval callback (`cb_eval`): during a llama_decode, copies out the graph nodes named in
    `wanted` (float32, [rows, width]). The scheduler asks about every node of the graph (~1,100 a pass
    for SmolLM2-135M), so a pass pays ~1 us a node in Python: only the context made for hidden states
    carries this callback."""

    def __init__(self, lib):
        self._ggml = _ggml_library()
        self.wanted: dict = {}       # node name (bytes) -> list of [rows, width] arrays
        self.error: Optional[BaseException] = None
        self._checked = False
        self.fn = lib.llama_cpp.ggml_backend_sched_eval_callback(self._callback)

    def expect(self, names: Sequence[bytes]) -> None:
        self.wanted = {n: [] for n in names}
        self.error = None

    def _callback(self, t, ask, user_data):
        try:
            if not self._checked:  # before any name is read: a wrong layout would only ever match nothing
                head = _TensorHead.from_address(t)
                if (self._ggml.ggml_get_name(t) != t + _NAME_OFFSET
                        or self._ggml.ggml_nelements(t) != head.ne[0] * head.ne[1] * head.ne[2] * head.ne[3]):
                    raise RuntimeError("ggml_tensor's layout is not the one this backend reads (another ggml version)")
                self._checked = True
            name = ctypes.string_at(t + _NAME_OFFSET)
            if ask:
                return name in self.wanted
            if name not in self.wanted:
                return True
            head = _TensorHead.from_address(t)
            width, rows = int(head.ne[0]), int(head.ne[1])
            if head.type != GGML_TYPE_F32 or head.ne[2] != 1 or head.ne[3] != 1 or head.nb[1] != 4 * width:
                raise RuntimeError(f"node {name.decode()} is not a contiguous float32 matrix")
            out = np.empty((rows, width), dtype=np.float32)
            self._ggml.ggml_backend_tensor_get(t, out.ctypes.data, 0, out.nbytes)
            self.wanted[name].append(out)
        except BaseException as e:  # nothing may cross into C (ctypes would swallow it, Ctrl-C included)
            self.error = self.error or e
            return not ask  # asked: observe nothing more; after a node: let the pass finish, then raise
        return True


class _SharedEmbedding(torch.nn.Module):
    """The target's token embedding as a module (ids -> rows), with the model's scale if it has one."""

    def __init__(self, weight: torch.Tensor, scale: Optional[float] = None):
        super().__init__()
        self.weight = torch.nn.Parameter(weight, requires_grad=False)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = torch.nn.functional.embedding(ids, self.weight)
        return rows * torch.tensor(self.scale, dtype=rows.dtype) if self.scale is not None else rows


class LlamaCppTarget(TargetBase):
    """A GGUF model run by llama.cpp, one sequence, with a KV cache that can be rolled back."""

    backend = "llama.cpp"
    exposes_hidden_states = True
    # reading hidden states costs every pass a Python call per graph node (1.1-1.3 ms a pass for
    # SmolLM2-135M on 2 AVX-512 cores, +16% on a one-token step) and the conditioned drafter was measured
    # not to pay that back here (README, "The llama.cpp backend"); it runs when named
    hidden_states_by_default = False
    # the widest verify pass the parity probe checks (k <= 63 drafted tokens a round); wider passes
    # are never needed (the policies stop at 60) and are not checked
    max_verify_tokens = 64

    def __init__(self, gguf: Path, tokenizer, config, max_context: Optional[int] = None, name: str = "model",
                 threads: Optional[int] = None, batch: int = 512,
                 kv_cache_types: Sequence[str] = KV_CACHE_TYPES, quiet: bool = False):
        """`kv_cache_types`: (K, V) element types; anything but the default is for investigation (an
        all-f16 cache makes verify passes inexact past 256 positions, which the parity probe reports)."""
        lib = import_llama_cpp()
        self._lib = lib
        self.gguf = Path(gguf)
        if not self.gguf.is_file():
            raise DiffspecError(f"model file not found: {gguf}")
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise DiffspecError(f"threads must be a positive integer, got {threads!r}")
        kv_cache_types = tuple(kv_cache_types)
        if len(kv_cache_types) != 2 or any(t not in GGML_TYPES for t in kv_cache_types):
            raise DiffspecError(f"kv_cache_types must be two of {', '.join(GGML_TYPES)} (K, V), got {kv_cache_types!r}")
        self.kv_cache_types = kv_cache_types
        self.quiet = quiet
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
        cparams.type_k, cparams.type_v = (GGML_TYPES[t] for t in kv_cache_types)
        # Flash attention ON, always (never `auto`), with the cache types above: that is what makes a verify
        # pass exact. With it off, the attention of a multi-token pass is a matmul of another shape than a
        # one-token pass's: logits differed by up to 1.8 and argmaxes flipped (2 of 40 rows bitwise equal,
        # AVX2, SmolLM2 Q4_1). The parity probe holds the combination to it on every machine.
        cparams.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self._cparams = cparams
        self._ctx = lib.llama_init_from_model(self._model, cparams)
        if not self._ctx:
            lib.llama_model_free(self._model)
            raise DiffspecError(f"llama.cpp could not create a context of {self.max_context} tokens for {gguf}")
        self._plain_ctx = self._ctx
        self._capture_ctx = None        # a second context with the eval callback, made on first need
        self._capture: Optional[_HiddenCapture] = None
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
        self._parity: dict = {}
        self._shared_weights = None  # (embedding module, head weight), dequantized from the GGUF on first need

    @classmethod
    def load(cls, spec: Optional[str] = None, max_context: Optional[int] = None, quiet: bool = False,
             threads: Optional[int] = None, kv_cache_types: Sequence[str] = KV_CACHE_TYPES) -> "LlamaCppTarget":
        """`threads`: None = every usable core."""
        from ..models import DEFAULT_MODEL, gguf_file, gguf_text_side

        import_llama_cpp()  # before any slow work
        path = gguf_file(spec)
        if path is None:
            raise DiffspecError(f"the llama.cpp backend runs GGUF files; model '{spec}' is not one "
                                f"(give a .gguf path or a registered GGUF model, or use --backend transformers)")
        tok, config = gguf_text_side(path, quiet=quiet)
        return cls(path, tok, config, max_context=max_context, name=spec or DEFAULT_MODEL, threads=threads,
                   kv_cache_types=kv_cache_types, quiet=quiet)

    def __del__(self):
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        try:
            if getattr(self, "_batch", None) is not None:
                lib.llama_batch_free(self._batch)
                self._batch = None
            for name in ("_plain_ctx", "_capture_ctx"):
                if getattr(self, name, None):
                    lib.llama_free(getattr(self, name))
                    setattr(self, name, None)
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

    def _use_context(self, capture: bool) -> None:
        """Run the next passes in the context with the eval callback (capture) or the plain one. A
        request keeps one context from its first pass on: the KV cache lives in the context. A request that
        stops reading hidden states (the auto policy retired its drafter) stays in the capture context, its
        callback told to copy nothing."""
        want = self._capture_ctx if capture else self._plain_ctx
        if want is not None and self._ctx == want:
            return
        if self._len and not capture and self._ctx is not None and self._ctx == self._capture_ctx:
            self._capture.expect([])
            return
        if self._len:
            raise DiffspecError("the llama.cpp backend reads hidden states in another context than plain passes: a "
                                "request must ask for them from its first pass on (reset() the target first)")
        if want is None:
            self._capture = _HiddenCapture(self._lib)
            self._cparams.cb_eval = self._capture.fn
            self._cparams.cb_eval_user_data = None
            want = self._lib.llama_init_from_model(self._model, self._cparams)
            if not want:
                raise DiffspecError(f"llama.cpp could not create a second context (for hidden states) of "
                                    f"{self.max_context} tokens for {self.gguf}")
            self._capture_ctx = want
        self._ctx = want
        self._mem = self._lib.llama_get_memory(want)
        self._lib.llama_memory_clear(self._mem, True)

    def _node_names(self, hidden_layers: Sequence[int]) -> list:
        """llama.cpp's graph names for the outputs of these layers: `l_out-<i>`, and for the last layer
        `result_norm` (the final norm applied, which is what transformers returns for it)."""
        names = []
        for i in hidden_layers:
            if not 0 <= int(i) < self.num_layers:
                raise DiffspecError(f"hidden layer {i} is out of range: the target has {self.num_layers} layers")
            names.append(b"result_norm" if int(i) == self.num_layers - 1 else f"l_out-{int(i)}".encode())
        return names

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
        names = self._node_names(hidden_layers) if hidden_layers else []
        ids = [int(t) for t in (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens)]
        n = len(ids)
        if n == 0:
            raise DiffspecError("forward needs at least one token")
        if self._len + n > self.max_context:
            raise DiffspecError(f"sequence of {self._len + n} tokens exceeds the model's context of {self.max_context}")
        if any(t < 0 or t >= self._n_vocab for t in ids):
            raise DiffspecError(f"token ids must be in [0, {self._n_vocab})")
        self._use_context(bool(names))
        if names:
            self._capture.expect(names)
        # the last layer's output exists only for rows that output logits: then every row does
        wanted = 0 if logits or b"result_norm" in names else n - 1
        rows, before = [], self._len
        for s in range(0, n, self._batch_cap):
            chunk = ids[s: s + self._batch_cap]
            first = max(0, wanted - s)
            if first >= len(chunk):
                first = len(chunk)  # no logits from this chunk
            self._decode(chunk, self._len, first)
            if names and self._capture.error is not None:  # the pass finished; its hidden states did not come out
                self._lib.llama_memory_seq_rm(self._mem, 0, before, -1)
                self._len = before
                error, self._capture.error = self._capture.error, None
                if not isinstance(error, Exception):
                    raise error  # KeyboardInterrupt and the like, as raised
                raise DiffspecError(f"reading hidden states from llama.cpp failed: {type(error).__name__}: {error}")
            self._len += len(chunk)
            if first < len(chunk):
                out = len(chunk) - first
                ptr = self._lib.llama_get_logits(self._ctx)
                rows.append(torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(out * self._n_vocab,)).copy())
                            .view(out, self._n_vocab))
        self.forward_passes += 1
        logits_out = torch.cat(rows) if len(rows) > 1 else rows[0]
        if not logits:
            logits_out = logits_out[-1:]
        return TargetOutput(logits_out, self._captured(names, n) if names else None)

    def _captured(self, names: list, n: int) -> torch.Tensor:
        """The hidden states the callback copied out during this pass: [n, len(names) * hidden]."""
        cap = self._capture
        parts = []
        for name in names:
            got = cap.wanted[name]
            rows = sum(a.shape[0] for a in got)
            if rows != n:
                raise DiffspecError(f"llama.cpp's graph for {self.gguf.name} gave {rows} rows of '{name.decode()}' for a "
                                    f"pass of {n} tokens (a model whose graph names its layer outputs otherwise "
                                    f"cannot feed a drafter that reads hidden states)")
            parts.append(np.concatenate(got) if len(got) > 1 else got[0])
        return torch.from_numpy(np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])

    # --- what a conditioned drafter shares with the target ----------------------------------
    def _weights(self) -> tuple:
        """(embedding, head weight) dequantized from the GGUF (float32), once; a tied head shares the
        embedding's tensor. A Gemma embedding carries its sqrt(hidden) scale, as transformers' does."""
        if self._shared_weights is None:
            try:
                import gguf
            except ImportError as e:
                raise DiffspecError(f"reading the GGUF's embeddings needs the `gguf` package ({e})") from None
            from ..models import gguf_reader

            reader = gguf_reader(str(self.gguf))
            tensors = {t.name: t for t in reader.tensors}
            if "token_embd.weight" not in tensors:
                raise DiffspecError(f"{self.gguf} has no token_embd.weight tensor to share with a drafter")

            def dequantized(t) -> torch.Tensor:
                try:
                    w = gguf.quants.dequantize(t.data, t.tensor_type)
                except (NotImplementedError, ValueError, KeyError) as e:
                    raise DiffspecError(f"cannot dequantize {t.name} ({t.tensor_type.name}) of {self.gguf}: {e}") from None
                # a copy: an f32 tensor comes back as a view of the read-only file mapping
                return torch.from_numpy(np.array(w, dtype=np.float32, copy=True)).view(-1, self.hidden_size)

            embed_w = dequantized(tensors["token_embd.weight"])
            head_w = dequantized(tensors["output.weight"]) if "output.weight" in tensors else embed_w
            model_type = str(getattr(self.config, "model_type", "") or "")
            scale = float(self.hidden_size) ** 0.5 if model_type.startswith("gemma") else None
            self._shared_weights = (_SharedEmbedding(embed_w, scale), head_w)
        return self._shared_weights

    def input_embeddings(self) -> torch.nn.Module:
        return self._weights()[0]

    def output_head_weight(self) -> torch.Tensor:
        return self._weights()[1]

    # --- facts -------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._n_vocab

    @property
    def fingerprint(self) -> str:
        """The GGUF file (path, size, mtime), the backend, its thread count and cache types."""
        if self._fingerprint is None:
            import hashlib

            st = self.gguf.stat()
            blob = (f"llama.cpp|{self.gguf.resolve()}|{st.st_size}|{int(st.st_mtime)}|threads={self.threads}"
                    f"|kv={'+'.join(self.kv_cache_types)}")
            self._fingerprint = hashlib.sha256(blob.encode()).hexdigest()[:16]
        return self._fingerprint

    # --- exactness ---------------------------------------------------------------------
    def parity_probe(self, widths: Sequence[int] = PARITY_WIDTHS, contexts: Sequence[int] = PARITY_CONTEXTS,
                     hidden_layers: Sequence[int] = ()) -> dict:
        """Measure whether a verify pass equals one-token steps, bitwise, on this machine and model.

        After `c` tokens of context (a fixed pseudo-random sequence; prefilled as the engine does), m
        one-token steps give the reference rows; then for each width w the cache is rolled back to c,
        w tokens go through in one pass and every row is compared; then it is rolled back to the middle
        of that pass and one token goes again. With `hidden_layers` the passes under test read those
        layers' outputs (the eval-callback context a conditioned drafter runs in), the reference rows
        stay plain one-token steps. Returns {"exact", "checked_rows", "first_mismatch", "seconds", ...}.
        Resets the cache."""
        import time

        widths, contexts = self._probe_plan(widths, contexts)
        if not widths or not contexts:
            why = f"--max-context {self.max_context} leaves no room for a pass of 2 tokens after 1"
            return {"exact": False, "first_mismatch": {"why": why},
                    "checked_rows": 0, "widths": list(widths), "contexts": list(contexts),
                    "kv_cache_types": list(self.kv_cache_types), "threads": self.threads, "seconds": 0.0}
        m = max(widths)
        rng = np.random.default_rng(0)
        seq = [int(t) for t in rng.integers(0, self._n_vocab, max(contexts) + m + 1)]
        t0, checked, mismatch = time.perf_counter(), 0, None
        hidden_layers = tuple(hidden_layers)
        for c in contexts:
            self.reset()
            self.forward(seq[:c], logits=False)
            ref = torch.cat([self.forward(seq[c + i: c + i + 1]).logits for i in range(m)])
            if hidden_layers:
                self.reset()
                self.forward(seq[:c], hidden_layers=hidden_layers, logits=False)
            for w in widths:
                self.truncate(c)
                rows = self.forward(seq[c: c + w], hidden_layers=hidden_layers).logits
                half = w // 2
                self.truncate(c + half)
                again = self.forward(seq[c + half: c + half + 1], hidden_layers=hidden_layers).logits
                checked += w + 1
                for label, got, want in (("pass", rows, ref[:w]), ("after rollback", again, ref[half: half + 1])):
                    if not torch.equal(got, want):
                        row = int((got != want).any(-1).nonzero()[0])
                        mismatch = {"context": c, "width": w, "where": label, "row": row,
                                    "max_abs_logit_diff": float((got - want).abs().max())}
                        break
                if mismatch:
                    break
            if mismatch:
                break
        self.reset()
        return {"exact": mismatch is None, "first_mismatch": mismatch, "checked_rows": checked,
                "widths": list(widths), "contexts": list(contexts), "kv_cache_types": list(self.kv_cache_types),
                "threads": self.threads, "hidden_layers": list(hidden_layers),
                "seconds": round(time.perf_counter() - t0, 2)}

    def _probe_plan(self, widths: Sequence[int], contexts: Sequence[int]) -> tuple:
        """The widths and contexts the probe can run within this target's context (a small
        max_context moves the long context down; the record's key holds what was run)."""
        widths = sorted(w for w in set(widths) if 2 <= w <= min(self.max_verify_tokens or w, self.max_context - 2))
        if not widths:
            return (), ()
        room = self.max_context - max(widths) - 1
        return tuple(widths), tuple(sorted({min(c, room) for c in contexts if min(c, room) >= 1}))

    def parity_record(self, recheck: bool = False, hidden_states: bool = False) -> dict:
        """The parity probe's answer for this machine x model x llama.cpp version x settings (threads,
        cache types, what the context size lets it check): read from the cost cache, or measured (a
        few seconds, announced) and written there. A context too small to check anything is answered
        "not exact" without a probe and is not cached. `hidden_states`: the answer for passes that read
        hidden states (those a conditioned drafter reads by default, and the last layer, which makes every
        row output logits), measured on first need; a failure to read them is answered "not exact" (not
        cached), never raised, so `auto` can fall back to transformers."""
        if hidden_states in self._parity and not recheck:
            return self._parity[hidden_states]
        layers = ()
        if hidden_states:
            from ..drafters.conditioned import default_target_layers

            layers = tuple(sorted(set(default_target_layers(self.num_layers)) | {self.num_layers - 1}))
        import json
        import sys

        from ..machine_keys import cache_key, cost_dir, machine_key
        from ..output import read_or_fill, try_write_cache

        plan = self._probe_plan(PARITY_WIDTHS, PARITY_CONTEXTS)
        if not plan[0] or not plan[1]:
            self._parity[hidden_states] = self._probe_or_failure(layers)
            return self._parity[hidden_states]
        key = cache_key("parity", machine_key(torch.device("cpu")), self.fingerprint,
                        getattr(self._lib, "__version__", "?"), plan, *(("hidden", layers) if layers else ()))
        where = cost_dir() / f"parity-{'hidden-' if layers else ''}{key}.json"

        def cached() -> Optional[dict]:
            if recheck:
                return None
            try:
                record = json.loads(where.read_text())
                return record if isinstance(record["exact"], bool) else None
            except (OSError, ValueError, KeyError, TypeError):
                return None

        def probed() -> dict:
            if not self.quiet:
                what = " (passes that read hidden states)" if layers else ""
                print(f"diffspec: checking that llama.cpp's verify passes{what} equal its one-token steps on this "
                      f"machine (once; cached)", file=sys.stderr, flush=True)
            record = self._probe_or_failure(layers)
            record["file"] = str(self.gguf)
            if "why" not in (record["first_mismatch"] or {}):  # a probe that could not run is not an answer to keep
                try_write_cache(where, json.dumps(record, indent=1), "the parity probe's answer")
            return record

        record = read_or_fill(where, cached, probed)[0]  # another process probing the same file: waited for, then read
        self._parity[hidden_states] = record
        return record

    def _probe_or_failure(self, layers: tuple) -> dict:
        """parity_probe(hidden_layers=layers); where the hidden states cannot be read at all, a "not exact"
        answer saying why (with the cache reset), so that `auto` falls back instead of failing."""
        try:
            return self.parity_probe(hidden_layers=layers)
        except DiffspecError as e:
            if not layers:
                raise
            self.reset()
            return {"exact": False, "first_mismatch": {"why": f"hidden states: {e}"}, "checked_rows": 0,
                    "hidden_layers": list(layers)}

    @property
    def speculation_exact(self) -> bool:
        """Whether verify passes here equal one-token steps: the parity probe's answer (measured once)."""
        return bool(self.parity_record()["exact"])

    @property
    def hidden_states_exact(self) -> bool:
        """Whether verify passes that read hidden states equal plain one-token steps (measured once)."""
        return bool(self.parity_record(hidden_states=True)["exact"])

    @property
    def hidden_states_inexact_reason(self) -> str:
        return self._reason(self.parity_record(hidden_states=True))

    @property
    def inexact_reason(self) -> str:
        """Why speculation here is not known to be exact (for the engine's refusal)."""
        return self._reason(self.parity_record())

    @staticmethod
    def _reason(record: dict) -> str:
        m = record.get("first_mismatch") or {}
        if "why" in m:
            return f"its verify passes could not be checked for exactness ({m['why']})"
        return (f"its verify passes are not exact on this machine (a {m.get('width')}-token pass after "
                f"{m.get('context')} tokens differed from one-token steps: {m.get('where')}, row {m.get('row')}, "
                f"logits by up to {m.get('max_abs_logit_diff', 0):.3g})")
