"""How each bench method generates: a `Runner` turns prompt token ids into an `Outcome`.

Every runner generates from prompt token ids and returns an `Outcome`; what it counts:
- engine methods (`plain`, `auto`, `combined`, `prompt-lookup`, `ar`, `specdiff`, `dllm-fixed`,
  `failfast`, `conditioned`, `conditioned-failfast`): the engine's own statistics (GenerationResult),
  rounds the policy switched speculation off included;
- `dflash-ref`: the DFlash reference package's own loop on the same weights (DFlashRefRunner);
- transformers methods (`hf-generate`, `hf-prompt-lookup`): `model.generate` on the target's HF
  model, target forward passes counted by a forward hook. HF's prefill pass also emits the first
  token, so every pass is a round: mean accepted length = new tokens / target passes (1.0 for
  plain generate, as for the engine's `plain`). Draft/verify split and per-round lists: None;
  speculation-off rounds: 0.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..devices import synchronize
from ..errors import DiffspecError
from ..kernels import stock_kernels
from ..types import SamplingParams


@dataclass(frozen=True)
class Outcome:
    """One generation of one method on one prompt.

    rounds: (drafted, accepted, emitted) per draft-verify round (engine methods; () for HF); drafted
        counts the tokens verified, so the draft-length histogram is read from these.
    draft_time_s / verify_time_s: None where the method cannot split them (HF methods).
    speculation_off_rounds: rounds in which the policy ran no drafter (a plain step by choice; 0 for
        methods without such a policy).
    hidden_state_rounds: rounds whose verify pass returned the target's hidden states for the drafter.
    pass_round_draft_time_s: drafting seconds in the rounds that ran a drafter pass (engine methods; None where
        the method cannot tell): a pass-free part of a combined drafter (prompt lookup) drafts in other rounds too.
    """

    token_ids: tuple
    wall_time_s: float
    target_forward_passes: int
    drafter_forward_passes: int
    mean_accepted_length: float
    draft_time_s: Optional[float] = None
    verify_time_s: Optional[float] = None
    rounds: tuple = ()
    finish_reason: Optional[str] = None
    prefill_time_s: Optional[float] = None
    speculation_off_rounds: int = 0
    hidden_state_rounds: int = 0
    pass_round_draft_time_s: Optional[float] = None


class Runner:
    """Generates for one method. `weights` and `policy` say what ran (recorded in every row); `backend`
    what ran the target. `same_model`: False for a peer running another computation of the model (its
    greedy output may differ from plain's without being a lossless failure: the difference is reported,
    not judged)."""

    weights: str = "target only"
    policy: str = "-"
    backend: str = "transformers"
    same_model: bool = True

    def run(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams) -> Outcome:
        raise NotImplementedError


sync = synchronize  # wall-clock readings cover queued device work


class EngineRunner(Runner):
    """A SpeculativeEngine (no drafter = plain decoding through the same loop)."""

    def __init__(self, engine):
        self.engine = engine
        self.backend = engine.target.backend
        self.weights = engine.drafter.describe() if engine.drafter is not None else "target only"
        self.policy = engine.policy.describe() if engine.drafter is not None else "-"

    def run(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams) -> Outcome:
        self.engine.target.reset()  # no prefill kept from another method's or an earlier run: every request prefills
        sync(self.engine.target.device)
        t0 = time.perf_counter()
        r = self.engine.generate(list(prompt_ids), max_new_tokens=max_new_tokens, sampling=sampling)
        sync(self.engine.target.device)
        wall = time.perf_counter() - t0
        return Outcome(token_ids=tuple(r.token_ids), wall_time_s=wall, target_forward_passes=r.target_forward_passes,
                       drafter_forward_passes=r.drafter_forward_passes, mean_accepted_length=r.mean_accepted_length,
                       draft_time_s=r.draft_time_s, verify_time_s=r.verify_time_s,
                       rounds=tuple((s.drafted, s.accepted, s.emitted) for s in r.rounds), finish_reason=r.finish_reason,
                       prefill_time_s=r.prefill_time_s, speculation_off_rounds=r.speculation_off_rounds,
                       hidden_state_rounds=r.hidden_state_rounds,
                       pass_round_draft_time_s=sum(s.draft_time_s for s in r.rounds if s.drafter_forward_passes))


class HFRunner(Runner):
    """transformers `model.generate` on the target's model, with transformers' own kernels (F.linear: what
    users run today); prompt lookup when lookup_tokens > 0. Where the target's one-row steps run another
    matmul kernel (`--kernels auto` on a CPU where it measured faster: kernels.py), plain decoding is
    another computation of the same model: a near-tie may break differently, so the output is compared
    with plain's (the match rate), not judged."""

    def __init__(self, target, lookup_tokens: int = 0, max_ngram: int = 2):
        self.target = target
        plan = getattr(target, "linear_plan", None)
        self.same_model = not (plan is not None and plan.one_row)
        self.lookup_tokens, self.max_ngram = lookup_tokens, max_ngram
        self.weights = "target only" if not lookup_tokens else f"transformers prompt lookup (ngram {max_ngram})"
        self.policy = "-" if not lookup_tokens else f"fixed({lookup_tokens})"

    def _config(self, max_new_tokens: int, sampling: SamplingParams):
        from transformers import GenerationConfig

        stops = sorted(self.target.stop_token_ids)
        tok = self.target.tokenizer
        pad = getattr(tok, "pad_token_id", None) if tok is not None else None
        kw = dict(max_new_tokens=max_new_tokens, eos_token_id=stops or None,
                  pad_token_id=pad if pad is not None else (stops[0] if stops else 0))
        if sampling.greedy:
            kw.update(do_sample=False)
        else:
            kw.update(do_sample=True, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k)
        if self.lookup_tokens:
            kw.update(prompt_lookup_num_tokens=self.lookup_tokens, max_matching_ngram_size=self.max_ngram)
        return GenerationConfig(**kw)

    def run(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams) -> Outcome:
        model = self.target.model
        max_new_tokens = min(max_new_tokens, self.target.max_context - len(prompt_ids))
        config = self._config(max_new_tokens, sampling)
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.target.device)
        calls = [0]
        hook = model.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            sync(ids.device)
            t0 = time.perf_counter()
            with torch.inference_mode(), stock_kernels(model):  # transformers as users run it
                out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
            sync(ids.device)
            wall = time.perf_counter() - t0
        finally:
            hook.remove()
        new = tuple(int(t) for t in out[0, ids.shape[1]:].tolist())
        stops = self.target.stop_token_ids
        finish = "stop" if new and new[-1] in stops else "length"
        return Outcome(token_ids=new, wall_time_s=wall, target_forward_passes=calls[0], drafter_forward_passes=0,
                       mean_accepted_length=len(new) / max(1, calls[0]), finish_reason=finish)


