"""Target-side training data: the target's own responses, and teacher-forced target passes.

`generate_responses` lets the target answer corpus prompts greedily: training on those sequences
aligns the drafter with exactly what it will be asked to predict. `extract_features` runs the
target once over each sequence (batched, right-padded) and keeps, per position, the hidden
states of the chosen layers (fp16) and the target's own next-token choice (`target_next`, the
label of the alignment objective); nothing else is ever recomputed during training.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch


@dataclass
class SequenceFeatures:
    tokens: torch.Tensor        # [T] int64
    hidden: torch.Tensor        # [T, len(layers) * H] fp16: target hidden states of the chosen layers
    target_next: torch.Tensor   # [T] int64: target argmax at position t (its choice for token t+1)
    first_supervised: int       # anchors start here (positions before are prompt)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "hidden": self.hidden, "target_next": self.target_next,
                "first_supervised": self.first_supervised}


def render_prompt(tokenizer, messages: list, max_tokens: int) -> list:
    """The first user turn (and a leading system turn) with the chat template's assistant prefix."""
    head = [m for m in messages[:2] if m["role"] in ("system", "user")]
    while head and head[-1]["role"] != "user":
        head.pop()
    if not head:
        return []
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(head, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
    else:
        ids = tokenizer(head[-1]["content"])["input_ids"]
    return list(ids)[-max_tokens:]


def render_conversation(tokenizer, messages: list, max_tokens: int) -> tuple:
    """Whole conversation through the chat template -> (ids, index of the first assistant token)."""
    prompt = render_prompt(tokenizer, messages, max_tokens)
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(messages, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "input_ids") else ids
    else:
        ids = tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"]
    ids = list(ids)[:max_tokens]
    return ids, min(len(prompt), len(ids) - 1)


@torch.inference_mode()
def generate_responses(model, tokenizer, prompts: Sequence[list], max_new_tokens: int, batch_size: int = 16,
                       stop_ids: Sequence[int] = (), deadline: Optional[float] = None,
                       progress: Optional[Callable[[int, int], None]] = None) -> list:
    """Greedy target answers for token-id prompts -> list of (prompt + response ids, len(prompt))."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out = []
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths share a batch
    for start in range(0, len(order), batch_size):
        if deadline is not None and time.time() > deadline:
            break
        idx = order[start:start + batch_size]
        width = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), width), pad, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # left padding
            ids[row, width - len(prompts[i]):] = torch.tensor(prompts[i])
            att[row, width - len(prompts[i]):] = 1
        gen = model.generate(input_ids=ids.to(model.device), attention_mask=att.to(model.device), max_new_tokens=max_new_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=list(stop_ids) or None)
        for row, i in enumerate(idx):
            resp = gen[row, width:].tolist()
            for j, t in enumerate(resp):
                if t in stop_ids:
                    resp = resp[: j + 1]
                    break
            if len(resp) > 1:
                out.append((list(prompts[i]) + resp, len(prompts[i])))
        if progress:
            progress(min(start + batch_size, len(order)), len(order))
    return out


@torch.inference_mode()
def extract_features(model, sequences: Sequence[tuple], layer_ids: Sequence[int], batch_size: int = 8,
                     pad_id: int = 0, progress: Optional[Callable[[int, int], None]] = None) -> list:
    """One teacher-forced target pass per sequence (batched by similar length) -> [SequenceFeatures],
    in the order of `sequences`."""
    feats = [None] * len(sequences)
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i][0]))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        width = max(len(sequences[i][0]) for i in idx)
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        att = torch.zeros((len(idx), width), dtype=torch.long)
        for row, i in enumerate(idx):  # right padding: causal positions are unaffected
            ids[row, : len(sequences[i][0])] = torch.tensor(sequences[i][0])
            att[row, : len(sequences[i][0])] = 1
        ids, att = ids.to(model.device), att.to(model.device)
        out = model(input_ids=ids, attention_mask=att, output_hidden_states=True, use_cache=False)
        hidden = torch.cat([out.hidden_states[l + 1] for l in layer_ids], dim=-1)
        nxt = out.logits.argmax(-1)
        for row, i in enumerate(idx):
            n = len(sequences[i][0])
            feats[i] = SequenceFeatures(tokens=ids[row, :n].clone(), hidden=hidden[row, :n].to(torch.float16).clone(),
                                        target_next=nxt[row, :n].clone(), first_supervised=int(sequences[i][1]))
        if progress:
            progress(min(start + batch_size, len(order)), len(order))
    return feats
