"""The target model: the AR model whose output diffspec reproduces exactly.

The target contract (`TargetBase`), which the engine, drafters, policies, bench and server rely on:
`forward(tokens)` appends tokens to a position-indexed KV cache and returns one row of logits per
token (and, on request, hidden states of chosen layers), `truncate(n)` rolls the cache back to n
positions, `reset()` empties it; `encode_prompt` / `decode` / `stop_token_ids` handle text. A round
verifies k drafted tokens in ONE forward pass of k+1 tokens.

Two backends implement it: `Target` here (any transformers causal LM) and
`backends.llama_cpp.LlamaCppTarget` (a GGUF file run by llama.cpp). Whatever only a transformers
model has (`.model`, its embeddings, `generate`) is reached through `Target` alone; code that needs
it checks `target.backend` and refuses another backend by name.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from .cache import (cache_length, copy_fixed_cache, earliest_length, fixed_cache_capacity, fixed_capacity,
                    new_cache, new_fixed_cache, reserve_cache, set_fixed_length, truncate_cache)
from .errors import DiffspecError, refuse_misplaced_system_message
from .llama_pass import LlamaPass
from .llama_pass import applies as llama_pass_applies
from .models import DEFAULT_MODEL, load_model_and_tokenizer


@dataclass(frozen=True)
class _Prefill:
    """A prefill the cache still holds: its tokens, the layers whose hidden states it returned (and them), and
    the passes' arithmetic then (`Target._arithmetic`)."""

    tokens: torch.Tensor
    layers: tuple
    hidden: Optional[torch.Tensor]
    capacity: Optional[int]  # a fixed-capacity cache's, which the pass attended over
    arithmetic: tuple


#: the most a kept prefill's hidden states may hold (a long prompt's features on a wide model: 400 MB at 8k tokens x
#: 3 layers x 4096); beyond it the prefill is kept for requests that read none
KEPT_HIDDEN_BYTES = 64 << 20


class TargetOutput:
    """One pass's rows: `logits` [n, V] (row i predicts the token after tokens[i]) and `hidden_states`
    [n, len(layers) * hidden] or None. Where the target screens its greedy head (greedy_head.py) the
    pass stops before the head: `greedy_tokens()` screens `final_hidden`, and `logits` are computed
    from it on first read (what sampling reads), through the head as the model's own pass runs it."""

    __slots__ = ("_logits", "hidden_states", "final_hidden", "head")

    def __init__(self, logits: Optional[torch.Tensor], hidden_states: Optional[torch.Tensor] = None,
                 final_hidden: Optional[torch.Tensor] = None, head=None):
        if logits is None and (final_hidden is None or head is None):
            raise ValueError("a TargetOutput needs logits, or the last hidden state and the head")
        self._logits, self.hidden_states, self.final_hidden, self.head = logits, hidden_states, final_hidden, head

    @property
    def logits(self) -> torch.Tensor:
        if self._logits is None:
            with torch.inference_mode():
                self._logits = self.head.logits(self.final_hidden)
        return self._logits

    def greedy_tokens(self) -> torch.Tensor:
        """Each row's greedy choice [n] int64: screened where the pass stopped before the head (exactly the
        argmax of the head's dot products), else the logits' argmax."""
        if self._logits is None:
            return self.head.tokens(self.final_hidden)
        from .packed_linear import argmax_rows  # torch's argmax where the C library does not build

        return argmax_rows(self._logits)


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of the vocabulary (token -> id): equal means interchangeable ids. Which tokens count as
    "special" is left out: it is metadata that changes between transformers versions for the same
    file (SmolLM2's GGUF under transformers 5.17 names <|im_start|> its EOS, 5.23 <|im_end|>)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    blob = json.dumps(vocab, ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


_TURN_PROBE = "diffspec-end-of-turn-probe"


def _rendered_assistant_turns(tokenizer) -> Iterator[str]:
    """The chat template rendered for small conversations with an assistant reply reading `_TURN_PROBE`:
    ending on that reply, then followed by a user turn (some templates close only earlier turns), each
    also with a system message first (some templates insist on one). Conversations that the template
    refuses (jinja errors, raise_exception(...) on roles it does not know) are skipped."""
    if not getattr(tokenizer, "chat_template", None) or not hasattr(tokenizer, "apply_chat_template"):
        return
    reply = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _TURN_PROBE}]
    follow_up = [{"role": "user", "content": "Thanks"}]
    system = [{"role": "system", "content": "Be brief."}]
    for messages in (reply, reply + follow_up, system + reply, system + reply + follow_up):
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception:  # a template may raise anything
            continue
        if isinstance(text, str) and _TURN_PROBE in text:
            yield text