class LlamaCppPeerRunner(Runner):
    """llama.cpp's own plain decoding: llama-cpp-python's `Llama.generate` on the target's GGUF file,
    with its own sampler (greedy at temperature 0), its KV cache emptied before every prompt, flash
    attention on (llama.cpp's own default on a CPU, and the backend's setting) and llama.cpp's default
    all-f16 KV cache (the backend keeps K in q8_0 for exactness; a step timed as fast). The peer
    a CPU user would run instead. Its greedy output is compared with plain's but not judged: beside a
    transformers target it is another computation (quantised activations); beside the llama.cpp backend
    it prefills the whole prompt in one pass where the engine leaves the last prompt token to the first
    round, and from 64 prompt tokens on llama.cpp's attention computes those rows another way (tiled),
    so a near-tie can later break differently.

    Counts: target passes = prefill chunks + one per generated token; mean accepted length 1.0."""

    def __init__(self, target, threads: Optional[int] = None):
        from ..backends.llama_cpp import import_llama_cpp, usable_cores
        from ..models import gguf_file

        lib = import_llama_cpp()
        path = getattr(target, "gguf", None) or gguf_file(target.name)
        if path is None:
            raise DiffspecError(f"method 'llama.cpp': target '{target.name}' is not a GGUF file")
        self.threads = threads or getattr(target, "threads", None) or usable_cores()
        from ..backends.llama_cpp import _silence

        _silence(lib)
        self.llm = lib.Llama(str(path), n_ctx=target.max_context, n_batch=512, n_ubatch=512, n_threads=self.threads,
                             n_threads_batch=self.threads, flash_attn=True, verbose=False)
        self.target, self.backend = target, "llama.cpp (its own loop)"
        self.same_model = False  # its own prefill layout and sampler: compared with plain, never judged
        self.weights = f"llama.cpp plain decoding: {Path(path).name}, {self.threads} threads"

    def run(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams) -> Outcome:
        max_new_tokens = min(max_new_tokens, self.target.max_context - len(prompt_ids))
        stops = self.target.stop_token_ids
        kw = dict(temp=0.0, top_k=1) if sampling.greedy else dict(temp=sampling.temperature, top_p=sampling.top_p,
                                                                   top_k=sampling.top_k, min_p=0.0)
        if sampling.seed is not None:
            self.llm.set_seed(sampling.seed)
        new, finish = [], "length"
        t0 = time.perf_counter()
        self.llm.reset()  # no prefix reuse across prompts: every method prefills
        for tok in self.llm.generate(list(prompt_ids), repeat_penalty=1.0, **kw):
            new.append(int(tok))
            if tok in stops:
                finish = "stop"
                break
            if len(new) >= max_new_tokens:
                break
        wall = time.perf_counter() - t0
        prefill = -(-len(prompt_ids) // 512)
        return Outcome(token_ids=tuple(new), wall_time_s=wall, target_forward_passes=prefill + len(new) - 1,
                       drafter_forward_passes=0, mean_accepted_length=1.0, finish_reason=finish)


class DFlashRefRunner(Runner):
    """z-lab's reference decoding loop, `dflash.model.dflash_generate` (PyPI `dflash` 0.1.0, an
    optional dependency), with the drafter's weights loaded by the reference's own
    `DFlashDraftModel.from_pretrained` in the target's dtype, on the target's HF model. It drafts
    a whole block every round (no length policy; `block_size` overrides the drafter's block, the
    reference's own knob) and verifies it in one target pass.

    What it counts: target and drafter passes by forward hooks; emitted tokens per round from the
    reference's own `acceptance_lengths` (`return_stats=True`, with its CUDA-only timer swapped for
    a device-neutral one during the call); the prefill's first token is in no round, so mean
    accepted length = (new tokens - 1) / rounds, DFlash's own figure. On the CPU, hooks also time
    the draft (drafter pass + its LM-head logits) and the verify passes; None on a GPU, where that
    timing would need synchronising inside the loop.
    """

    def __init__(self, target, spec: str, block_size: Optional[int] = None):
        import tempfile

        from ..dflash_format import reference, reference_folder
        from ..models import _no_progress_bars

        model_class, self._generate = reference()
        self.target = target
        self._scratch = tempfile.TemporaryDirectory(prefix="diffspec-dflash-ref-")
        folder = reference_folder(spec, target, self._scratch.name)
        with _no_progress_bars():
            self.model = model_class.from_pretrained(str(folder), dtype=target.dtype).to(target.device).eval()
        if block_size is not None and block_size < 2:
            raise DiffspecError(f"dflash-ref: block_size must be >= 2, got {block_size}")
        self.block_size = b = block_size or self.model.block_size
        self.weights = (f"dflash reference: {spec} (block {self.model.block_size}, layers {len(self.model.layers)}, "
                        f"target layers {list(self.model.target_layer_ids)})")
        self.policy = f"fixed({b - 1}) (whole block of {b}, reference loop)"
        self._clock = {"target": [], "draft": 0.0, "drafter_passes": 0}
        self._timed = torch.device(target.device).type == "cpu"
        inner = self.model.compute_logits

        def compute_logits(*args, **kwargs):  # the drafts' LM-head logits count as drafting
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            self._clock["draft"] += time.perf_counter() - t0
            return out

        self.model.compute_logits = compute_logits

    def _hooks(self) -> list:
        clock, starts = self._clock, {}

        def pre(name):
            return lambda *_: starts.__setitem__(name, time.perf_counter())

        def target_done(*_):
            clock["target"].append(time.perf_counter() - starts["target"])

        def drafter_done(*_):
            clock["draft"] += time.perf_counter() - starts["drafter"]
            clock["drafter_passes"] += 1

        m, d = self.target.model, self.model
        return [m.register_forward_pre_hook(pre("target")), m.register_forward_hook(target_done),
                d.register_forward_pre_hook(pre("drafter")), d.register_forward_hook(drafter_done)]

    def _call(self, ids: torch.Tensor, max_new_tokens: int, sampling: SamplingParams):
        """dflash_generate(..., return_stats=True) with its timer made device-neutral for the call."""
        import dflash.model as ref

        device = self.target.device
        stops = sorted(self.target.stop_token_ids) or None
        cuda_time = ref._cuda_time
        ref._cuda_time = lambda: (sync(device), time.perf_counter())[1]
        try:
            return self._generate(self.model, self.target.model, ids, max_new_tokens, stops,
                                  temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                                  block_size=self.block_size, return_stats=True)
        finally:
            ref._cuda_time = cuda_time

    def run(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams) -> Outcome:
        max_new_tokens = min(max_new_tokens, self.target.max_context - len(prompt_ids))
        ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.target.device)
        self._clock.update(target=[], draft=0.0, drafter_passes=0)
        hooks = self._hooks()
        try:
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
            sync(ids.device)
            t0 = time.perf_counter()
            stats = self._call(ids, max_new_tokens, sampling)
            sync(ids.device)
            wall = time.perf_counter() - t0
        finally:
            for h in hooks:
                h.remove()
        new = tuple(int(t) for t in stats.output_ids[0, ids.shape[1]:].tolist())
        emitted = [int(n) for n in stats.acceptance_lengths]
        rounds, start, end = [], ids.shape[1], ids.shape[1] + max_new_tokens
        for n in emitted:  # the reference drafts min(block, room) - 1 tokens a round
            rounds.append((min(self.block_size, end - start) - 1, max(n - 1, 0), n))
            start += n
        finish = "stop" if new and new[-1] in self.target.stop_token_ids else "length"
        passes = self._clock["target"]
        return Outcome(token_ids=new, wall_time_s=wall, target_forward_passes=len(passes),
                       drafter_forward_passes=self._clock["drafter_passes"],
                       mean_accepted_length=sum(emitted) / len(emitted) if emitted else 1.0,
                       draft_time_s=self._clock["draft"] if self._timed else None,
                       verify_time_s=sum(passes[1:]) if self._timed else None, rounds=tuple(rounds),
                       finish_reason=finish, prefill_time_s=stats.time_to_first_token)
