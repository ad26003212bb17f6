"""make-data's decode step, direct and replayable as a CUDA graph (issue 16: target-generated data at scale).

On an H200 (2026-11-26) make-data's batched generation took ~18-23 ms a step from 1 to 128 rows and 68 ms at
512 (7.5k generated tokens/s against the issue's 50k): an eager step of transformers' forward is ~1,800 kernel
launches, whatever the batch, and with a padding mask transformers' sdpa attention copies every layer's cached
keys and values once per query head (`repeat_kv`, 3x on SmolLM2) before a kernel that tiles 64 queries where a
step has one. `DecodeStep` computes the same step for a Llama-architecture model:

- the model's own modules for the norms, projections and MLP (whatever forwards they run);
- its rotary embeddings, as transformers applies them;
- attention as matmuls over the batch cache's buffers (`store.BatchKVCache`), each key/value head read once for
  the query heads that share it (`q.view(kv_heads, group, ...)`), padding and unwritten positions masked; on a
  CPU in float32, by fused_layers.c's `attend` instead (`batch_attend`: a row's keys and values streamed once
  from memory for the heads that share them, where torch's matmuls and SDPA ran at a third of the memory's speed:
  a 64-row step of SmolLM2-135M at ~350 positions, 35 MB of keys and values a layer, 1.1 against 4.2 ms);
- in fixed shapes: the rows, and the positions attention reads rounded up to SPAN positions. On CUDA each
  (rows, span) is captured once as a CUDA graph and replayed (one launch a step); the step's inputs are copied
  into the graph's own buffers first. generate_batch drops finished rows down to powers of two under graphs,
  and make-data runs its batches through one store.BatchSession (one cache, this step and its graphs), so a
  shape is captured once a run, not once a batch.

It computes what transformers' pass computes up to rounding (another attention kernel sums in another order):
logits within float32 rounding, so a greedy answer can differ where two tokens nearly tie. make-data's answers
are training data: the trainer labels them with the target's own pass (training/anchored.py). Tested on
a CPU in float64 against the model's forward (tests/test_batch_step.py); the graphs need CUDA (the GPU script's
make-data profile times both).
"""

from __future__ import annotations

import sys
from typing import Dict, Optional, Tuple

import torch

from .. import fused_layers
from ..errors import DiffspecError

SPAN = 128                    # positions attention reads, rounded up to a multiple of this (fixed graph shapes)
STATIC_ROPE = ("default", "linear", "llama3")  # rotary tables that depend on positions alone (no data-dependent update)
STEP_KINDS = ("auto", "model", "direct", "graph")
_graph_failed: list = []      # a capture that failed in this process: `auto` stops asking for graphs
captures = 0                  # graphs captured in this process (benchmarks/gpu_make_data_profile.py reports them)


def applies(model: torch.nn.Module) -> bool:
    """Whether `DecodeStep` computes `model`'s decode step: transformers' Llama with SiLU, no biases, no
    tensor-parallel split, full attention in every layer, a rotary table that depends on positions alone, on one
    device without accelerate's hooks."""
    from transformers import LlamaForCausalLM

    if type(model) is not LlamaForCausalLM or model.training:
        return False
    cfg = model.config
    if (cfg.hidden_act != "silu" or getattr(cfg, "mlp_bias", False) or getattr(cfg, "attention_bias", False)
            or getattr(cfg, "pretraining_tp", 1) != 1 or len(model.model.layers) != cfg.num_hidden_layers):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or ["full_attention"])):
        return False
    if getattr(cfg, "sliding_window", None):
        return False
    if len({p.device for p in model.parameters()}) != 1 or any(hasattr(m, "_hf_hook") for m in model.modules()):
        return False  # split over devices, or offloaded by accelerate's hooks: the step calls modules directly
    return getattr(model.model.rotary_emb, "rope_type", None) in STATIC_ROPE


def choose_kind(kind: str, model: torch.nn.Module) -> str:
    """`auto` -> `graph` on CUDA where the model applies, else `model` (make-data times `direct` against it on a
    CPU and keeps the faster: store.choose_cpu_step); other kinds as asked, with
    a clear error where they cannot run; `graph` -> `model` once a capture failed in this process (warn_fallback
    said so)."""
    if kind not in STEP_KINDS:
        raise DiffspecError(f"decode step kind must be one of {', '.join(STEP_KINDS)}, got {kind!r}")
    device = next(model.parameters()).device
    if kind == "auto" or (kind == "graph" and _graph_failed):  # a capture failed in this process: no more graphs
        return "graph" if device.type == "cuda" and applies(model) and not _graph_failed else "model"
    if kind in ("direct", "graph") and not applies(model):
        raise DiffspecError(f"decode step '{kind}' needs a Llama-architecture model with full attention "
                         f"({type(model).__name__} is not one)")
    if kind == "graph" and device.type != "cuda":
        raise DiffspecError(f"decode step 'graph' needs a CUDA model (this one is on {device})")
    return kind