def template_end_of_turn_id(tokenizer) -> Optional[int]:
    """The token the chat template writes right after an assistant message (ChatML's <|im_end|>,
    Llama-3's <|eot_id|>, Gemma's <end_of_turn>), or None. Only a special or added token counts,
    never plain text; the template's other special tokens (e.g. Llama-3's <|end_header_id|>) do not."""
    specials = {t for t in list(getattr(tokenizer, "all_special_tokens", [])) + list(tokenizer.get_added_vocab()) if t}
    for text in _rendered_assistant_turns(tokenizer):
        after = text[text.index(_TURN_PROBE) + len(_TURN_PROBE):].lstrip()
        # the longest match, so that e.g. "<|end|>" cannot shadow a longer token sharing its beginning
        token = max((t for t in specials if after.startswith(t)), key=len, default=None)
        tid = tokenizer.convert_tokens_to_ids(token) if token is not None else None
        if isinstance(tid, int) and tid >= 0:
            return tid
    return None


def chat_stop_token_ids(tokenizer) -> set:
    """The tokenizer's EOS plus the chat template's end-of-turn token (see template_end_of_turn_id)."""
    ids = set()
    if tokenizer is None:
        return ids
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    end_of_turn = template_end_of_turn_id(tokenizer)
    if end_of_turn is not None:
        ids.add(end_of_turn)
    return ids


def generation_eos_ids(model) -> set:
    """`model.generation_config.eos_token_id` (None, an int or a list) as a set of ints."""
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    eos = [eos] if isinstance(eos, int) else list(eos or [])
    return {int(e) for e in eos}


