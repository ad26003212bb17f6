"""Grouped-query attention without copying the cache, for the target's passes on a CPU (issue 19).

transformers' `sdpa` attention shares a key/value head among a group of query heads (GQA: SmolLM2-135M
has 9 query heads on 3 key/value heads) inside the kernel (`enable_gqa`) only when the pass has no
mask: one-row steps. A pass with a mask, which every verify pass of 2+ rows on a cache has (eager or
compiled), takes `repeat_kv` instead, which copies every layer's whole cached keys and values three
times over before each attention call: on a 2-core AVX-512 EPYC at a 256-token context 5.4 of a
16-row pass's 168 ms (`aten::copy_` of [1, 3, 3, 272, 64] twice per layer), growing with the context.

PyTorch's CPU attention kernels take `enable_gqa=True` with a mask too, and index the shared head
instead of copying it. `GQA_SDPA` is transformers' sdpa attention with that one change, registered
under its own name; one-row passes and everything else it does not cover (position bias, paged
caches, softcapping, attention weights asked for) run transformers' own function. The outputs equal
the `repeat_kv` route's bitwise (the kernel reads the same numbers in the same order; tested on a
tiny model, measured on SmolLM2 eager and compiled), so speculative and plain decoding stay as they
were.

`install(model)` switches a model to it on a CPU where the model is an sdpa GQA model (otherwise it
does nothing); `uninstall(model)` puts transformers' `sdpa` back. `kernels.stock_kernels` runs a block
with both the linear layers and attention as transformers has them. Only targets use it: a drafter
body copied from a target's config (training/block.py) is given transformers' sdpa back.
"""

from __future__ import annotations

import torch

GQA_SDPA = "diffspec_gqa_sdpa"
_registered = False


def _gqa_sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                        **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    q_length = query.shape[2]
    plain = (groups == 1 or q_length == 1 or kwargs.get("position_bias") is not None
             or kwargs.get("cache") is not None or kwargs.get("softcap") is not None
             or kwargs.get("output_attentions", False))
    if plain:  # one-row steps and anything this does not cover run transformers' own route
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, **kwargs)
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    is_causal = q_length > 1 and attention_mask is None and is_causal
    if is_causal and key.shape[2] > q_length:  # as transformers does: a prefill on an empty static cache
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           dropout_p=dropout, scale=scaling, is_causal=is_causal,
                                                           enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GQA_SDPA, _gqa_sdpa_attention)
    AttentionMaskInterface.register(GQA_SDPA, sdpa_mask)  # the masks sdpa gets
    _registered = True


def applies(model: torch.nn.Module) -> bool:
    """An sdpa model on a CPU whose attention shares key/value heads."""
    text = model.config.get_text_config(decoder=True)
    try:
        heads, kv_heads = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    except Exception:  # e.g. configs with per-layer head counts raise on the global name: not for us
        return False
    if not isinstance(heads, int) or not isinstance(kv_heads, int):
        return False
    return (next(model.parameters()).device.type == "cpu" and model.config._attn_implementation == "sdpa"
            and 0 < kv_heads < heads)


def install(model: torch.nn.Module) -> bool:
    """Run the model's attention as GQA_SDPA where `applies`; returns whether it does."""
    if not applies(model):
        return model.config._attn_implementation == GQA_SDPA
    _register()
    model.config._attn_implementation = GQA_SDPA  # transformers' setter sets it on the sub-configs too
    return True


def uninstall(model: torch.nn.Module) -> bool:
    """Put transformers' sdpa back; returns whether GQA_SDPA was installed."""
    if model.config._attn_implementation != GQA_SDPA:
        return False
    model.config._attn_implementation = "sdpa"
    return True
