"""The target-generated data store: the one data format between data generation, training and evaluation.

`build_store` lets a target answer corpus prompts and writes the answers to a folder:

- prompts: every user turn of every conversation, with the turns before it as context, rendered
  with the chat template and its assistant prefix (`conversation_prompts`). Conversations that
  overlap the evaluation sets are dropped first, so benchmark prompts never enter a store.
- order: all (conversation, user turn) slots are shuffled with `seed`; prompts are rendered in
  that order, skipping a prompt identical (same token ids) to an earlier one. The first N prompts
  are therefore the same for every `max_prompts` >= N, which is what makes a store resumable and
  extensible (`PromptStream`, `ordered_prompts`).
- generation: batched (`generate_batch`: left-padded rows, one prefill, then one decode step per
  token for the whole batch over a preallocated, position-indexed KV cache), once per temperature
  (0 = greedy; T > 0 samples with a generator seeded by the prompt's position, so an answer does
  not depend on which batch it ran in). The batch size is measured (`choose_batch_size`), and on a CPU
  the decode step too (`choose_cpu_step`: transformers' forward or batch_step's direct step, whose attention
  runs in fused_layers.c; on 2 AVX-512 cores the direct step with prefill groups of 4,096 tokens made 1.38x the
  generated tokens a second, 151 against 110, every answer the same:
  benchmarks/results/issue16_training/make_data_cpu/).
- storage: chunks of prompts, each written as one safetensors shard and then recorded in
  `manifest.json` (both atomically: temporary name, then `os.replace`). A killed run loses at most
  the chunk in flight; rerunning with the same settings continues after `prompts_done`.
  An answer identical to one already stored (same response tokens, whatever the prompt) is
  dropped: small targets answer many prompts with the same greeting.
- prompts: rendered as the store needs them (`PromptStream`), in the seeded order, a chunk at a time: a time
  budget goes to answers, not to rendering all of a corpus first. `prompts_total` in the manifest is the number
  of distinct prompts once known (the corpus read to its end, or `max_prompts` found), None before.

Layout of a store folder:

    manifest.json              {"format": "diffspec-token-store", "version": 1, "target", "tokenizer_fingerprint",
                                "settings", "prompts_total", "prompts_done", "shards": [...], ...}
    shard-00000.safetensors    tokens int32 [sum of lengths]   prompt + response ids, sequence after sequence
                               offsets int64 [n + 1]           sequence i is tokens[offsets[i]:offsets[i+1]]
                               prompt_lens int32 [n]           the response starts at offsets[i] + prompt_lens[i]
                               temperature float32 [n]         0 = greedy

`read_store(path)` gives the sequences back as (ids, prompt length) pairs in stored order.

`build_corpus_store` writes the same format from the corpus text itself (`make-data --source corpus`):
each conversation rendered whole with the chat template, its first user turn (with the assistant
prefix) as the prompt and everything after it as the response, temperature -1 (= not the target's
text). Nothing is generated, so a store of the whole of ShareGPT takes minutes instead of days on a
CPU; training still labels every position with the target's own choice there (`--objective target`),
which is exact for slot 1; deeper slots are labels only where the text before them is the target's
own greedy path (training/anchored.py, "off-path slots")
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs

from ..errors import DiffspecError
from . import batch_step
from .store_settings import (FORMAT, MANIFEST, RESUME_KEYS, VERSION, StoreSettings, check_corpus_store_folder,  # noqa: F401
                             check_store_folder, parse_batch_size)
from .store_settings import read_manifest as _read_manifest
from .data import drop_evaluation_overlap, evaluation_prompts

# cache layer kinds whose keys and values are positions (all kept here; a window is applied by the mask)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention")


# --- prompts ---------------------------------------------------------------------------------

def _ids(encoded) -> list:
    ids = encoded["input_ids"] if isinstance(encoded, dict) or hasattr(encoded, "input_ids") else encoded
    return [int(i) for i in ids]


def turn_prompt(tokenizer, messages: list, turn: int, max_prompt_tokens: int) -> Optional[list]:
    """The prompt for the user message `messages[turn]`: everything up to and including it (earlier
    assistant turns included, as context) with the assistant prefix -> token ids, or None when skipped.

    With a chat template it is rendered with `add_generation_prompt=True`; without one the turns'
    contents are joined by blank lines. A prompt longer than `max_prompt_tokens` keeps its last
    `max_prompt_tokens` tokens: earlier context is cut, the question itself never is. A prompt whose
    last user message (from its first character to the assistant prefix) does not fit is skipped (None),
    as is one the chat template refuses (e.g. a role it does not know)."""
    head = messages[: turn + 1]
    if getattr(tokenizer, "chat_template", None):
        from jinja2.exceptions import TemplateError

        try:
            text = tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=False)
        except TemplateError:
            return None
        ids = _ids(tokenizer(text, add_special_tokens=False))  # the template writes its own BOS, if any
    else:
        text = "\n\n".join(m["content"] for m in head)
        ids = _ids(tokenizer(text))
    if len(ids) <= max_prompt_tokens:
        return ids or None
    question = head[-1]["content"].strip()
    at = text.rfind(question) if question else -1
    if at < 0:  # the template rewrote the message: fall back to cutting at most half of the prompt
        return ids[-max_prompt_tokens:] if len(ids) <= 2 * max_prompt_tokens else None
    if len(_ids(tokenizer(text[at:], add_special_tokens=False))) > max_prompt_tokens:
        return None
    return ids[-max_prompt_tokens:]


def _user_turns(conv: list) -> list:
    return [i for i, m in enumerate(conv) if m["role"] == "user"]


def conversation_prompts(convs: Sequence[list], tokenizer, max_prompt_tokens: int) -> list:
    """One prompt per user turn of every conversation, in corpus order (see `turn_prompt`; skipped
    prompts are left out, duplicates are kept) -> [[token id]]."""
    out = []
    for conv in convs:
        for turn in _user_turns(conv):
            ids = turn_prompt(tokenizer, conv, turn, max_prompt_tokens)
            if ids:
                out.append(ids)
    return out


def _prompt_hasher(prompts: Sequence[Sequence[int]], h=None):
    """sha256 fed with `prompts` (after what `h` was fed already)."""
    h = h if h is not None else hashlib.sha256()
    for ids in prompts:
        h.update(torch.tensor(ids, dtype=torch.int32).numpy().tobytes())
        h.update(b"|")
    return h


class PromptStream:
    """Every (conversation, user turn) slot of a corpus, shuffled with `seed`, rendered in that order as the store
    needs its prompts (`ensure`): `prompts` holds the distinct ones found so far, a prefix of the full order. A
    ShareGPT user turn takes ~3-7 ms to render (chat template, tokenizer), all 61k of them 4-7 minutes on 2 CPU
    cores: rendered up front they took a whole `--max-time 6m` of make-data before its first answer."""

    def __init__(self, convs: Sequence[list], tokenizer, max_prompt_tokens: int, seed: int, progress: bool = False):
        self._convs, self._tokenizer, self._max_prompt_tokens = convs, tokenizer, max_prompt_tokens
        self._slots = [(c, t) for c, conv in enumerate(convs) for t in _user_turns(conv)]
        random.Random(seed).shuffle(self._slots)
        self._seen: set = set()
        self._progress = progress
        self.prompts: list = []  # [[token id]], distinct, in the seeded order
        self.slots_read = self.too_long = self.duplicates = 0

    @property
    def slots(self) -> int:
        """User turns in the corpus."""
        return len(self._slots)

    @property
    def exhausted(self) -> bool:
        return self.slots_read >= len(self._slots)

    def ensure(self, n: int) -> int:
        """Render until `n` distinct prompts are found or the corpus ends -> how many there are now."""
        if len(self.prompts) >= n or self.exhausted:
            return len(self.prompts)
        # a bar where the wait is long enough to see (a resumed store re-renders what it answered: its check)
        bar = _progress_bar(min(n, self.slots) - len(self.prompts), 0, self._progress and n - len(self.prompts) > 2000,
                            desc="rendering prompts", unit="prompt")
        try:
            while len(self.prompts) < n and not self.exhausted:
                c, t = self._slots[self.slots_read]
                self.slots_read += 1
                ids = turn_prompt(self._tokenizer, self._convs[c], t, self._max_prompt_tokens)
                if not ids:
                    self.too_long += 1
                elif tuple(ids) in self._seen:
                    self.duplicates += 1
                else:
                    self._seen.add(tuple(ids))
                    self.prompts.append(ids)
                    bar.update(1)
        finally:
            bar.close()
        return len(self.prompts)

    def digest(self, n: Optional[int] = None) -> str:
        """A hash of the first n prompts (all found so far by default): equal means the same prompts in the same
        order."""
        return _prompt_hasher(self.prompts[:n]).hexdigest()[:16]


def ordered_prompts(convs: Sequence[list], tokenizer, max_prompt_tokens: int, seed: int,
                    limit: Optional[int] = None, progress: bool = False) -> PromptStream:
    """Every (conversation, user turn) slot, shuffled with `seed`, rendered in that order until `limit`
    distinct prompts are found (all of them without a limit): a PromptStream, rendered at once."""
    stream = PromptStream(convs, tokenizer, max_prompt_tokens, seed, progress)
    stream.ensure(stream.slots if limit is None else limit)
    return stream


# --- a preallocated KV cache for a batch of rows ------------------------------------------------

@dataclass
class _Rows:
    """What the layers of one `BatchKVCache` share (not the cache itself: no reference cycle keeps a
    dropped cache's buffers alive until the garbage collector runs)."""
    rows: int                 # live rows
    capacity: int             # positions per row
    length: int = 0           # positions written (the same for every row)
    row_range: tuple = (0, 0)  # rows the next forward pass covers
    allocated: int = 0        # rows the buffers hold (a reused cache's may exceed the live rows)


class _RowsLayer(CacheLayerMixin):
    """One decoder layer's keys and values, preallocated as [rows, kv heads, capacity, head dim] and
    indexed by position. `update` writes the new positions in place and returns views of the live rows'
    positions written so far: attention never reads past the current length, nor copies the past."""

    is_sliding = False

    def __init__(self, owner: _Rows):
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        rows, heads, cap = self.owner.allocated, key_states.shape[1], self.owner.capacity
        self.keys = key_states.new_zeros((rows, heads, cap, key_states.shape[-1]))
        self.values = value_states.new_zeros((rows, heads, cap, value_states.shape[-1]))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.owner.length
        end = start + key_states.shape[-2]
        r0, r1 = self.owner.row_range
        self.keys[r0:r1, :, start:end] = key_states
        self.values[r0:r1, :, start:end] = value_states
        return self.keys[r0:r1, :, :end], self.values[r0:r1, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity

    def keep_rows(self, index: Sequence[int], length: int) -> None:
        """Move rows `index` (ascending) to the front, in place: no new buffer, and no row is overwritten
        before it has been moved, since row j takes row index[j] >= j."""
        if self.is_initialized:
            for j, i in enumerate(index):
                if i != j:
                    self.keys[j, :, :length].copy_(self.keys[i, :, :length])
                    self.values[j, :, :length].copy_(self.values[i, :, :length])


class BatchKVCache(Cache):
    """A static KV cache for `rows` sequences of at most `capacity` positions (a transformers `Cache`).

    Every row has the same length (`length`, advanced by the caller after each forward pass): rows
    are left-padded and the padding is masked. `row_range` restricts a forward pass to some rows
    (prefill in groups); `keep_rows` drops finished rows, in place. Sliding-window layers keep every position
    too: the model's mask applies the window, so the cache needs no per-kind logic."""

    def __init__(self, config, rows: int, capacity: int):
        layer_types, _ = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
        bad = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
        if bad:
            raise DiffspecError(f"batched generation supports attention layers only "
                                f"({', '.join(ATTENTION_LAYER_TYPES)}), this model has {', '.join(bad)}")
        self.state = _Rows(rows, capacity, 0, (0, rows), rows)
        super().__init__(layers=[_RowsLayer(self.state) for _ in layer_types])

    @property
    def rows(self) -> int:
        return self.state.rows

    @property
    def capacity(self) -> int:
        return self.state.capacity

    @property
    def length(self) -> int:
        return self.state.length

    @length.setter
    def length(self, value: int) -> None:
        self.state.length = int(value)

    @property
    def row_range(self) -> tuple:
        return self.state.row_range

    @row_range.setter
    def row_range(self, value: tuple) -> None:
        self.state.row_range = tuple(value)

    def advance(self, n: int) -> None:
        """Record that the last forward pass wrote `n` positions to every row."""
        self.length += n
        if self.length > self.capacity:
            raise DiffspecError(f"KV cache overflow: {self.length} positions in a cache of {self.capacity}")

    def reset(self, rows: int) -> None:
        """Empty, for a new batch of `rows` rows (at most those allocated): the buffers stay where they are, so
        CUDA graphs captured over them stay valid (BatchSession)."""
        if not 0 < rows <= self.state.allocated:
            raise ValueError(f"reset needs 1..{self.state.allocated} rows, got {rows}")
        self.state.rows, self.state.length, self.state.row_range = rows, 0, (0, rows)

    def keep_rows(self, index: Sequence[int]) -> None:
        """Keep only rows `index` (ascending), which become rows 0, 1, ...; the buffers stay allocated."""
        index = [int(i) for i in index]
        if index != sorted(set(index)) or (index and index[-1] >= self.rows):
            raise ValueError(f"keep_rows needs ascending row indices below {self.rows}, got {index}")
        for layer in self.layers:
            layer.keep_rows(index, self.length)
        self.state.rows = len(index)
        self.row_range = (0, self.rows)


# --- batched generation ------------------------------------------------------------------------

def _model_device(model) -> torch.device:
    return next(model.parameters()).device


def _choose(logits: torch.Tensor, temperature: float, generator) -> torch.Tensor:
    """Next token per row: argmax at temperature 0, else a sample from softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if isinstance(generator, (list, tuple)):
        return torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(generator)])
    return torch.multinomial(probs, 1, generator=generator).view(-1)


class BatchSession:
    """A batch cache and its decode step kept across generate_batch calls (make-data's batches): the graphs one
    batch captures are replayed by the next, where a cache per batch would capture them all again (a capture
    costs about two eager steps). `rows` and `capacity` bound the batches it takes; a larger one gets a new
    cache (and new graphs)."""

    def __init__(self, model, rows: int, capacity: int, decode_step: str = "auto"):
        self.model, self.rows, self.capacity = model, int(rows), int(capacity)
        self.kind = batch_step.choose_kind(decode_step, model)
        self.cache: Optional[BatchKVCache] = None
        self.stepper = None

    def cache_for(self, rows: int, positions: int) -> BatchKVCache:
        """An empty cache for `rows` rows of up to `positions` positions: this session's, reset, where it fits."""
        if self.cache is None or rows > self.cache.state.allocated or positions > self.cache.capacity:
            self.rows, self.capacity = max(self.rows, rows), max(self.capacity, positions)
            self.cache = BatchKVCache(self.model.config, self.rows, self.capacity)
            self.stepper = batch_step.new_step(self.kind, self.model, self.cache)
        self.cache.reset(rows)
        return self.cache


def _bucket_rows(live: torch.Tensor, rows: int) -> Optional[list]:
    """Rows to keep when a graph step drops finished ones: the live rows and, to a power of two, the first
    finished ones (their tokens are never stored), so a generation runs few row counts; None: no fewer rows."""
    keep = live.nonzero().view(-1).tolist()
    size = 1 << max(0, len(keep) - 1).bit_length()
    if size >= rows:
        return None
    dead = [i for i in range(rows) if not live[i]][: size - len(keep)]
    return sorted(keep + dead)


#: tokens a prefill group takes: on 2 AVX-512 cores, SmolLM2-135M prefilled 256-token prompts at 586 tokens/s in
#: groups of 4,096 tokens and 475 in groups of 16,384 (its intermediates outgrow the caches); a GPU wants them large
PREFILL_TOKENS = {"cpu": 4096, "cuda": 16384}


@torch.inference_mode()
def generate_batch(model, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids, pad_id: int,
                   temperature: float = 0.0,
                   generator: Union[None, torch.Generator, Sequence[torch.Generator]] = None,
                   prefill_tokens: Optional[int] = None, compact_share: float = 0.25, decode_step: str = "auto",
                   session: Optional[BatchSession] = None) -> list:
    """Answer every prompt in one batch -> responses [[token id]] in prompt order, each cut after its
    first stop token (or `max_new_tokens` long).

    The prompts are left-padded to one width and prefilled once (in row groups of at most
    `prefill_tokens` tokens; default PREFILL_TOKENS for the model's device), then every step decodes one token for all rows over a `BatchKVCache`;
    positions come from the attention mask, so padding changes nothing. A row that stopped is no longer
    counted; once `compact_share` of the rows have stopped they are dropped from the batch. The loop
    ends when every row has stopped. Greedy at temperature 0 (the same tokens as decoding each prompt
    alone, up to rounding); otherwise sampled with `generator`: one for the batch, or one per prompt, which
    makes each answer independent of its batch.

    `decode_step` runs the decode steps (batch_step.py): `model` (the model's forward), `direct` (batch_step's
    direct step), `graph` (that step replayed as CUDA graphs) or `auto` (`graph` on CUDA where it applies,
    else `model`). A graph that fails to capture falls back to the model's forward, with a warning. Under
    graphs, finished rows are dropped down to powers of two (few shapes to capture). `session` (a
    BatchSession) keeps the cache and the step, graphs and all, for the next call; its kind then rules."""
    if not prompts:
        return []
    if any(len(p) == 0 for p in prompts):
        raise DiffspecError("generate_batch: empty prompt")
    if isinstance(generator, (list, tuple)) and len(generator) != len(prompts):
        raise DiffspecError(f"generate_batch: {len(generator)} generators for {len(prompts)} prompts")
    device = _model_device(model)
    if session is not None and batch_step._graph_failed and session.kind == "graph":
        session.kind, session.stepper = "model", None  # a capture failed in this process: no more graphs
    kind = session.kind if session is not None else batch_step.choose_kind(decode_step, model)
    n, width = len(prompts), max(len(p) for p in prompts)
    stop_ids = frozenset(int(s) for s in stop_ids)
    stop = torch.tensor(sorted(stop_ids) or [-1], device=device)
    ids = torch.full((n, width), int(pad_id), dtype=torch.long)
    mask = torch.zeros((n, width + max_new_tokens), dtype=torch.long)
    for r, p in enumerate(prompts):
        ids[r, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
        mask[r, width - len(p): width] = 1
    ids, mask = ids.to(device), mask.to(device)
    positions = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    if session is not None:
        cache = session.cache_for(n, width + max_new_tokens)
    else:
        cache = BatchKVCache(model.config, n, width + max_new_tokens)
    if prefill_tokens is None:
        prefill_tokens = PREFILL_TOKENS["cuda" if device.type == "cuda" else "cpu"]
    group = max(1, prefill_tokens // width)
    logits = []
    for r0 in range(0, n, group):
        r1 = min(n, r0 + group)
        cache.row_range = (r0, r1)
        out = model(input_ids=ids[r0:r1], attention_mask=mask[r0:r1, :width], position_ids=positions[r0:r1],
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits.append(out.logits[:, -1])
    cache.row_range = (0, n)
    cache.advance(width)
    logits = torch.cat(logits)
    stepper = session.stepper if session is not None else batch_step.new_step(kind, model, cache)
    rows = list(range(n))                         # prompt index of each live row
    next_pos = positions[:, -1] + 1               # position of the token each row decodes next
    gens = list(generator) if isinstance(generator, (list, tuple)) else generator
    responses = [[] for _ in range(n)]
    done = torch.zeros(n, dtype=torch.bool, device=device)
    for step in range(max_new_tokens):
        tok = _choose(logits, temperature, gens)
        for r, t in zip(rows, tok.tolist()):
            if not responses[r] or responses[r][-1] not in stop_ids:
                responses[r].append(t)
        done |= torch.isin(tok, stop)
        n_done = int(done.sum())
        if n_done == len(rows) or step == max_new_tokens - 1:
            break
        keep_list = None
        if n_done and n_done >= compact_share * len(rows):
            # each row count a graph step meets is a capture: there, rows go in powers of two
            keep_list = (_bucket_rows(~done, len(rows)) if stepper is not None and stepper.graphs
                         else (~done).nonzero().view(-1).tolist())
        if keep_list is not None:
            keep = torch.tensor(keep_list, device=device)
            cache.keep_rows(keep_list)
            rows = [rows[i] for i in keep_list]
            if isinstance(gens, list):
                gens = [gens[i] for i in keep_list]
            tok, mask, next_pos, done = tok[keep], mask[keep], next_pos[keep], done[keep]
        mask[:, width + step] = 1
        logits, stepper = batch_step.try_step(stepper, tok, next_pos, mask)
        if logits is None:
            out = model(input_ids=tok.view(-1, 1), attention_mask=mask[:, : width + step + 1],
                        position_ids=next_pos.view(-1, 1), past_key_values=cache, use_cache=True, logits_to_keep=1)
            logits = out.logits[:, -1]
        cache.advance(1)
        next_pos = next_pos + 1
    return responses


# --- batch size by measurement -----------------------------------------------------------------

@dataclass(frozen=True)
class BatchChoice:
    """The measured decode throughput per batch size, and the batch chosen."""
    batch_size: int
    tokens_per_s: dict        # {batch: generated tokens per second}
    cache_len: int            # positions in the cache while timing
    device: str
    seconds: float            # time the measurement took

    def to_dict(self) -> dict:
        return {"chosen": self.batch_size, "tokens_per_s": {str(b): round(v, 1) for b, v in self.tokens_per_s.items()},
                "cache_len": self.cache_len, "device": self.device, "seconds": round(self.seconds, 2)}


@torch.inference_mode()
def decode_step_seconds(model, batch: int, cache_len: int, steps: int = 2, decode_step: str = "model") -> float:
    """Seconds per decode step (one token for each of `batch` rows) with `cache_len` positions in the
    cache, run by `decode_step` (as generate_batch's): the best of `steps` (a first one-token pass allocates
    the cache and warms up; a graph is captured by the first timed step). The cache holds zeros; the work is
    the same."""
    device = _model_device(model)
    kind = batch_step.choose_kind(decode_step, model)
    steps = max(steps, 3) if kind == "graph" else steps  # the first timed step captures the graph
    cache = BatchKVCache(model.config, batch, cache_len + steps)
    tok = torch.zeros((batch, 1), dtype=torch.long, device=device)
    model(input_ids=tok, past_key_values=cache, use_cache=True, logits_to_keep=1).logits.argmax(-1).tolist()
    cache.length = cache_len
    stepper = batch_step.new_step(kind, model, cache)
    mask = torch.ones((batch, cache_len + steps), dtype=torch.long, device=device)
    best = math.inf
    for _ in range(steps):
        pos = torch.full((batch, 1), cache.length, dtype=torch.long, device=device)
        t0 = time.perf_counter()
        logits, stepper = batch_step.try_step(stepper, tok.view(-1), pos.view(-1), mask)
        if logits is None:
            logits = model(input_ids=tok, attention_mask=mask[:, : cache.length + 1], position_ids=pos,
                           past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        logits.argmax(-1).tolist()  # waits for the device, as the real loop does
        cache.advance(1)
        best = min(best, time.perf_counter() - t0)
    return best


def choose_batch_size(model, device=None, cache_len: int = 384, candidates: Optional[Sequence[int]] = None,
                      min_gain: float = 1.1, patience: int = 2, search_at_least: int = 16,
                      steps: int = 2, decode_step: str = "model") -> BatchChoice:
    """Time decode steps at growing batch sizes (1, 4, 8, ... up to 64 on a CPU, 512 on CUDA) with
    `cache_len` positions in the cache and take the fastest in tokens/s.

    Growing stops once `patience` sizes in a row fail to beat the best by `min_gain` (or memory runs
    out), but not below `search_at_least`: small batches are bound by reading the weights, so a slower
    reading there is another process's noise, not the machine's limit. The best and its neighbours are
    then timed once more, each keeping its faster reading, so that one burst of load on a shared machine
    cannot pick the batch."""
    device = torch.device(device) if device is not None else _model_device(model)
    if candidates is None:
        top = 512 if device.type == "cuda" else 64
        candidates = [b for b in (1, 4, 8, 16, 32, 64, 128, 256, 512) if b <= top]
    t0 = time.perf_counter()
    rates: dict = {}

    def measure(b: int) -> bool:
        try:
            rates[b] = max(rates.get(b, 0.0), b / decode_step_seconds(model, b, cache_len, steps, decode_step))
            return True
        except torch.OutOfMemoryError:
            return False

    best, misses = None, 0
    for b in candidates:
        if not measure(b):
            break
        misses = 0 if best is None or rates[b] >= min_gain * rates[best] else misses + 1
        if best is None or rates[b] > rates[best]:
            best = b
        if misses >= patience and b >= search_at_least:
            break
    tried = list(rates)
    at = tried.index(best)
    for b in tried[max(0, at - 1): at + 2]:
        measure(b)
    best = max(rates, key=rates.get)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return BatchChoice(best, rates, cache_len, str(device), time.perf_counter() - t0)


@dataclass(frozen=True)
class StepChoice:
    """The decode step make-data runs on a CPU: each kind's measured seconds a step, and the faster."""
    kind: str
    seconds: dict             # {kind: best seconds a step}
    batch: int
    cache_len: int

    def to_dict(self) -> dict:
        return {"chosen": self.kind, "ms_per_step": {k: round(v * 1e3, 2) for k, v in self.seconds.items()},
                "batch": self.batch, "cache_len": self.cache_len}


def choose_cpu_step(model, batch: int, cache_len: int, turns: int = 2, kinds: Sequence[str] = ("model", "direct"),
                    ) -> StepChoice:
    """Time `kinds` of decode step (generate_batch's) at `batch` rows with `cache_len` positions, alternated
    `turns` times, each keeping its best -> the faster. On 2 AVX-512 cores the direct step (attention by
    fused_layers.c) ran SmolLM2-135M's 32/64/128-row steps 1.28-1.36x faster than the model's forward."""
    best: dict = {}
    for _ in range(turns):
        for kind in kinds:
            best[kind] = min(best.get(kind, math.inf), decode_step_seconds(model, batch, cache_len, 2, kind))
    return StepChoice(min(best, key=best.get), best, batch, cache_len)


# --- the store ---------------------------------------------------------------------------------

class TokenStore:
    """A store folder read back: `manifest` (dict), `len(store)` sequences, and `sequences`, a list of
    (ids LongTensor [T], prompt length) in stored order (loaded on first use); `temperatures` gives
    each sequence's sampling temperature."""

    def __init__(self, path: Path, manifest: dict):
        self.path = Path(path)
        self.manifest = manifest
        self._sequences: Optional[list] = None
        self._temperatures: Optional[list] = None

    def __len__(self) -> int:
        return sum(int(s["sequences"]) for s in self.manifest["shards"])

    def __repr__(self) -> str:
        return f"TokenStore({str(self.path)!r}, {len(self)} sequences, target {self.manifest.get('target')!r})"

    def _load(self) -> None:
        seqs, temps = [], []
        for shard in self.manifest["shards"]:
            if not shard["sequences"]:
                continue
            data = _read_shard(self.path / shard["file"])
            tokens, offsets = data["tokens"].long(), data["offsets"].tolist()
            for i, (plen, temp) in enumerate(zip(data["prompt_lens"].tolist(), data["temperature"].tolist())):
                seqs.append((tokens[offsets[i]: offsets[i + 1]].clone(), int(plen)))
                temps.append(round(float(temp), 6))  # float32 on disk: 0.7 reads 0.699999988
        self._sequences, self._temperatures = seqs, temps

    @property
    def sequences(self) -> list:
        if self._sequences is None:
            self._load()
        return self._sequences

    @property
    def temperatures(self) -> list:
        if self._temperatures is None:
            self._load()
        return self._temperatures


def _read_shard(path: Path) -> dict:
    from safetensors.torch import load_file

    if not path.is_file():
        raise DiffspecError(f"token store shard {path} is missing")
    data = load_file(str(path))
    missing = [k for k in ("tokens", "offsets", "prompt_lens", "temperature") if k not in data]
    if missing:
        raise DiffspecError(f"{path} is not a token store shard (no {', '.join(missing)})")
    return data


def read_store(path) -> TokenStore:
    """Open a store folder written by `build_store` (DiffspecError naming the path if it is not one)."""
    path = Path(path).expanduser()
    return TokenStore(path, _read_manifest(path))


def _write_atomic(path: Path, write) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def _write_shard(path: Path, sequences: list) -> None:
    """sequences: [(ids list, prompt length, temperature)]."""
    from safetensors.torch import save_file

    lengths = [len(ids) for ids, _, _ in sequences]
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    tensors = {"tokens": torch.tensor([t for ids, _, _ in sequences for t in ids], dtype=torch.int32),
               "offsets": torch.tensor(offsets, dtype=torch.int64),
               "prompt_lens": torch.tensor([p for _, p, _ in sequences], dtype=torch.int32),
               "temperature": torch.tensor([t for _, _, t in sequences], dtype=torch.float32)}
    _write_atomic(path, lambda tmp: save_file(tensors, str(tmp), metadata={"format": FORMAT}))


def _write_manifest(out: Path, manifest: dict) -> None:
    _write_atomic(out / MANIFEST, lambda tmp: tmp.write_text(json.dumps(manifest, indent=1), encoding="utf-8"))


def _response_key(ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(torch.tensor(list(ids), dtype=torch.int32).numpy().tobytes(), digest_size=16).digest()


def _sample_generator(seed: int, prompt_index: int, temperature_index: int, device) -> torch.Generator:
    """The generator of one sampled answer: a function of the seed and the prompt's place in the order only."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + prompt_index) * 101 + temperature_index)
    return g


def _open_or_start(out: Path, target, settings: StoreSettings, order: PromptStream, header: dict) -> dict:
    """The manifest of an existing store after checking it may be continued, or a new one."""
    if (out / MANIFEST).is_file():
        manifest = _read_manifest(out)
        for key in ("target", "tokenizer_fingerprint"):
            if manifest.get(key) != header[key]:
                raise DiffspecError(f"{out} was built by {key} {manifest.get(key)!r}, not {header[key]!r}: "
                                    f"a store holds one target's answers; write to a new folder")
        done = int(manifest["prompts_done"])
        if order.ensure(done) < done or order.digest(done) != manifest.get("prompts_done_sha256"):
            raise DiffspecError(f"{out}: the first {done} prompts of this corpus (in the seeded order) are not the "
                                f"ones already answered (corpus, chat template or evaluation sets changed?); "
                                f"write to a new folder")
        return manifest
    out.mkdir(parents=True, exist_ok=True)
    return {**header, "prompts_total": 0, "prompts_done": 0, "prompts_done_sha256": order.digest(0), "shards": [],
            "duplicates_dropped": 0, "generated_tokens_total": 0, "generation_seconds": 0.0,
            "generated_tokens_per_s": None}


def _stored_response_keys(out: Path, manifest: dict) -> set:
    keys = set()
    for shard in manifest["shards"]:
        if not shard["sequences"]:
            continue
        data = _read_shard(out / shard["file"])
        tokens, offsets = data["tokens"].tolist(), data["offsets"].tolist()
        for i, plen in enumerate(data["prompt_lens"].tolist()):
            keys.add(_response_key(tokens[offsets[i] + plen: offsets[i + 1]]))
    return keys


def build_store(out, target, convs: Sequence[list], *, max_new_tokens: int = 256, max_prompt_tokens: int = 512,
                batch_size: Union[str, int] = "auto", temperatures: Sequence[float] = (0.0,), seed: int = 0,
                max_prompts: Optional[int] = None, deadline: Optional[float] = None, shard_sequences: int = 1024,
                progress: bool = True, corpus: Optional[str] = None, decode_step: str = "auto") -> dict:
    """Let `target` (a diffspec Target) answer the prompts of `convs` and store the answers in folder
    `out` (see the module docstring) -> the manifest.

    Stops after `max_prompts` prompts (all by default) or at `deadline` (a `time.time()` value): a chunk
    is sized to end in time, and one the deadline overtakes is not written. Rerunning on the same
    folder with the same settings continues where it stopped (a larger `max_prompts` extends the
    store); other settings, another target or other prompts are refused. `batch_size`, `shard_sequences`
    and `decode_step` (generate_batch's) may differ between runs: they change how, not what, is generated.
    `corpus` is a label recorded in the manifest."""
    settings = StoreSettings(max_new_tokens=max_new_tokens, max_prompt_tokens=max_prompt_tokens,
                             temperatures=tuple(temperatures), seed=seed, batch_size=batch_size,
                             shard_sequences=shard_sequences, max_prompts=max_prompts, corpus=corpus)
    if target.tokenizer is None:
        raise DiffspecError("build_store needs a target with a tokenizer")
    context = getattr(target.model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if context and max_prompt_tokens + max_new_tokens > context:
        raise DiffspecError(f"max_prompt_tokens + max_new_tokens = {max_prompt_tokens + max_new_tokens} exceeds "
                            f"{target.name}'s context of {context} positions")
    out = Path(out).expanduser()
    check_store_folder(out, settings)
    before = _read_manifest(out)["prompts_done"] if (out / MANIFEST).is_file() else 0
    kept, overlap = drop_evaluation_overlap(list(convs), evaluation_prompts())
    order = PromptStream(kept, target.tokenizer, max_prompt_tokens, seed, progress)  # rendered as needed
    limit = None if max_prompts is None else max(max_prompts, before)
    temps = settings.temperatures
    header = {"format": FORMAT, "version": VERSION, "target": target.name,
              "tokenizer_fingerprint": target.tokenizer_fingerprint,
              "settings": {"max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens,
                           "temperatures": list(temps), "corpus": corpus, "seed": seed, "batch_size": batch_size,
                           "shard_sequences": shard_sequences, "batch_choice": None}}
    manifest = _open_or_start(out, target, settings, order, header)

    def counted() -> None:  # what the rendering found so far; prompts_total None while the corpus is not all read
        if limit is not None and len(order.prompts) >= limit:
            total = limit
        else:
            total = len(order.prompts) if order.exhausted else None
        manifest.update(prompts_total=total, conversations=len(kept), evaluation_overlap_dropped=overlap,
                        user_turns=order.slots, user_turns_read=order.slots_read,
                        prompts_skipped_too_long=order.too_long, duplicate_prompts_dropped=order.duplicates)

    manifest["settings"].update(corpus=corpus if corpus is not None else manifest["settings"].get("corpus"),
                                batch_size=batch_size, shard_sequences=shard_sequences)
    done = manifest["prompts_done"]
    end = limit if limit is not None else order.slots  # at most this many prompts (user turns bound them)
    # the prompts the batch probe's typical length reads, and whether any prompt is left at all
    if done >= end or order.ensure(min(end, done + 256)) <= done:
        counted()
        _write_manifest(out, manifest)
        return manifest

    model, device = target.model, _model_device(target.model)
    kind = batch_step.choose_kind(decode_step, model)
    stop_ids = frozenset(int(s) for s in target.stop_token_ids)
    pad = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0
    lens = sorted(len(p) for p in order.prompts[done:end])
    probe_len = lens[len(lens) // 2] + max_new_tokens // 2  # a typical step's positions
    manifest["settings"].pop("decode_step_choice", None)  # this run's, or none (a resumed store's earlier one is not)
    if decode_step == "auto" and batch_step.direct_may_win(model):  # a CPU: the faster step, by measurement
        step_choice = choose_cpu_step(model, 32 if batch_size == "auto" else int(batch_size), probe_len)
        manifest["settings"]["decode_step_choice"] = step_choice.to_dict()
        kind = step_choice.kind
    if batch_size == "auto":
        choice = choose_batch_size(model, device, cache_len=probe_len, decode_step=kind)
        manifest["settings"]["batch_choice"] = choice.to_dict()
        batch = choice.batch_size
        kind = batch_step.choose_kind(kind, model)  # `model` if the probe's graph failed to capture
    else:
        batch = int(batch_size)
    manifest["settings"]["decode_step"] = kind
    manifest["settings"]["kernels"] = getattr(target, "kernels", None)  # this run's (q8: another arithmetic)
    session = BatchSession(model, batch, max_prompt_tokens + max_new_tokens, kind)  # one cache, its graphs kept
    seen = _stored_response_keys(out, manifest)
    hasher = _prompt_hasher(order.prompts[:done])  # prompts_done_sha256, extended chunk by chunk
    chunk_prompts = max(1, shard_sequences // len(temps))
    bar = _progress_bar(end * len(temps), done * len(temps), progress)  # (user turns: an upper bound)
    run_start, run_prompts = time.time(), 0
    try:
        while done < end:
            n = min(chunk_prompts, order.ensure(min(end, done + chunk_prompts)) - done)
            if n < 1:  # the corpus has no more prompts
                break
            if deadline is not None:
                left = deadline - time.time()
                if run_prompts:  # size the chunk to end in time, from this run's pace
                    pace = (time.time() - run_start) / run_prompts
                    n = min(n, int(0.9 * left / pace))
                else:            # no pace yet: one batch per temperature, fewer if the probe says it would not end
                    n = first_chunk_prompts(min(n, batch), left, len(temps), max_new_tokens,
                                            manifest["settings"]["batch_choice"])
                if left <= 0 or n < 1:
                    break
            t0 = time.time()
            answers, generated = _answer_chunk(model, order.prompts, done, n, temps, batch, max_new_tokens, stop_ids,
                                               pad, seed, device, deadline, bar, session)
            if answers is None:  # overtaken by the deadline: nothing of this chunk is written
                break
            seconds = time.time() - t0
            kept_seqs, dropped = [], 0
            for i in range(done, done + n):
                for k, temp in enumerate(temps):
                    resp = answers[(i, k)]
                    key = _response_key(resp)
                    if key in seen:
                        dropped += 1
                        continue
                    seen.add(key)
                    kept_seqs.append((order.prompts[i] + resp, len(order.prompts[i]), temp))
            entry = {"file": f"shard-{len(manifest['shards']):05d}.safetensors", "sequences": len(kept_seqs),
                     "tokens": sum(len(s) for s, _, _ in kept_seqs),
                     "generated_tokens": sum(len(s) - p for s, p, _ in kept_seqs),
                     "prompts": [done, done + n], "batch_size": batch,
                     "kernels": manifest["settings"]["kernels"]}  # (q8's answers are another arithmetic's)
            _write_shard(out / entry["file"], kept_seqs)
            done += n
            run_prompts += n
            manifest["shards"].append(entry)
            manifest["prompts_done"] = done
            manifest["prompts_done_sha256"] = _prompt_hasher(order.prompts[done - n: done], hasher).hexdigest()[:16]
            manifest["duplicates_dropped"] += dropped
            manifest["generated_tokens_total"] += generated
            manifest["generation_seconds"] = round(manifest["generation_seconds"] + seconds, 2)
            manifest["generated_tokens_per_s"] = round(manifest["generated_tokens_total"]
                                                       / max(manifest["generation_seconds"], 1e-9), 1)
            counted()
            _write_manifest(out, manifest)
    finally:
        bar.close()
    counted()
    if batch_step._graph_failed:  # a capture failed in this run: the steps after it ran the model's forward
        manifest["settings"]["decode_step"] = f"model (graph failed: {batch_step._graph_failed[0][:300]})"
    _write_manifest(out, manifest)
    return manifest


def first_chunk_prompts(cap: int, seconds_left: float, temperatures: int, max_new_tokens: int,
                        batch_choice: Optional[dict]) -> int:
    """How many prompts the first chunk of a run under a deadline takes (at most `cap`): the most whose
    answers, every one at full length, the batch probe's tokens/s (`batch_choice`, at the largest probed
    batch no bigger than the chunk) says end within 0.9 of the time left. A chunk the deadline overtakes
    is lost whole, so a first chunk sized only by the batch (48 prompts x 2 temperatures x 256 tokens: two
    minutes on 2 CPU cores) stored nothing under a one-minute budget. Without a probe (a fixed batch size):
    `cap`. Never below 1."""
    rates = {int(b): float(r) for b, r in ((batch_choice or {}).get("tokens_per_s") or {}).items() if float(r) > 0}
    if not rates:
        return cap
    for n in range(cap, 0, -1):
        probed = [b for b in rates if b <= n]
        rate = rates[max(probed)] if probed else rates[min(rates)] * n / min(rates)
        if n * temperatures * max_new_tokens / rate <= 0.9 * seconds_left:
            return n
    return 1


def _progress_bar(total: int, initial: int, enabled: bool, desc: str = "target answers", unit: str = "answer"):
    from ..progress import progress_bar

    return progress_bar(total, desc, unit=unit, enabled=enabled, initial=initial)


def _answer_chunk(model, prompts: list, start: int, n: int, temps: tuple, batch: int, max_new_tokens: int,
                  stop_ids, pad: int, seed: int, device, deadline: Optional[float], bar,
                  session: Optional[BatchSession] = None) -> tuple:
    """Answer prompts[start:start+n] once per temperature -> ({(prompt index, temperature index): response},
    generated tokens), or (None, 0) when the deadline passed before the chunk was done. A batch holds one
    temperature and prompts of similar length (the chunk sorted by length)."""
    by_length = sorted(range(start, start + n), key=lambda i: (len(prompts[i]), i))
    batches = [[(k, i) for i in by_length[b0: b0 + batch]] for k in range(len(temps))
               for b0 in range(0, n, batch)]
    answers, generated, t0 = {}, 0, time.time()
    for items in batches:
        if deadline is not None and time.time() > deadline:
            return None, 0
        temp = temps[items[0][0]]
        gens = [_sample_generator(seed, i, k, device) for k, i in items] if temp > 0 else None
        responses = generate_batch(model, [prompts[i] for _, i in items], max_new_tokens, stop_ids, pad,
                                   temperature=temp, generator=gens, session=session)
        for (k, i), resp in zip(items, responses):
            answers[(i, k)] = resp
            generated += len(resp)
        bar.update(len(items))
        bar.set_postfix_str(f"{generated / max(time.time() - t0, 1e-9):.0f} tok/s", refresh=False)
    return answers, generated


def corpus_sequence(tokenizer, messages: list) -> Optional[tuple]:
    """A conversation as (ids of the whole rendering, length of its prompt): the prompt is the first user
    turn with the assistant prefix, the rest (answers and later turns) is the response. None when there is
    no assistant text after the first user turn, or the chat template refuses the conversation."""
    users = _user_turns(messages)
    if not users or not any(m["role"] == "assistant" for m in messages[users[0] + 1:]):
        return None
    if getattr(tokenizer, "chat_template", None):
        from jinja2.exceptions import TemplateError

        try:
            prompt = tokenizer.apply_chat_template(messages[: users[0] + 1], add_generation_prompt=True, tokenize=False)
            whole = tokenizer.apply_chat_template(messages, tokenize=False)
        except TemplateError:
            return None
        if not whole.startswith(prompt):
            return None
        ids = _ids(tokenizer(whole, add_special_tokens=False))
        head = _ids(tokenizer(prompt, add_special_tokens=False))
    else:
        prompt = "\n\n".join(m["content"] for m in messages[: users[0] + 1]) + "\n\n"
        ids = _ids(tokenizer(prompt + "\n\n".join(m["content"] for m in messages[users[0] + 1:])))
        head = _ids(tokenizer(prompt))
    if ids[: len(head)] != head:  # a token merged across the boundary: the prompt is not a prefix; skip
        return None
    plen = len(head)
    return (ids, plen) if len(ids) - plen >= 2 else None


def build_corpus_store(out, target, convs: Sequence[list], *, seed: int = 0, max_conversations: Optional[int] = None,
                       shard_sequences: int = 1024, progress: bool = True, corpus: Optional[str] = None) -> dict:
    """Write the conversations of `convs` themselves (see the module docstring) to the new store folder `out`:
    evaluation-set overlap dropped, shuffled with `seed`, the first `max_conversations` (all by default),
    identical responses kept once. -> the manifest."""
    if target.tokenizer is None:
        raise DiffspecError("build_corpus_store needs a target with a tokenizer")
    out = check_corpus_store_folder(out, max_conversations)
    kept, overlap = drop_evaluation_overlap(list(convs), evaluation_prompts())
    order = list(range(len(kept)))
    random.Random(seed).shuffle(order)
    if max_conversations is not None:
        order = order[:max_conversations]
    seqs, seen, skipped, dup = [], set(), 0, 0
    bar = _progress_bar(len(order), 0, progress, desc="rendering conversations", unit="conversation")
    try:
        for c in order:
            bar.update(1)
            item = corpus_sequence(target.tokenizer, kept[c])
            if item is None:
                skipped += 1
                continue
            ids, plen = item
            key = _response_key(ids[plen:])
            if key in seen:
                dup += 1
                continue
            seen.add(key)
            seqs.append((ids, plen, -1.0))
    finally:
        bar.close()
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"format": FORMAT, "version": VERSION, "target": target.name,
                "tokenizer_fingerprint": target.tokenizer_fingerprint, "source": "corpus",
                "settings": {"source": "corpus", "corpus": corpus, "seed": seed, "max_prompts": max_conversations,
                             "shard_sequences": shard_sequences},
                "prompts_total": len(order), "prompts_done": len(order), "shards": [], "conversations": len(kept),
                "evaluation_overlap_dropped": overlap, "conversations_skipped": skipped, "duplicates_dropped": dup,
                "generated_tokens_total": 0, "generation_seconds": 0.0, "generated_tokens_per_s": None,
                "response_tokens_total": sum(len(i) - p for i, p, _ in seqs)}
    for start in range(0, len(seqs), shard_sequences):
        part = seqs[start: start + shard_sequences]
        entry = {"file": f"shard-{len(manifest['shards']):05d}.safetensors", "sequences": len(part),
                 "tokens": sum(len(i) for i, _, _ in part), "generated_tokens": 0, "prompts": [start, start + len(part)]}
        _write_shard(out / entry["file"], part)
        manifest["shards"].append(entry)
    _write_manifest(out, manifest)
    return manifest