class TargetBase:
    """What every backend shares: the text side (prompt encoding with the chat template, decoding,
    the vocabulary's fingerprint). A backend sets tokenizer, name, max_context, device, dtype,
    stop_token_ids, forward_passes and implements forward / truncate / reset / cache_len /
    vocab_size / fingerprint."""

    backend = "abstract"
    tokenizer = None
    name = "model"
    config = None  # the model's transformers config (shapes); a GGUF's is read from the file
    #: the drafters that need the target's hidden states (or its weights) can run on this backend
    exposes_hidden_states = True
    #: the widest pass whose every row equals a one-token pass (None: any width); the engine never
    #: verifies more than this many tokens at once
    max_verify_tokens: Optional[int] = None
    #: the engine refuses a drafter where this is False, giving `inexact_reason`. On llama.cpp it is
    #: measured: verify rows there must equal one-token rows bitwise (backends/llama_cpp.py). On
    #: transformers a row of a k-row pass may differ from a one-token row in the last bits (other
    #: matmul kernels), as in any speculative decoder built on it: greedy output stays plain's unless
    #: two logits tie to within that; the tests run float64 targets, where they agree exactly.
    speculation_exact = True
    inexact_reason = ""
    #: where the target's arithmetic is one whose k-row passes round unlike its one-token steps often enough to
    #: matter (bfloat16, float16), what the engine says in every result's notes (None: float32 and float64)
    rounding_note: Optional[str] = None

    #: whether the default drafter (`auto`) may include one that reads hidden states on this backend
    #: (False where reading them costs every pass more than such a drafter was measured to give back)
    hidden_states_by_default = True
    #: whether passes that return hidden states give the same logits as passes that do not (llama.cpp
    #: measures it with the parity probe; a transformers pass computes the same either way)
    hidden_states_exact = True
    hidden_states_inexact_reason = ""

    def reserve(self, positions: int) -> None:
        """A hint at the request's start: the cache will hold up to `positions` positions."""

    def prefill(self, tokens: torch.Tensor, positions: int,
                hidden_layers: Sequence[int] = ()) -> Optional[torch.Tensor]:
        """A request's start: an empty cache with room for `positions` positions, then `tokens` (the prompt but
        its last token) in one pass whose logits go unread. Returns the hidden states of `hidden_layers` at
        those positions ([n, len * hidden]; None without layers or tokens). `Target` keeps a prompt it
        prefilled last where it can (`Target.prefill`); other backends prefill every time."""
        self.reset()
        self.reserve(positions)
        if tokens.shape[0] == 0:
            return None
        return self.forward(tokens, hidden_layers=hidden_layers, logits=False).hidden_states

    def input_embeddings(self) -> torch.nn.Module:
        """The target's token embedding (ids -> [n, hidden], with any scale the model applies to it),
        for drafters that share it (the conditioned kind)."""
        raise DiffspecError(f"the {self.backend} backend does not expose the target's embeddings")

    def output_head_weight(self) -> torch.Tensor:
        """The target's output head [rows, hidden] (shared by drafters that score with it; never modified)."""
        raise DiffspecError(f"the {self.backend} backend does not expose the target's output head")

    @property
    def declared_vocab_size(self) -> int:
        """The vocabulary size the model's config declares (the embedding may have padding rows); the
        head's rows where the config declares none."""
        text = self.config.get_text_config(decoder=True) if self.config is not None else None
        return int(getattr(text, "vocab_size", None) or self.vocab_size)

    def check_drafter(self, drafter_name: str, needs_hidden_states: bool) -> None:
        """Refuse, by name, a drafter this backend cannot feed."""
        if needs_hidden_states and not self.exposes_hidden_states:
            raise DiffspecError(f"drafter '{drafter_name}' needs the target's hidden states and weights, which the "
                                f"{self.backend} backend does not expose; use --backend transformers, or a drafter "
                                f"that needs only token ids (prompt-lookup, an AR model, a block-diffusion model)")

    # --- text --------------------------------------------------------------------------
    def _need_tokenizer(self):
        if self.tokenizer is None:
            raise DiffspecError("this target has no tokenizer: pass token ids instead of text")
        return self.tokenizer

    def encode_prompt(self, prompt: str, chat: bool = True, system: Optional[str] = None) -> list:
        """Prompt text -> token ids; with chat=True the tokenizer's chat template is applied."""
        if not isinstance(prompt, str) or not prompt.strip():
            raise DiffspecError("prompt is empty")
        tok = self._need_tokenizer()
        if system:
            refuse_misplaced_system_message(tok, chat, self.name)
        if chat and getattr(tok, "chat_template", None):
            messages = ([{"role": "system", "content": system}] if system else []) + \
                       [{"role": "user", "content": prompt}]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        return [int(i) for i in tok(prompt, add_special_tokens=True)["input_ids"]]

    def decode(self, ids: Sequence[int]) -> str:
        return self._need_tokenizer().decode(list(ids), skip_special_tokens=True)

    @property
    def tokenizer_fingerprint(self) -> Optional[str]:
        return tokenizer_fingerprint(self.tokenizer) if self.tokenizer is not None else None


def check_fixed_cache_attention(implementation: str) -> None:
    """A fixed-capacity cache relies on the attention mask to keep the rows past its length (stale drafts,
    zeros) out; attention kernels that take no such mask from transformers (flash-attention builds its
    own causal mask over the whole capacity) would read them. Refused by name."""
    from .attention import GQA_SDPA

    if implementation not in ("sdpa", "eager", GQA_SDPA):
        raise DiffspecError(f"a fixed-capacity cache (CUDA graphs under --compile) needs sdpa or eager attention; "
                            f"this model runs '{implementation}': load it with attn_implementation='sdpa', or "
                            f"use --compile off")


