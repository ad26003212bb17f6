"""The speculative decoding engine.

Contract: for any drafter and any length policy, `SpeculativeEngine.generate` returns exactly what
the target alone would produce - token for token when greedy (temperature 0), and a sample from
the target's own distribution when sampling (temperature / top-k / top-p). A drafter only changes
how many target forward passes that takes.

Each round:
  1. draft   - the policy plans the round (it may run no drafter: a plain step); the drafter proposes
               up to `limit` tokens, the policy deciding how many, and where cutting cannot bias the
               output (greedy, or a draft that is a function of the context) how many to verify;
  2. verify  - ONE target forward pass over [last token, d_1..d_k] gives k+1 distributions;
  3. accept  - greedy prefix match or rejection sampling (see verify.py) keeps d_1..d_n and adds
               one recovered or bonus token;
  4. stop    - the emitted tokens are cut at the first stop token and at max_new_tokens;
  5. roll back - the target cache is cut to the accepted length (a pointer move);
  6. feedback - the drafter gets the target's hidden states if it asked, the policy the round's stats.

A drafter that reads hidden states gets them from the prefill and every verify pass until the policy says
it will not run again in this request (`wants_hidden_states()` False, e.g. auto retiring a drafter that does
not pay): from then on, to the request's end, the target computes none.

The target cache always holds every token but the last one emitted: that token is the first
input of the next verify pass, so plain decoding (no drafter) is the same loop with k = 0.

Statistics: `GenerationResult.mean_accepted_length` counts the bonus token (vLLM's convention):
emitted tokens per round, 1.0 for plain decoding.
"""

from __future__ import annotations

import time
from typing import Iterator, Optional, Sequence, Union

import torch

from .drafters.base import Drafter, draft_may_be_judged
from .errors import DiffspecError
from .policies import FailFastPolicy, LengthPolicy
from .sampling import make_generator, probs_from_logits
from .target import Target
from .types import Draft, GenerationResult, RoundStats, SamplingParams
from .verify import verify_greedy_choices, verify_rejection

Prompt = Union[str, Sequence[int], torch.Tensor]


