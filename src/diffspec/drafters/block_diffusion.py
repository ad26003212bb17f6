"""Block-diffusion drafter (Fast-dLLM v2 semantics; FailFast's drafter).

The model is an ordinary transformers causal LM (Qwen2/Llama body) run with a block-causal
attention mask (causal across blocks of `block_size`, bidirectional inside a block) and a mask
token. A round:

  1. keep the drafter's cache of finished blocks that still match the context (rolled back to the
     last valid block boundary), and commit any complete context block not yet cached;
  2. the active block = the context's partial block + mask tokens;
  3. denoise sub-block by sub-block: one forward pass of the active block on the cached blocks per
     step; in the current sub-block, unmask every masked position whose confidence (max
     probability) exceeds `unmask_threshold`, and at least the most confident one;
  4. the policy sees each token's confidence and widens the window or stops (FailFast); a window
     that runs past the block end commits the full block to the cache (one more pass, as
     Fast-dLLM v2 does) and continues in a new block.

For rejection sampling, each token's q is its row at the step that unmasked it, except for a token
unmasked earlier than some token to its left: that one is judged with one-hot q (per position,
exact; the argument is in denoising.py).

Logits are "shifted" (Fast-dLLM v2, Dream: position i is predicted from the logits at i-1) or not
(LLaDA). Every forward pass is counted.

A reduced draft vocabulary (`draft_token_ids`, chosen by `train-drafter --draft-vocab`): the output
head, most of a small drafter's cost, is applied to those rows of its weight only, and every other
token gets logit -inf (probability 0 under q, so rejection sampling stays exact: the verifier's
residual max(0, p - q) covers them). The stored weights keep the whole head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .. import bf16_linear, llama_pass
from ..cache import check_rollback, common_prefix_length, full_cache, reserve_cache, truncate_cache
from ..errors import DiffspecError
from ..policies.base import LengthPolicy
from ..types import Draft, SamplingParams
from .base import Drafter, DrafterCapabilities, DraftBuilder, align_logits_to_vocab, draw_tokens
from ..timing import median_ms
from .compile_choice import CompilesPasses
from .dtype_choice import ChoosesDtype
from .denoising import block_causal_mask, full_mask, judge_out_of_order_one_hot, logits_of_rows, select_unmask


_NO_ROWS = torch.zeros(0, dtype=torch.long)  # logits_to_keep for a pass whose head this drafter applies itself


@dataclass(frozen=True)
class BlockDiffusionConfig:
    mask_token_id: int
    block_size: int = 32
    sub_block_size: int = 8
    unmask_threshold: float = 0.05
    logit_shift: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.sub_block_size < 1 or self.block_size % self.sub_block_size:
            raise ValueError(f"block_size ({self.block_size}) must be a positive multiple of sub_block_size "
                             f"({self.sub_block_size})")


class BlockDiffusionDrafter(CompilesPasses, ChoosesDtype, Drafter):
    capabilities = DrafterCapabilities(gives_probabilities=True, needs_target_hidden_states=False,
                                       keeps_own_cache=True, chooses_dtype=True, compiles_passes=True)

    def __init__(self, model, config: BlockDiffusionConfig, tokenizer_fingerprint: Optional[str] = None,
                 name: str = "block-diffusion", reuse_cache: bool = True,
                 draft_token_ids: Optional[torch.Tensor] = None):
        check_rollback(model.config, name=f"block-diffusion drafter '{name}'")
        self.model = model.eval()
        self.config = config
        self.draft_token_ids = check_draft_token_ids(draft_token_ids, model, config.mask_token_id, name)
        self._kernels_for = None  # (model object, dtype) the measured matmul kernels were installed for
        self._target_kernels = "stock"  # the target's --kernels, read at attach
        self._draft_head: Optional[tuple] = None  # (weight rows or the whole head, bias or None, routed layer or None)
        self.name = name
        self.tokenizer_fingerprint = tokenizer_fingerprint
        self.reuse_cache = reuse_cache
        self.device = next(model.parameters()).device
        self.vocab_size: Optional[int] = None
        self.compute_dtype: Optional[str] = None  # see dtype_choice.py
        self.dtype_note = ""
        self._direct: Optional[llama_pass.LlamaPass] = None  # its eager passes without transformers' Python (attach)
        self.begin(None)

    def attach(self, target) -> None:
        super().attach(target)
        self.vocab_size = target.vocab_size
        self._target_kernels = getattr(target, "kernels", "stock")  # _install_kernels routes the body by it
        # eager passes through the direct Llama pass (llama_pass.py: transformers' arithmetic, bitwise, in fewer
        # calls) where the target runs measured kernels: the dtype and compile trials below time what will run
        self._direct = llama_pass.for_drafter(self.model, target)
        if self.compute_dtype == "auto":  # before the trial: it times each dtype with the kernels it would draft with
            self._install_kernels()  # (an explicit dtype is converted first, then routed: one plan, not two)
        with self._eager():  # both dtypes timed alike
            self._settle_dtype()
        self._install_kernels()  # (done already where _use_dtype ran; not where the dtype stays as loaded)
        if self.draft_token_ids is not None:  # here, not in a request's first pass: routing its rows may time their
            self._make_draft_head()  # plan (once a machine); a whole head is the model's own (made where first used)
        self._settle_compile(target)

    # --- compiled passes (compile_choice.py) --------------------------------------------
    def cost_signature(self) -> str:
        routed = any("bf16_packed" in m.__dict__ for m in self.model.modules())
        parts = ["bf16 kernel 1"] if routed else []  # its draft costs changed with the routing (ab7d108)
        if self._head_routed():
            parts.append("draft head routed 1")  # and with the draft head's (4e93fc7)
        return ", ".join(parts)

    def _head_routed(self) -> bool:
        """Whether the draft vocabulary's head rows run the measured plan (`_draft_rows`): the body's kernels are
        installed for the model and dtype it has now."""
        return self.draft_token_ids is not None and \
            self._kernels_for == (self.model, next(self.model.parameters()).dtype)

    def _compile_module(self) -> torch.nn.Module:
        return self.model.get_decoder()

    def _compile_contexts(self) -> tuple:
        B = self.config.block_size  # _time_step commits whole blocks: 3 and 7 of them, never one
        return 3 * B, 7 * B

    def _compile_signature(self) -> str:
        vocab = "whole" if self.draft_token_ids is None else self.draft_token_ids.numel()
        kernels = "stock" if self._kernels_for is None else "measured"
        head = ", draft head measured" if self._head_routed() else ""  # the eager side got faster with it
        return f"block {self.config.block_size}, draft vocabulary {vocab}, kernels {kernels}{head}"

    def _compile_refusal(self) -> Optional[str]:
        """A compiled pass runs the body only, the head applied by `reduced_head`: refused for a model whose
        head transform that does not reproduce (with a draft vocabulary, checked at construction)."""
        if not callable(getattr(self.model, "get_decoder", None)):
            return f"its model ({type(self.model).__name__}) has no get_decoder() to split the body from the head"
        if self.draft_token_ids is not None:
            return None
        rows = self.model.get_output_embeddings().weight.shape[0]
        return head_refusal(self.model, torch.arange(rows, device=self.device), self.config.mask_token_id, self.name,
                            "its compiled passes (the body, then the head applied by diffspec)")

    def _use_dtype(self, dtype: Optional[torch.dtype]) -> None:
        if dtype is not None:
            # rotary frequencies stay float32, as in a model loaded in low precision: rounded to
            # bf16 they would turn positions by up to 0.4% of the distance between two tokens
            rotary = {name: buf.float() for name, buf in self.model.named_buffers() if "inv_freq" in name}
            self.model.to(dtype)
            for name, buf in rotary.items():
                owner, attr = name.rsplit(".", 1) if "." in name else ("", name)
                setattr(self.model.get_submodule(owner), attr, buf)
        if self._direct is not None and self._direct.model is not self.model:  # the dtype trial's copy, or the
            self._direct = llama_pass.LlamaPass(self.model)  # original back: each runs through its own modules
        self._draft_head = None  # rebuilt in the new dtype
        self._install_kernels()  # here, so the dtype trial times each dtype with the kernels it would draft with
        self.begin(None)  # the cache is made in the model's dtype

    def _install_kernels(self) -> None:
        """The measured matmul kernels (kernels.py: its own shapes and dtype; a drafter's numerics never touch the
        output) where the target runs measured kernels on a CPU, and a bf16 body's layers then through bf16_linear
        (~2x oneDNN's at 1-16 rows on an AVX-512 EPYC). Installed once per model object and dtype: a compiled graph
        traced through them stays valid on a re-attach. A deep copy of a routed model (the dtype trial's) carries
        forwards bound to itself, and is routed again here for its dtype."""
        installed_for = (self.model, next(self.model.parameters()).dtype)
        if self._target_kernels == "stock" or self.device.type != "cpu" or self._kernels_for == installed_for:
            return
        from .. import kernels

        kernels.install(self.model, kernels.plan_for_mode(self.model, "auto", quiet=True))
        if installed_for[1] == torch.bfloat16:
            bf16_linear.install(self.model, rows=self.config.block_size)
        self._kernels_for = installed_for
        self._draft_head = None  # made again, routed like the body

    def _time_step(self, context_len: int = 64, repeats: int = 5) -> float:
        """Median milliseconds of one denoising step (a block on about `context_len` cached positions)."""
        B, mask = self.config.block_size, self.config.mask_token_id
        self.begin(None)
        self._commit([mask] * max(B, context_len // B * B))
        ms = median_ms(lambda: self._block_logits([mask] * B, range(1, B)), self.device, repeats)
        self.begin(None)
        return ms

    def begin(self, prompt_ids) -> None:
        self._cache = full_cache()  # its masks are its own (block-causal, no window), so every layer keeps all
        self._cached_ids: list = []       # tokens of the finished blocks in the cache
        self._boundary_logits = None      # logits at the last cached position (predicts the next block's first token)
        self._passes = 0

    # --- model calls ---------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, tokens: list, mask: torch.Tensor, rows) -> torch.Tensor:
        """One pass; logits only for `rows` (a list of row indices, or an int n: the last n rows).
        The output head is most of this drafter's cost: the rows nobody reads are not computed.
        A block of the block size on a non-empty cache (every denoising step, every commit after the
        first) runs the compiled body where one is kept (compile_choice.py)."""
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        self._passes += 1
        past = len(self._cached_ids)
        body = self._compiled_body(len(tokens) == self.config.block_size and past > 0)
        # eager: the direct pass where it applies (the model's own logits or last hidden state, bitwise, fewer calls)
        direct = self._direct if body is None and self._direct is not None and self._direct.runs_on(self._cache) \
            else None
        if body is None and self.draft_token_ids is None:
            run = direct if direct is not None else self.model
            logits = logits_of_rows(run, rows, input_ids=ids, attention_mask=mask, past_key_values=self._cache,
                                    use_cache=True)
            return align_logits_to_vocab(logits, self.vocab_size or logits.shape[-1])
        if direct is not None:  # the body's normed last hidden state, no head
            hidden = direct.forward(ids, self._cache, attention_mask=mask, output_hidden_states=True,
                                    logits_to_keep=_NO_ROWS).hidden_states[-1][0]
        else:
            if body is None:
                body = self.model.get_decoder()
            else:  # room for the block made outside the graph: a cache growing inside it would be another graph
                reserve_cache(self._cache, past + 2 * self.config.block_size)
            hidden = body(input_ids=ids, attention_mask=mask, past_key_values=self._cache,
                          use_cache=True).last_hidden_state[0]
        hidden = hidden[-rows:] if isinstance(rows, int) else hidden[torch.tensor(rows, device=hidden.device)]
        return self._head_logits(hidden)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The output head on the body's rows `hidden`: with a draft vocabulary its rows for those tokens
        only (-> [rows, vocab] with -inf outside it), else the whole head (-> [rows, vocab])."""
        weight, bias, linear = self._make_draft_head()
        small = reduced_head(self.model, hidden, weight, bias, linear)
        width = self.vocab_size or self.model.config.vocab_size
        if self.draft_token_ids is None:
            return align_logits_to_vocab(small, width)
        return small.new_full((small.shape[0], width), float("-inf")).index_copy_(1, self.draft_token_ids, small)

    def _make_draft_head(self) -> tuple:
        """`_draft_head`, made where it is None: (the head's weight or its rows for the draft vocabulary, bias or None,
        the rows' routed layer or None)."""
        if self._draft_head is None:
            head = self.model.get_output_embeddings()
            bias = getattr(head, "bias", None)
            ids = self.draft_token_ids
            if ids is None:
                self._draft_head = (head.weight, bias, None)
            else:
                with torch.inference_mode(False):  # plain tensors: a pack of them checks their in-place version
                    self._draft_head = self._draft_rows(head.weight.detach()[ids].contiguous(),
                                                        None if bias is None else bias.detach()[ids].contiguous())
        return self._draft_head

    def _draft_rows(self, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple:
        """(weight, bias, its linear layer or None): the draft vocabulary's head rows, as a layer routed by the
        measured matmul plan (kernels.py) where the body's layers are. F.linear asks MKL for x @ W^T, which an AMD
        CPU runs 2-3x slower than mm(W, x^T) at 2-8 rows: SmolLM2's 8192 x 576 rows took 4.7-5.8 ms against
        1.5-2.9 on Zen 1, a third of a denoising step."""
        if not self._head_routed():
            return weight, bias, None
        from .. import kernels

        linear = torch.nn.utils.skip_init(torch.nn.Linear, weight.shape[1], weight.shape[0], bias=bias is not None,
                                          device=weight.device, dtype=weight.dtype).requires_grad_(False)
        linear.weight.data, holder = weight, torch.nn.Sequential(linear)
        if bias is not None:
            linear.bias.data = bias
        kernels.install(holder, kernels.plan_for_mode(holder, "auto", quiet=True))
        if weight.dtype == torch.bfloat16:
            bf16_linear.install(holder, rows=self.config.block_size)
        return weight, bias, linear

    def _commit(self, tokens: list) -> None:
        """Append whole blocks to the cache (block-causal among themselves); only the last row's
        logits are computed (they predict the next block's first token)."""
        past = len(self._cached_ids)
        logits = self._forward(tokens, block_causal_mask(len(tokens), past, self.config.block_size, self.device), 1)
        self._cached_ids.extend(tokens)
        self._boundary_logits = logits[-1]

    def _truncate(self, length: int) -> None:
        truncate_cache(self._cache, length)
        if length < len(self._cached_ids):
            del self._cached_ids[length:]
            self._boundary_logits = None

    def _sync(self, context: list) -> int:
        """Make the cache hold exactly the complete blocks of `context`; return its length."""
        B = self.config.block_size
        keep = common_prefix_length(self._cached_ids, context) if self.reuse_cache else 0
        keep = min(keep // B, len(context) // B) * B
        self._truncate(keep)
        full = (len(context) // B) * B
        if self.config.logit_shift and full == len(context) and full > 0 and self._boundary_logits is None \
                and len(self._cached_ids) == full:
            self._truncate(full - B)  # the next block's first token needs the last block's logits: recompute it
        if full > len(self._cached_ids):
            self._commit(context[len(self._cached_ids): full])
        return len(self._cached_ids)

    def _block_logits(self, block: list, positions) -> torch.Tensor:
        """One denoising step: the active block on the cache, which is left unchanged. -> [len(positions), V],
        the prediction rows of those block positions. With shifted logits position 0's row is the last
        block's boundary row, so a step that needs only it runs no pass."""
        rows = [self._row_of(i) for i in positions]
        computed = sorted({r for r in rows if r >= 0})
        logits = None
        if computed:
            past = len(self._cached_ids)
            logits = self._forward(block, full_mask(len(block), past + len(block), self.device), computed)
            truncate_cache(self._cache, past)
        where = {r: j for j, r in enumerate(computed)}
        return torch.stack([logits[where[r]] if r >= 0 else self._boundary() for r in rows])

    def _row_of(self, i: int) -> int:
        """The block row whose logits predict block position i (-1: the previous block's boundary row)."""
        return i - 1 if self.config.logit_shift else i

    def _boundary(self) -> torch.Tensor:
        if self._boundary_logits is None:
            raise RuntimeError("shifted logits need the previous block's last logits")
        return self._boundary_logits

    # --- drafting ------------------------------------------------------------------------
    def propose(self, context: torch.Tensor, policy: LengthPolicy, limit: int,
                sampling: SamplingParams, generator: Optional[torch.Generator]) -> Draft:
        cfg, B, b, MASK = self.config, self.config.block_size, self.config.sub_block_size, self.config.mask_token_id
        self._passes = 0
        ids = context.tolist()
        start = self._sync(ids)
        block = ids[start:] + [MASK] * (B - (len(ids) - start))
        cursor = len(ids) - start          # block position of the next token to hand to the builder
        unmasked: dict = {}                # block position -> (token, confidence, q row or None, step)
        builder, steps, step = DraftBuilder(), [], 0
        for k in builder.increments(policy, limit):
            goal = len(builder) + k
            while len(builder) < goal:
                if cursor == B:            # the block is full: commit it and open a new one
                    self._commit(block)
                    block, cursor, unmasked = [MASK] * B, 0, {}
                    continue
                stop = min((cursor // b + 1) * b, cursor + goal - len(builder))  # sub-block end, capped by the window
                masked = [i for i in range(cursor, stop) if block[i] == MASK]
                step += 1
                drawn = draw_tokens(self._block_logits(block, masked), sampling, generator)
                # unmasking is decided on the max probability, never on the drawn token: no selection bias
                conf, tokens, q = drawn.max_prob, drawn.tokens, drawn.q
                for j in select_unmask(conf, cfg.unmask_threshold).tolist():
                    block[masked[j]] = int(tokens[j])
                    unmasked[masked[j]] = (int(tokens[j]), float(conf[j]), None if q is None else q[j], step)
                while cursor < B and cursor in unmasked and len(builder) < goal:
                    token, c, q_row, s = unmasked[cursor]
                    builder.add(token, c, q_row)
                    steps.append(s)
                    cursor += 1
        draft = builder.build(self._passes, context.device)
        return judge_out_of_order_one_hot(draft, steps)  # per position: see denoising.py

    def describe(self) -> str:
        c = self.config
        vocab = "" if self.draft_token_ids is None else f"draft vocabulary {self.draft_token_ids.numel()}, "
        return (f"{self.name}(block {c.block_size}, sub-block {c.sub_block_size}, threshold {c.unmask_threshold}, "
                f"{'shifted' if c.logit_shift else 'unshifted'}, {vocab}{self._dtype_text()}{self._compile_text()})")


def reduced_head(model, hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                 linear: Optional[torch.nn.Linear] = None) -> torch.Tensor:
    """The output head's rows `weight` (and `bias`) applied to `hidden` (through `linear`, a layer holding them,
    where given), with the transform the model's head applies after its matmul where that is a softcap (Gemma); in
    float32 at least (float64 stays). Any other transform (e.g. Cohere's logit_scale) is caught by
    check_draft_token_ids, never silently left out."""
    small = linear(hidden) if linear is not None else torch.nn.functional.linear(hidden, weight, bias)
    small = small.to(torch.promote_types(small.dtype, torch.float32))
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:  # Gemma-style heads squash their logits
        small = torch.tanh(small / cap) * cap
    return small


def check_draft_token_ids(ids: Optional[torch.Tensor], model, mask_token_id: int, name: str) -> Optional[torch.Tensor]:
    """A reduced draft vocabulary: distinct token ids inside the head, never the mask, and a model whose
    logits the reduced head reproduces (`head_refusal`). -> int64 ids on the model's device (None stays None)."""
    if ids is None:
        return None
    ids = torch.as_tensor(ids, dtype=torch.long).flatten()
    rows = model.get_output_embeddings().weight.shape[0]
    if ids.numel() == 0 or ids.unique().numel() != ids.numel() or int(ids.min()) < 0 or int(ids.max()) >= rows:
        raise DiffspecError(f"block-diffusion drafter '{name}': draft_token_ids must be distinct ids in [0, {rows})")
    if bool((ids == mask_token_id).any()):
        raise DiffspecError(f"block-diffusion drafter '{name}': the mask token {mask_token_id} cannot be drafted")
    ids = ids.to(next(model.parameters()).device)
    refusal = head_refusal(model, ids, mask_token_id, name, "a reduced draft vocabulary")
    if refusal:
        raise DiffspecError(refusal + "; use the whole vocabulary (no draft_token_ids)")
    return ids


def head_refusal(model, ids: torch.Tensor, mask_token_id: int, name: str, what: str) -> Optional[str]:
    """Whether `reduced_head` on the decoder's output reproduces the model's own logits for `ids` (one token
    through the whole model against its decoder + the head's rows): a head transform it does not know would
    otherwise lower acceptance silently. -> None, or why not (naming `what` needs it)."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        x = torch.tensor([[mask_token_id]], device=device)
        full = model(input_ids=x).logits[0, -1].float()[ids]
        hidden = model.get_decoder()(input_ids=x).last_hidden_state[0, -1:]
        head = model.get_output_embeddings()
        bias = getattr(head, "bias", None)
        small = reduced_head(model, hidden, head.weight[ids], None if bias is None else bias[ids])[0].float()
    if torch.allclose(small, full, rtol=1e-3, atol=1e-3 * float(full.abs().max()) + 1e-6):
        return None
    return (f"block-diffusion drafter '{name}': its model ({type(model).__name__}) transforms its logits in a way "
            f"{what} does not reproduce (largest difference {float((small - full).abs().max()):.3g})")