class Target(TargetBase):
    """A transformers causal LM with a KV cache that can be rolled back. One request at a time."""

    backend = "transformers"

    def __init__(self, model, tokenizer=None, max_context: Optional[int] = None, name: str = "model",
                 kernels: str = "stock", quiet: bool = True, compile: str = "off",
                 fixed_cache: Optional[bool] = None, screen_greedy_head: bool = True):
        """`kernels` (kernels.py): 'stock' (F.linear everywhere), 'auto' (on a CPU, each linear layer takes
        the matmul formulation measured faster on this machine for the pass's row count, one row included)
        or 'multi-row' (the same for passes of 2+ rows; one-row passes stay transformers' own), or 'q8'
        (llama.cpp's arithmetic: 8-bit activations against the GGUF codes in every linear layer; q8_linear.py).
        `compile` (compiled.py): 'off', 'on' (every pass of up to 32 rows, in bucketed widths compiled at
        start) or 'auto' (the one-row pass compiled at start and kept where it measures faster).
        `fixed_cache` (cache.new_fixed_cache): a fixed-capacity cache, whose passes have fixed shapes, so
        compiled passes are compiled once per width with static shapes and, on CUDA, run as CUDA graphs.
        None (default): on CUDA whenever passes are compiled; elsewhere the position-indexed cache, whose
        length is symbolic in the compiled graphs.
        `screen_greedy_head` (greedy_head.py): where the plan measured it faster, greedy choices come from a
        bf16 product screened by an error bound and the few candidates rescored exactly, not from the fp32
        logits (False: always the fp32 logits' argmax)."""
        from . import attention
        from . import compiled as comp
        from . import kernels as kern

        kern.check_kernels(kernels)
        comp.check_compile(compile)
        if kernels == "q8":
            kern.check_q8_settings(next(model.parameters()).device.type, compile, next(model.parameters()).dtype)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.name = name
        cfg = model.config.get_text_config(decoder=True)
        self.num_layers = int(cfg.num_hidden_layers)
        self.hidden_size = int(cfg.hidden_size)
        limit = getattr(cfg, "max_position_embeddings", None) or 2048
        self.max_context = int(min(max_context, limit) if max_context else limit)
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        if self.dtype not in (torch.float32, torch.float64):
            name = str(self.dtype).replace("torch.", "")
            self.rounding_note = (f"a {name} target's passes of several rows round differently from its one-token "
                                  f"steps: speculative greedy output can part from plain decoding's at a near-tie "
                                  f"(diffspec bench reports the share of prompts that stay identical); --dtype "
                                  f"float32 keeps it token-identical")
        # what transformers' generate stops on, plus the end of an assistant turn in the chat template
        self.stop_token_ids = frozenset(generation_eos_ids(model) | chat_stop_token_ids(tokenizer))
        self.forward_passes = 0
        self._fingerprint: Optional[str] = None
        self.fixed_cache = comp.wants_fixed_cache(compile, self.device.type, fixed_cache)
        if self.fixed_cache and compile != "off":
            comp.check_compilable(model.config)  # a sliding window: refused with the --compile off hint
        self._length = 0  # positions held, with a fixed-capacity cache (whose own length is a tensor)
        self._prefilled: Optional[_Prefill] = None  # the last request's prefill, while the cache holds it (prefill)
        self._cache = new_fixed_cache(model.config, fixed_capacity(0, self.max_context)) if self.fixed_cache \
            else new_cache(model.config)
        self.kernels = kernels
        self.linear_plan = kern.LinearPlan()
        if kernels != "stock" and self.device.type == "cpu":
            self.linear_plan = kern.plan_for_mode(model, kernels, quiet=quiet)
            kern.install(model, self.linear_plan)
            attention.install(model)  # GQA without copying the cache (attention.py)
        else:  # F.linear and transformers' own attention, whatever ran this model before (q8's forwards too)
            kern.uninstall(model)
            attention.uninstall(model)
        # transformers' arithmetic with fewer calls, for Llama-architecture targets on a CPU (llama_pass.py): eager
        # passes on the position-indexed cache take it (bitwise the same outputs)
        self.direct_pass = None
        if kernels != "stock" and self.device.type == "cpu" and not self.fixed_cache and llama_pass_applies(model):
            self.direct_pass = LlamaPass(model, self.linear_plan)
        # --kernels q8 through the fused layers: keys and values held as float16, as llama.cpp holds them (half the
        # bytes a pass's attention reads: ~1.7 ms of a one-row step at 1,024 positions was reading float32 ones)
        self.kv_storage = None
        if self.linear_plan.q8 and self.direct_pass is not None and self.direct_pass.fused is not None \
                and not self.fixed_cache:
            self.kv_storage = torch.float16
            self._cache = new_cache(model.config, storage=self.kv_storage)
        # greedy choices screened past the fp32 head where the plan measured it faster (greedy_head.py)
        self.greedy_head, self.greedy_head_note = None, "not measured faster"
        if kernels == "stock" or self.device.type != "cpu":
            self.greedy_head_note = "stock kernels" if kernels == "stock" else "CPU only"
        elif self.linear_plan.q8:
            self.greedy_head_note = "--kernels q8: the head's own 8-bit-activation logits, no bf16 screen"
        elif not self.linear_plan.timings_us.get("greedy_head"):
            self.greedy_head_note = "not timed: it needs a float32 head and native bf16 matmuls"
        elif (head := kern.output_head(model)) is not None and \
                self.linear_plan.packed_rows.get(tuple(head.weight.shape)):
            self.greedy_head_note = "the head runs packed: its logits' argmax is a one-row step's at every width " \
                                    "(kernels.unscreened_where_packed)"
        if not screen_greedy_head:
            self.greedy_head_note = "turned off"
        elif self.linear_plan.head_rows:
            from .greedy_head import GreedyHead
            self.greedy_head, self.greedy_head_note = GreedyHead.for_model(model)
        self._no_logits = torch.zeros(0, dtype=torch.long, device=self.device)  # logits_to_keep: none
        if self.fixed_cache:
            check_fixed_cache_attention(model.config._attn_implementation)
        self.compiled = comp.CompiledPasses.build(model, compile, quiet=quiet, fixed_shapes=self.fixed_cache)
        if compile == "auto":
            comp.choose_one_row(self)
            if self.fixed_cache and fixed_cache is None and not self.compiled.one_row:
                # eager won: eager passes attending over a whole fixed capacity would only cost more
                self.fixed_cache = self.compiled.fixed_shapes = self.compiled.cuda_graphs = False
                self._cache = new_cache(model.config, storage=self.kv_storage)
        elif compile == "on":
            comp.compile_widths(self)

    @classmethod
    def load(cls, spec: Optional[str] = None, dtype: torch.dtype = torch.float32, device: str = "cpu",
             max_context: Optional[int] = None, quiet: bool = False, kernels: str = "auto",
             compile: str = "off", fixed_cache: Optional[bool] = None) -> "Target":
        from .compiled import check_compile
        from .kernels import check_kernels, check_q8_settings

        check_kernels(kernels)
        check_compile(compile)
        if kernels == "q8":  # before the weights load
            check_q8_settings(device, compile, dtype)
        model, tok = load_model_and_tokenizer(spec, dtype=dtype, device=device, quiet=quiet)
        return cls(model, tok, max_context=max_context, name=spec or DEFAULT_MODEL, kernels=kernels, quiet=quiet,
                   compile=compile, fixed_cache=fixed_cache)

    # --- cache -------------------------------------------------------------------------
    def prefill(self, tokens: torch.Tensor, positions: int,
                hidden_layers: Sequence[int] = ()) -> Optional[torch.Tensor]:
        """As `TargetBase.prefill`, keeping the last request's prefill where it is the state a new prefill would
        leave, bitwise:
        - the same tokens, and the same layers' hidden states asked (or none);
        - the cache still holding those positions as that pass left them: neither `reset` nor cut below them
          since (later passes write after them), no pass failed midway since, and a sliding-window layer still
          holding them;
        - a fixed-capacity cache at the capacity the pass attended over, and room enough in it;
        - the passes computing as they did (`_arithmetic`: the same weights, linear-layer routing, direct pass,
          threads and attention) as before that pass.
        Then the prefill costs no pass (`forward_passes` unchanged, so a result's `prefill_forward_passes` is 0): a
        repeated prompt (a client's retry, n samples of one prompt, a statistical test's thousands of seeded
        requests) starts at its first round. Anything else prefills anew. Weights edited through `.data` (which
        no version counter sees) need a `reset()` first; code that times requests (the bench) calls it before
        each one."""
        tokens = tokens.reshape(-1)
        kept, layers = self._prefilled, tuple(int(i) for i in hidden_layers)
        if (kept is not None and tokens.shape[0] > 0 and torch.equal(kept.tokens, tokens.to(kept.tokens.device))
                and layers in ((), kept.layers) and self.cache_len >= tokens.shape[0]
                and (self.fixed_cache or tokens.shape[0] >= earliest_length(self._cache))
                and kept.capacity == self._capacity()
                and (kept.capacity is None or min(int(positions), self.max_context) <= kept.capacity)
                and kept.arithmetic == self._arithmetic()):
            self.truncate(tokens.shape[0])
            self.reserve(positions)
            if not layers:
                return None
            with torch.inference_mode():  # a copy (what a drafter does to it stays its own), made as a pass's are
                return kept.hidden.clone()
        # the arithmetic before the pass: one that changes during it (a packed model's first pass routes anew) is
        # not the next request's, so that request prefills anew
        arithmetic = self._arithmetic() if tokens.shape[0] > 0 else None
        hidden = super().prefill(tokens, positions, layers)  # resets: nothing is kept until it returns
        if arithmetic is not None:
            if hidden is not None and hidden.numel() * hidden.element_size() > KEPT_HIDDEN_BYTES:
                kept_layers, kept_hidden = (), None  # kept for requests that read none
            else:
                with torch.inference_mode():  # (a copy: the caller's is its own)
                    kept_layers, kept_hidden = layers, hidden.clone() if hidden is not None else None
            self._prefilled = _Prefill(tokens.clone(), kept_layers, kept_hidden, self._capacity(), arithmetic)
        return hidden

    def _capacity(self) -> Optional[int]:
        """The positions a fixed-capacity cache's passes attend over (None: a position-indexed cache)."""
        return fixed_cache_capacity(self._cache) if self.fixed_cache else None

    def _arithmetic(self) -> tuple:
        """What a pass computes from besides its tokens and the cache: each parameter and buffer
        (packed_linear.module_state), the linear layers' routing (packed_linear's epoch, bumped by every install),
        the plan and the direct pass in use, the model's mode and attention, and torch's thread count."""
        from .packed_linear import module_state, routing_epoch

        return (routing_epoch(), id(self.linear_plan), id(self.direct_pass), self.model.training,
                self.model.config._attn_implementation, torch.get_num_threads(), module_state(self.model))

    def reset(self) -> None:
        self._prefilled = None
        if self.fixed_cache:  # the same buffers (their addresses are in the compiled graphs), length 0
            set_fixed_length(self._cache, 0)
            self._length = 0
        else:
            self._cache = new_cache(self.model.config, storage=self.kv_storage)

    def reserve(self, positions: int) -> None:
        """Preallocate the cache for the request (none grows mid-request)."""
        positions = min(int(positions), self.max_context)
        if not self.fixed_cache:
            reserve_cache(self._cache, positions)
        elif positions > fixed_cache_capacity(self._cache):
            # a larger capacity: other shapes, so compiled passes compile their graphs again for it
            grown = new_fixed_cache(self.model.config, fixed_capacity(positions, self.max_context))
            copy_fixed_cache(self._cache, grown, self._length)
            self._cache = grown

    @property
    def cache_len(self) -> int:
        return self._length if self.fixed_cache else cache_length(self._cache)

    def truncate(self, length: int) -> None:
        """Roll the KV cache back to its first `length` positions."""
        if length < 0:
            raise ValueError(f"cache length must be >= 0, got {length}")
        if self._prefilled is not None and length < self._prefilled.tokens.shape[0]:
            self._prefilled = None  # its positions will be written over
        if not self.fixed_cache:
            truncate_cache(self._cache, length)
        elif length < self._length:  # positions past the length are never read (causal mask)
            set_fixed_length(self._cache, length)
            self._length = length

    # --- forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, hidden_layers: Sequence[int] = (), logits: bool = True) -> TargetOutput:
        """Append `tokens` [n] to the cache in one forward pass.

        Returns logits [n, V] (row i predicts the token after tokens[i]) and, if hidden_layers is
        given, the outputs of those decoder layers (0-based) concatenated: [n, len * hidden].
        With logits=False (a prefill whose logits nobody reads) only the last row's logits are
        computed: [1, V]. Where the plan screens the greedy head for this many rows (kernels.py,
        greedy_head.py) the pass stops before the head (TargetOutput computes logits when read).
        """
        n = tokens.shape[0]
        if self.cache_len + n > self.max_context:
            raise DiffspecError(f"sequence of {self.cache_len + n} tokens exceeds the model's context "
                                f"of {self.max_context}")
        if self.fixed_cache:
            self.reserve(self.cache_len + n)
        width = self.compiled.graph_rows((n, bool(logits))) if self.cache_len > 0 else None
        if width is not None and self.cache_len + width > self.max_context:
            width = None  # the padding rows would not fit the model's context
        if width is not None and self.fixed_cache and self.cache_len + width > fixed_cache_capacity(self._cache):
            width = None  # nor the cache's capacity
        screen = bool(logits) and self.greedy_head is not None and self.linear_plan.screens_head(width or n)
        started, before = time.perf_counter(), self.cache_len
        try:
            if width is None:
                run = self.model
                # (runs_on is false on a fixed-capacity cache: its layers are not position-indexed)
                if self.direct_pass is not None and self.direct_pass.runs_on(self._cache):
                    run = self.direct_pass.forward
                out = run(input_ids=tokens.view(1, n).to(self.device), past_key_values=self._cache,
                          use_cache=True, output_hidden_states=bool(hidden_layers) or screen,
                          logits_to_keep=self._no_logits if screen else (0 if logits else 1))
                self._length += n if self.fixed_cache else 0
            else:
                out = self._compiled_pass(tokens.reshape(n).to(self.device), width, screen)
                self.compiled.timed_first((width, True), time.perf_counter() - started, self._capacity())
        except BaseException:
            self._prefilled = None  # the layers that ran hold this pass's rows, the others not: prefill anew
            if self.fixed_cache:  # the layers that ran before the failure counted the pass's rows: undo
                set_fixed_length(self._cache, before)
                self._length = before
            raise
        self.forward_passes += 1
        hidden = None
        if hidden_layers:
            # hidden_states[0] is the embedding output; layer i's output is hidden_states[i + 1]. torch.cat
            # copies, which a CUDA graph's outputs need (its next replay overwrites them): keep it a copy
            rows_of = getattr(out.hidden_states, "rows_of", None)  # the fused call's buffer (llama_pass.LayerOutputs)
            hidden = rows_of(hidden_layers, n) if rows_of is not None else None
            if hidden is None:
                hidden = torch.cat([out.hidden_states[i + 1][0, :n] for i in hidden_layers], dim=-1)
        rows = (out.hidden_states[-1] if screen else out.logits)[0, :n]
        if width is not None and self.fixed_cache:
            rows = rows.clone()  # a CUDA graph's outputs are overwritten by its next replay
        if screen:  # the model's last hidden state (normed): its logits are its head of it (GreedyHead.for_model)
            return TargetOutput(None, hidden, final_hidden=rows, head=self.greedy_head)
        return TargetOutput(rows, hidden)

    def _compiled_pass(self, ids: torch.Tensor, width: int, screen: bool = False):
        """One pass through the compiled graph of `width` rows (compiled.py): the ids padded with copies
        of the last one, always as a fresh tensor (storage offset 0: torch specialises offsets 0 and 1);
        the padding rows' cache positions are cut off after the pass. Every layer's hidden states
        are returned, so all callers share one graph per width."""
        n, start = ids.shape[0], self.cache_len
        if not self.fixed_cache:  # a cache that grows inside the graph is another graph (its guards fail): make room first
            reserve_cache(self._cache, start + width)
        ids = torch.cat((ids, ids[-1:].expand(width - n))) if width > n else ids.clone()
        if self.fixed_cache and self.device.type == "cuda":
            torch.compiler.cudagraph_mark_step_begin()  # the previous replay's outputs are no longer read
        key = (width, screen, self.model.config._attn_implementation, id(self.linear_plan))
        out = self.compiled.run(key, input_ids=ids.view(1, width), past_key_values=self._cache,
                                use_cache=True, output_hidden_states=True,
                                logits_to_keep=self._no_logits if screen else 0)
        if self.fixed_cache:
            self._length = start + n
            if width > n:
                set_fixed_length(self._cache, start + n)
        elif width > n:
            truncate_cache(self._cache, start + n)
        return out

    @property
    def vocab_size(self) -> int:
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def config(self):
        return self.model.config

    def input_embeddings(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def output_head_weight(self) -> torch.Tensor:
        return self.model.get_output_embeddings().weight.detach()

    def runtime(self) -> dict:
        """How the passes run: the matmul kernels (kernels.py) and what is compiled (compiled.py)."""
        return {"kernels": self.kernels, "linear_plan": self.linear_plan.describe(),
                "attention": self.model.config._attn_implementation, "compile": self.compiled.to_json(),
                "forward": self._forward_text(),
                "greedy_head": (f"screened (bf16 product, exact rescoring) for rows "
                                f"{','.join(map(str, sorted(self.linear_plan.head_rows)))}" if self.greedy_head
                                else f"fp32 logits ({self.greedy_head_note})"),
                "cache": (f"fixed capacity ({fixed_cache_capacity(self._cache)} positions)" if self.fixed_cache
                          else "position-indexed" + (", keys and values float16" if self.kv_storage is not None
                                                     else ""))}

    def _forward_text(self) -> str:
        if self.direct_pass is None:
            return "transformers"
        if self.direct_pass.fused is None:
            return "direct (llama_pass.py)"
        if self.linear_plan.q8:
            from .q8_linear import isa
            return f"direct (llama_pass.py), layers fused (fused_layers.c; 8-bit activations, {isa()})"
        return f"direct (llama_pass.py), layers fused where packed (fused_layers.c, {self.direct_pass.fused.isa})"

    @property
    def base_fingerprint(self) -> str:
        """Equal for two targets with the same weights, matmul kernels and attention (compiled or not)."""
        if self._fingerprint is None:
            from .machine_keys import cache_key, model_fingerprint
            self._fingerprint = model_fingerprint(self.model)
            if any(self.linear_plan.mm_rows.values()):  # other kernels, other costs
                self._fingerprint = cache_key(self._fingerprint, self.linear_plan.to_json()["mm_rows"])
            if any(self.linear_plan.packed_rows.values()):
                from .packed_linear import kernel_key
                self._fingerprint = cache_key(self._fingerprint, "packed", kernel_key(),
                                              self.linear_plan.to_json()["packed_rows"])
            if self.linear_plan.q8:  # another arithmetic (q8_linear.py), other outputs and costs
                from .q8_linear import kernel_key as q8_key
                self._fingerprint = cache_key(self._fingerprint, "q8-activations", q8_key())
            if self.kv_storage is not None:  # keys and values rounded to it: other outputs, other costs
                self._fingerprint = cache_key(self._fingerprint, "kv", str(self.kv_storage))
            if self.direct_pass is not None:  # the same outputs, other costs
                self._fingerprint = cache_key(self._fingerprint, "direct-pass")
                if self.direct_pass.fused is not None:  # other roundings (fused_layers.py), other costs
                    from .fused_layers import kernel_key as fused_key
                    self._fingerprint = cache_key(self._fingerprint, "fused-layers", fused_key())
            if self.greedy_head is not None:
                self._fingerprint = cache_key(self._fingerprint, "greedy-head", sorted(self.linear_plan.head_rows))
            if self.model.config._attn_implementation != "sdpa":
                self._fingerprint = cache_key(self._fingerprint, self.model.config._attn_implementation)
        return self._fingerprint

    @property
    def fingerprint(self) -> str:
        """Equal for two targets that compute alike, at the same speed (the cost tables' key)."""
        from .machine_keys import cache_key
        if self.fixed_cache:  # attention over the whole capacity: other costs, compiled or not (not keyed by
            return cache_key(self.base_fingerprint, self.compiled.describe(), "fixed")  # capacity: it may grow)
        if self.compiled.fn is None or self.compiled.shapes == set():
            return self.base_fingerprint
        return cache_key(self.base_fingerprint, self.compiled.describe())
