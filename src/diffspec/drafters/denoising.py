"""Pure functions shared by the diffusion drafters: attention masks, the unmasking rules, and which
drafted tokens may hand their q to rejection sampling.

Which q is exact (the argument). Rejection sampling judges d_i with min(1, p_i(d_i) / q_i(d_i)) and,
on rejection, draws from norm(max(0, p_i - q_i)). Given everything the verifier has used before
reaching position i - the tokens d_<i, their q rows and rules, their acceptance coins - call it
I_i, the output at i has the target's distribution p_i(. | d_<i) whenever

    (Q)  d_i, given I_i and the rule chosen for i, is distributed as q_i;     or
    (H)  q_i is one-hot at d_i (accept with probability p_i(d_i), else draw from p_i without d_i),
         which is exact for ANY way d_i was chosen.

A diffusion drafter draws, at every step t, a token for each masked position of the window from
that position's row q^(t) (independently across positions), and unmasks a subset chosen from the
rows' max probabilities alone, never from the drawn tokens. Write s_i for the step that unmasked
position i. Everything decided before the draw at step s_i (earlier steps' tokens, which positions
step s_i unmasks, the rows q^(s_i)) is independent of that draw, so d_i ~ q^(s_i) given it.

(Q) therefore holds for position i when every d_j, j < i, was unmasked at a step s_j <= s_i: then
I_i (d_<i, their rows, their rules, whether i is drafted) is decided before or beside
the draw of d_i (the policy's later window sizes may depend on d_i, but whether i is drafted at
all is fixed by the windows up to and including i's, all decided earlier). It fails when some
j < i was unmasked later (s_j > s_i): d_j was drawn looking at d_i, and which positions later
steps unmask depends on d_i, so I_i carries information about d_i. Hence the per-position rule

    position i keeps q_i  iff  max(s_0 .. s_{i-1}) <= s_i,   otherwise it is judged one-hot (H).

The rule for i is itself known at step s_i (which positions are unmasked by then), so it never
looks at d_i. A rule taken once for the whole draft ("q everywhere if the order is left to
right, else one-hot everywhere") is NOT exact: whether later steps break the order depends on
the tokens drawn earlier, so the rule that judges d_0 would depend on d_0. Worked case: step 1
unmasks position 0; if d_0 = a step 2 unmasks position 1 (order kept, q), if d_0 = b it unmasks
position 2 (order broken, one-hot). With q_0 = (.5, .5), p_0 = (.9, .1):
P(first = a) = .5 * 1 + .5 * .9 = .95, not .9. Under the per-position rule position 0 always
keeps q_0 and P(first = a) = .9.

Tokens of later FailFast windows are unmasked at later steps than every token of earlier windows,
and a window's size is decided from the confidences (max probabilities) of earlier windows only,
so the rule holds across windows too.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..types import Draft


def logits_of_rows(model, rows, **inputs) -> torch.Tensor:
    """model(**inputs).logits[0] for `rows` only (a list of distinct, increasing row indices, or an int n:
    the last n). A model that takes `logits_to_keep` (every transformers causal LM) applies its output head
    to those rows alone; any other model, or one that accepts the argument and computes every row anyway,
    has its rows picked from the full logits."""
    import inspect

    device = inputs["input_ids"].device
    keep = rows if isinstance(rows, int) else torch.tensor(rows, dtype=torch.long, device=device)
    takes = getattr(model, "_diffspec_takes_logits_to_keep", None)
    if takes is None:
        try:
            params = inspect.signature(model.forward).parameters
            takes = "logits_to_keep" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            takes = False
        try:
            model._diffspec_takes_logits_to_keep = takes
        except AttributeError:
            pass
    logits = (model(**inputs, logits_to_keep=keep) if takes else model(**inputs)).logits[0]
    wanted = rows if isinstance(rows, int) else len(rows)
    if logits.shape[0] == wanted:  # the rows asked for (or every row, when that is what was asked)
        return logits
    return logits[-rows:] if isinstance(rows, int) else logits[keep]


def block_causal_mask(q_len: int, past_len: int, block_size: int, device=None) -> torch.Tensor:
    """[1, 1, q_len, past_len + q_len] bool, True = may attend.

    Queries are the positions past_len .. past_len+q_len-1, keys 0 .. past_len+q_len-1. A query
    sees every key whose block (position // block_size) is not later than its own: causal across
    blocks, bidirectional inside a block.
    """
    q_pos = torch.arange(past_len, past_len + q_len, device=device)
    k_pos = torch.arange(past_len + q_len, device=device)
    visible = (k_pos[None, :] // block_size) <= (q_pos[:, None] // block_size)
    return visible[None, None]


def full_mask(q_len: int, kv_len: int, device=None) -> torch.Tensor:
    """[1, 1, q_len, kv_len] all True: bidirectional attention."""
    return torch.ones(1, 1, q_len, kv_len, dtype=torch.bool, device=device)


def select_unmask(confidences: torch.Tensor, threshold: float) -> torch.Tensor:
    """Which masked positions to unmask this step: those whose confidence exceeds the threshold,
    and always at least the most confident one. confidences [m] -> sorted indices [<= m]."""
    chosen = (confidences > threshold).nonzero().flatten()
    if chosen.numel() == 0:
        chosen = confidences.argmax().view(1)
    return chosen.sort().values


def select_top(confidences: torch.Tensor, count: int) -> torch.Tensor:
    """The `count` most confident positions (SpecDiff's per-step rule). [m] -> sorted indices."""
    count = max(1, min(count, confidences.numel()))
    return torch.topk(confidences, count).indices.sort().values


def keeps_q(steps: Sequence[int]) -> list:
    """Per drafted position (left to right), whether its own q may go to rejection sampling: True
    iff no position to its left was unmasked at a later step (see the module docstring)."""
    keep, latest = [], None
    for s in steps:
        keep.append(latest is None or latest <= s)
        latest = s if latest is None else max(latest, s)
    return keep


def judge_out_of_order_one_hot(draft: Draft, steps: Sequence[int]) -> Draft:
    """The draft with q replaced by one-hot q at the positions `keeps_q` refuses (exact either way)."""
    if draft.probs is None:
        return draft
    keep = keeps_q(steps)
    if all(keep):
        return draft
    probs = draft.probs.clone()
    for i, ok in enumerate(keep):
        if not ok:
            probs[i].zero_()
            probs[i, int(draft.tokens[i])] = 1.0
    return Draft(draft.tokens, probs, draft.confidences, draft.forward_passes)