class SpeculativeEngine:
    """A target, an optional drafter and a speculation-length policy. One request at a time."""

    def __init__(self, target: Target, drafter: Optional[Drafter] = None, policy: Optional[LengthPolicy] = None,
                 allow_inexact: bool = False):
        if drafter is not None and not allow_inexact and not target.speculation_exact:
            raise DiffspecError(f"no speculative decoding on the {target.backend} backend here: "
                                f"{target.inexact_reason}; use --drafter none for its plain speed, or --backend "
                                f"transformers for exact speculation")
        if (drafter is not None and not allow_inexact and drafter.capabilities.needs_target_hidden_states
                and not target.hidden_states_exact):
            raise DiffspecError(f"drafter '{drafter.name}' reads the target's hidden states, and on the {target.backend} "
                                f"backend here {target.hidden_states_inexact_reason}; use a drafter that needs only "
                                f"token ids, or --backend transformers")
        if drafter is not None:
            drafter.attach(target)
        self.target = target
        self.drafter = drafter
        self.policy = policy or FailFastPolicy()
        self.policy.attach(target, drafter, engine_type=type(self))
        cap = drafter.max_tokens_per_round if drafter is not None else None
        # parameters that a drafter's per-round cap makes moot, and a target whose verify rows round unlike its
        # one-token steps: said once, in every result's stats
        rounding = getattr(target, "rounding_note", None) if drafter is not None else None
        self.notes: tuple = (self.policy.cap_notes(cap) if cap is not None else ()) + ((rounding,) if rounding else ())

    # --- public API ----------------------------------------------------------------------
    def generate(self, prompt: Prompt, max_new_tokens: int = 256, sampling: Optional[SamplingParams] = None,
                 chat: bool = True, stop_token_ids: Optional[Sequence[int]] = None,
                 system: Optional[str] = None) -> GenerationResult:
        """Generate a completion; `prompt` is text (chat template applied unless chat=False) or token ids."""
        stream = self.stream(prompt, max_new_tokens, sampling, chat, stop_token_ids, system)
        stream.incremental = False  # nobody reads the deltas: the text is decoded once, at the end
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: Prompt, max_new_tokens: int = 256, sampling: Optional[SamplingParams] = None,
               chat: bool = True, stop_token_ids: Optional[Sequence[int]] = None,
               system: Optional[str] = None) -> "GenerationStream":
        """Like generate, but iterating yields text as rounds are accepted; `.result` at the end."""
        sampling = sampling or SamplingParams()
        prompt_ids = self._prompt_ids(prompt, chat, system)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise DiffspecError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        room = self.target.max_context - len(prompt_ids)
        if room <= 0:
            raise DiffspecError(f"prompt has {len(prompt_ids)} tokens, more than fits in the model's context "
                                f"of {self.target.max_context} tokens (at least one new token must fit)")
        stops = frozenset(int(t) for t in stop_token_ids) if stop_token_ids is not None else self.target.stop_token_ids
        rounds = self._rounds(prompt_ids, min(max_new_tokens, room), sampling, stops)
        return GenerationStream(self, prompt_ids, rounds)

    # --- the loop ------------------------------------------------------------------------
    def _rounds(self, prompt_ids: list, max_new_tokens: int, sampling: SamplingParams,
                stops: frozenset) -> Iterator[tuple]:
        """Yields (prefill seconds, prefill passes) once, then (emitted ids, RoundStats, finish reason or None)."""
        target, drafter, policy = self.target, self.drafter, self.policy
        device = target.device
        layers = tuple(drafter.target_layer_ids) if drafter and drafter.capabilities.needs_target_hidden_states else ()
        generator = make_generator(sampling, device)
        tokens = torch.tensor(prompt_ids, dtype=torch.long, device=device)

        # 0. prefill: the cache takes every prompt token but the last (no pass where the target still holds
        #    this prompt's prefill from the request before: Target.prefill)
        t0 = time.perf_counter()
        passes_before = target.forward_passes
        policy.begin_request(sampling.greedy)
        if layers and not policy.wants_hidden_states():
            layers = ()  # the reader sits this request out
        sources = drafter.sources if drafter is not None else ()
        if drafter is not None:
            drafter.begin(tokens)
        # room for the most this request's cache will hold
        hidden = target.prefill(tokens[:-1], len(prompt_ids) + max_new_tokens, hidden_layers=layers)
        if layers and len(prompt_ids) > 1:
            drafter.observe(hidden, start=0)
        yield time.perf_counter() - t0, target.forward_passes - passes_before

        generated = 0
        while True:
            # 1. draft
            t0 = time.perf_counter()
            limit = max_new_tokens - generated - 1  # the target adds one token of its own
            if target.max_verify_tokens is not None:  # wider passes would not be exact on this backend
                limit = min(limit, target.max_verify_tokens - 1)
            planned = policy.plan_round(tokens.shape[0], sources) if drafter is not None and limit > 0 else ()
            if layers and not policy.wants_hidden_states():
                layers = ()  # the reader is out for the rest of the request: never asked again
            draft, costs = Draft.empty(device), ()
            if planned:
                draft = drafter.propose(tokens, policy, limit, sampling, generator)
                spent = time.perf_counter() - t0
                costs = draft.costs or ((draft.source or drafter.name, len(draft), spent),)
                if len(draft) and draft_may_be_judged(draft, sampling):
                    draft = draft.prefix(policy.final_length(draft.confidences.tolist(), spent))
                draft = draft.to(device)  # verification reads it beside the target's rows
            k = len(draft)
            t1 = time.perf_counter()

            # 2. verify: one forward pass over [last, d_1..d_k]
            out = target.forward(torch.cat([tokens[-1:], draft.tokens]), hidden_layers=layers)

            # 3. accept
            if sampling.greedy:
                verdict = verify_greedy_choices(draft.tokens, out.greedy_tokens())
            else:
                p = probs_from_logits(out.logits, sampling)
                verdict = verify_rejection(draft.tokens, draft.probs, p, generator)
            n = verdict.num_accepted
            emitted = draft.tokens[:n].tolist() + [verdict.next_token]

            # 4. stop: first stop token, then the length budget
            finish = None
            for i, tok in enumerate(emitted):
                if tok in stops:
                    emitted, finish = emitted[: i + 1], "stop"
                    break
            if finish is None and generated + len(emitted) >= max_new_tokens:
                emitted, finish = emitted[: max_new_tokens - generated], "length"

            # 5. roll back: keep the context and the n accepted drafts; the new last token stays out
            context_len = tokens.shape[0]
            target.truncate(context_len + n)
            tokens = torch.cat([tokens, torch.tensor(emitted, dtype=torch.long, device=device)])
            generated += len(emitted)
            t2 = time.perf_counter()

            # 6. feedback
            if layers:
                drafter.observe(out.hidden_states[: n + 1], start=context_len - 1)
            stats = RoundStats(drafted=k, accepted=n, emitted=len(emitted), draft_time_s=t1 - t0,
                               verify_time_s=t2 - t1, target_forward_passes=1,
                               drafter_forward_passes=draft.forward_passes,
                               confidences=tuple(round(c, 4) for c in draft.confidences.tolist()),
                               speculation_off=drafter is not None and limit > 0 and not planned,
                               hidden_states=bool(layers),
                               source=(draft.source or drafter.name) if planned else "", draft_costs=costs)
            policy.update(stats)
            yield emitted, stats, finish
            if finish is not None:
                return

    # --- helpers -------------------------------------------------------------------------
    def _prompt_ids(self, prompt: Prompt, chat: bool, system: Optional[str]) -> list:
        if isinstance(prompt, str):
            return self.target.encode_prompt(prompt, chat=chat, system=system)
        ids = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        if not ids:
            raise DiffspecError("prompt is empty")
        vocab = self.target.vocab_size
        if any((not isinstance(i, int)) or i < 0 or i >= vocab for i in ids):
            raise DiffspecError(f"prompt token ids must be integers in [0, {vocab})")
        return ids