def _c_attention_fits(model: torch.nn.Module) -> bool:
    """Whether fused_layers.c's attention can serve the direct step's eager passes: a float32 model on a CPU, the
    library built here."""
    param = next(model.parameters())
    return param.device.type == "cpu" and param.dtype == torch.float32 and fused_layers.available()


def direct_may_win(model: torch.nn.Module) -> bool:
    """Whether `auto` should time the direct step against the model's forward (store.choose_cpu_step): a model the
    direct step computes, with its attention in C."""
    return applies(model) and _c_attention_fits(model)


def span_for(positions: int, capacity: int) -> int:
    """Positions attention reads when `positions` are written: rounded up to SPAN, at most the capacity."""
    return min(capacity, -(-positions // SPAN) * SPAN)


class DecodeStep:
    """One decode step (one token for each row) of `model` over `cache`'s buffers (a store.BatchKVCache that a
    prefill has written). `step(tokens, positions, mask)` -> logits [rows, vocab]; the caller advances the cache.

    `graphs=True` (CUDA) replays a graph per (rows, span); a graph is captured the first time its shape runs and
    kept while the step lives (store.BatchSession keeps it across batches). The graphs share one memory pool, so
    their intermediates take the room of one; each keeps its logits, its own buffer, overwritten by its next
    replay."""

    def __init__(self, model: torch.nn.Module, cache, graphs: bool = False, c_attention: Optional[bool] = None):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        self.model, self.cache, self.graphs = model, cache, graphs
        # attention by fused_layers.c (eager passes only): None = wherever it fits; False = the matmuls
        self.c_attention = not graphs and c_attention is not False and _c_attention_fits(model)
        self.rotate = apply_rotary_pos_emb
        cfg = model.config
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.scale = model.model.layers[0].self_attn.scaling
        self._graphs: Dict[Tuple[int, int], tuple] = {}
        self._at = torch.zeros(1, dtype=torch.long, device=next(model.parameters()).device)
        self._pool = None            # one memory pool for this step's graphs (each output is read before any replay)
        self.captured = 0            # graphs captured so far (a report, and the tests' check)

    # --- the step itself, in torch operations ------------------------------------------------------------
    def _compute(self, tokens: torch.Tensor, positions: torch.Tensor, valid: torch.Tensor, at: torch.Tensor,
                 span: int) -> torch.Tensor:
        """tokens, positions [B]; valid [B, span] (bool: positions a row reads, this step's included);
        at [1] (long: the position this step writes) -> logits [B, vocab]."""
        m, B = self.model.model, tokens.shape[0]
        H, KV, d = self.heads, self.kv_heads, self.head_dim
        h = m.embed_tokens(tokens).unsqueeze(1)                        # [B, 1, D]
        cos, sin = m.rotary_emb(h, positions.unsqueeze(1))
        soft = torch.promote_types(h.dtype, torch.float32)            # softmax in float32 at least
        bias = torch.zeros(valid.shape, dtype=soft, device=h.device).masked_fill_(~valid, float("-inf"))
        bias = bias.view(B, 1, 1, span)
        first = _first_read(valid) if self.c_attention else None
        for i, layer in enumerate(m.layers):
            attn, kv = layer.self_attn, self.cache.layers[i]
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, 1, H, d).transpose(1, 2)        # [B, H, 1, d]
            k = attn.k_proj(x).view(B, 1, KV, d).transpose(1, 2)       # [B, KV, 1, d]
            v = attn.v_proj(x).view(B, 1, KV, d).transpose(1, 2)
            q, k = self.rotate(q, k, cos, sin)
            keys, values = kv.keys[:B], kv.values[:B]                  # [B, KV, capacity, d]
            keys.index_copy_(2, at, k.to(keys.dtype))
            values.index_copy_(2, at, v.to(values.dtype))
            out = None  # [B, H, d] from C, or [B, KV, group, d] from the matmuls: the same order of heads
            if first is not None:  # on a CPU: fused_layers.c reads each row's keys and values once
                out = fused_layers.batch_attend(q.reshape(B, H, d).contiguous(), keys, values, first, span - 1,
                                                self.scale)
            if out is None:
                q = q * self.scale                                     # scaled first: no fp16 overflow in q . k
                # the query heads sharing a key/value head are one matmul's rows: each head's keys read once
                scores = torch.matmul(q.reshape(B, KV, H // KV, d), keys[:, :, :span].transpose(-1, -2))
                weights = torch.softmax(scores.to(soft) + bias, dim=-1).to(values.dtype)
                out = torch.matmul(weights, values[:, :, :span])
            h = h + attn.o_proj(out.reshape(B, 1, H * d).to(h.dtype))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(m.norm(h))[:, 0]

    # --- fixed shapes, replayed ---------------------------------------------------------------------------
    def step(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One token for each row: tokens, positions [B]; mask [B, >= length + 1] (1 where a row reads a
        position: its prompt, not its padding, and every generated position, this step's included)."""
        B, written = tokens.shape[0], self.cache.length + 1
        span = span_for(written, self.cache.capacity) if self.graphs else written
        device = tokens.device
        valid = torch.zeros((B, span), dtype=torch.bool, device=device)
        valid[:, :written] = mask[:, :written].bool()
        at = self._at.fill_(self.cache.length)  # on the device, no copy from the host to wait for
        if not self.graphs:
            return self._compute(tokens, positions, valid, at, span)
        key = (B, span)
        if key not in self._graphs:  # kept for the next batch of a BatchSession (its cache's buffers stay put)
            self._graphs[key] = self._capture(tokens, positions, valid, at, span)
        replay, inputs, logits = self._graphs[key]
        for buffer, value in zip(inputs, (tokens, positions, valid, at)):
            buffer.copy_(value)
        replay()
        return logits

    def _capture(self, tokens, positions, valid, at, span) -> tuple:
        inputs = tuple(t.clone() for t in (tokens, positions, valid, at))
        if self._pool is None and torch.cuda.is_available():
            self._pool = torch.cuda.graph_pool_handle()
        replay, logits = record(lambda: self._compute(*inputs, span), self._pool)
        global captures
        self.captured += 1
        captures += 1
        return replay, inputs, logits


def _first_read(valid: torch.Tensor) -> Optional[torch.Tensor]:
    """valid [B, span] -> the first position each row reads, where every row reads one run of positions ending at
    the last (left padding: generate_batch's mask); None otherwise (then the matmuls take the mask as it is)."""
    first = valid.to(torch.int8).argmax(-1)
    if not bool(valid[:, -1].all()) or not torch.equal(valid.sum(-1), valid.shape[1] - first):
        return None
    return first


def record(run, pool=None) -> tuple:
    """Capture `run` (a function of buffers that stay where they are) as a CUDA graph -> (replay, its output).
    Run once first, off the capture (the allocator and cuBLAS set up): `run` is the step about to be replayed,
    so that run writes the very keys and values the replay writes again. Captured with the graph's own calls,
    not `torch.cuda.graph`, whose entry collects Python's garbage and empties the allocator's cache at every
    capture. `pool`: the memory pool one DecodeStep's graphs share; safe since each replay's output is read
    before the next replay of any of them."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    try:
        with torch.cuda.stream(stream):
            run()
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            graph.capture_begin(pool=pool)
            try:
                out = run()
            finally:
                graph.capture_end()
    finally:
        torch.cuda.current_stream().wait_stream(stream)
    return graph.replay, out


def new_step(kind: str, model: torch.nn.Module, cache) -> Optional[DecodeStep]:
    """The DecodeStep a generation runs (None: the model's own forward), from an already chosen kind."""
    if kind == "model":
        return None
    return DecodeStep(model, cache, graphs=kind == "graph")


def try_step(stepper: Optional[DecodeStep], tokens: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor) -> tuple:
    """One step through `stepper` -> (logits, stepper); (None, None) where there is no stepper or its graph
    could not be captured (warned, and remembered: the caller runs the model's forward from then on). Running
    out of memory is not a failed capture: it goes to the caller (the batch probe takes a smaller batch)."""
    if stepper is None:
        return None, None
    try:
        return stepper.step(tokens, positions, mask), stepper
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        if not stepper.graphs:
            raise
        warn_fallback(error)
        return None, None


def warn_fallback(error: Exception) -> None:
    cause = error.__context__  # a failure inside the capture, then capture_end's own error: name the first
    text = f"{type(error).__name__}: {error}" + (f" (after {type(cause).__name__}: {cause})" if cause else "")
    _graph_failed.append(text)
    print(f"diffspec make-data: the CUDA-graph decode step failed ({text}); "
          f"running the model's forward instead (and in this process's later batches)", file=sys.stderr, flush=True)