class IncrementalText:
    """Text deltas of a growing token list, decoding a window of the last tokens a round rather than
    every token (which is O(N) a round, O(N^2) over a request).

    The window's decoded text is released up to its last complete character: a character split over
    byte tokens (U+FFFD at the end) waits for the token that completes it, and everything before it
    goes out at once. The window slides forward to keep WINDOW tokens of context (tokenizers whose
    text for a token depends on its left neighbour: a joining space, a merged byte sequence) only
    where the shorter window decodes to the end of what was released; otherwise it waits a round.
    GenerationStream reconciles with one decoding of every token at the end, so the final text is
    always exactly the tokenizer's."""

    WINDOW = 6

    def __init__(self, decode):
        self.decode = decode
        self.start = 0       # first token of the window
        self.released = ""   # the window's text released so far

    def _text(self, ids: Sequence[int], final: bool) -> str:
        text = self.decode(ids)
        return text if final else text.rstrip("\ufffd")

    def advance(self, ids: Sequence[int], final: bool = False) -> str:
        text = self._text(ids[self.start:], final)
        if not text.startswith(self.released):
            return ""  # a new token changed the window's released text: wait (the end reconciles)
        delta, self.released = text[len(self.released):], text
        if len(ids) - self.start > 2 * self.WINDOW:
            for start in range(len(ids) - self.WINDOW, len(ids) - self.WINDOW - 4, -1):  # a start on a character
                tail = self._text(ids[start:], final)
                if tail and not tail.startswith("\ufffd") and text.endswith(tail):
                    self.start, self.released = start, tail
                    break
        return delta


class GenerationStream:
    """Iterate for text deltas as rounds are accepted; `result` holds the GenerationResult at the end.

    Text is released only when it decodes cleanly (no half of a multi-byte character), decoded
    incrementally (IncrementalText); with `incremental = False` (set before iterating: what `generate`
    does) the text is decoded once, at the end (a round's decoding is ~0.1 ms, ~1% of a CPU step).
    Closing the stream early (`close()`, or dropping it) stops generation at the next round.
    """

    def __init__(self, engine: SpeculativeEngine, prompt_ids: list, rounds: Iterator):
        self._engine = engine
        self._rounds = rounds
        self.prompt_ids = prompt_ids
        self.token_ids: list = []
        self.round_stats: list = []
        self.text = ""
        self.result: Optional[GenerationResult] = None
        self._finish_reason = "length"
        self._t_start = time.perf_counter()
        self._prefill = (0.0, 0)
        self.incremental = True

    def __iter__(self) -> Iterator[str]:
        target = self._engine.target
        self._t_start = time.perf_counter()
        self._prefill = next(self._rounds)
        text = IncrementalText(target.decode) if target.tokenizer is not None and self.incremental else None
        for emitted, stats, finish in self._rounds:
            self.token_ids.extend(emitted)
            self.round_stats.append(stats)
            self._finish_reason = finish or self._finish_reason
            if text is not None:
                delta = text.advance(self.token_ids, final=finish is not None)
                if delta:
                    self.text += delta
                    yield delta
        if target.tokenizer is not None:  # one full decoding at the end: the text is exactly the tokenizer's
            full = target.decode(self.token_ids)
            if full != self.text:
                rest = full[len(self.text):] if full.startswith(self.text) else ""
                self.text = full
                if rest:
                    yield rest
        self._finish()

    def close(self) -> None:
        self._rounds.close()

    def _finish(self) -> None:
        wall = time.perf_counter() - self._t_start
        self.result = GenerationResult(
            text=self.text, token_ids=list(self.token_ids), prompt_token_ids=list(self.prompt_ids),
            finish_reason=self._finish_reason, rounds=tuple(self.round_stats), wall_time_s=wall,
            prefill_time_s=self._prefill[0], prefill_forward_passes=self._prefill[1], notes=self._engine.notes)
