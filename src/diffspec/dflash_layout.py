"""The DFlash checkpoint layout: what a conditioned drafter folder's config.json says, and which DFlash
folders diffspec can run. z-lab's reference package (`dflash`), vLLM and SGLang read this layout.

A DFlash drafter folder is `config.json` - Qwen3 fields, `architectures: ["DFlashDraftModel"]`,
`num_target_layers`, `dflash_config: {block_size, mask_token_id, target_layer_ids}` - and
`model.safetensors` with the drafter's own weights only (layers.N.self_attn.{q,k,v,o}_proj,
q_norm, k_norm, mlp.{gate,up,down}_proj, input/post_attention_layernorm, fc, hidden_norm, norm);
the target's embeddings and LM head are shared, never stored. Engines ignore keys they do not
know, so diffspec's own metadata rides along in a `diffspec` object.

diffspec's conditioned drafter is the same network (drafters/conditioned.py), with one optional
difference: a reduced draft vocabulary (`draft_vocab` > 0 scores only the LM-head rows listed in
its `draft_token_ids` buffer). DFlash scores the whole head, so the same weights would propose
other tokens there. Such a drafter is therefore not a DFlash checkpoint: its folder says
`architectures: ["DiffspecConditionedDraftModel"]`, and `export_dflash` refuses it unless asked
to drop the restriction (`full_vocab=True`: the same weights drafting over the whole vocabulary,
a different drafter - still lossless anywhere, its acceptance is its own). A drafter with lookup hints
(`lookup_hints`: prompt lookup's copy in its block's slots) is diffspec's own likewise, and not exported.

Here: `dflash_config_dict` (the config of a folder diffspec writes), `unsupported_features` /
`check_supported` (a DFlash folder using what diffspec does not implement - DFlash 2, sliding-window
or causal draft layers, logit scaling, other RoPE types - is refused by name instead of drafting
something else silently) and `is_dflash_folder`. Writing and converting folders is checkpoint.py's
and dflash_format.py's; this module depends on neither.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .drafters.conditioned import ConditionedConfig
from .errors import DiffspecError

DFLASH_ARCHITECTURE = "DFlashDraftModel"
REDUCED_VOCAB_ARCHITECTURE = "DiffspecConditionedDraftModel"  # diffspec-only: a reduced draft vocabulary, lookup hints


def dflash_config_dict(cfg: ConditionedConfig, dtype: torch.dtype) -> dict:
    """config.json of a conditioned drafter (a Qwen3 config plus DFlash's fields). A reduced draft
    vocabulary is diffspec's own: such a folder does not claim DFlash's architecture."""
    return {
        "architectures": [REDUCED_VOCAB_ARCHITECTURE if cfg.draft_vocab or cfg.lookup_hints else DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads, "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim, "intermediate_size": cfg.intermediate_size, "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps, "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings, "vocab_size": cfg.vocab_size,
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
        "dtype": str(dtype).replace("torch.", ""), "num_target_layers": cfg.num_target_layers,
        "block_size": cfg.block_size,  # also top level: newer z-lab code and SGLang's fallback read it there
        "dflash_config": {"block_size": cfg.block_size, "mask_token_id": cfg.mask_token_id,
                          "target_layer_ids": list(cfg.target_layer_ids)},
    }


def _value(config: dict, name: str, default=None):
    """A DFlash setting: `dflash_config` first, then the top level (the reference's own rule)."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


def unsupported_features(config: dict) -> list:
    """What a DFlash config asks for that diffspec's conditioned drafter does not compute."""
    found = []
    archs = config.get("architectures") or []
    if any(a != DFLASH_ARCHITECTURE and "DFlash" in a for a in archs):
        found.append(f"architecture {archs} (DFlash 2: grouped convolutions and a candidate selector)")
    if "sliding_attention" in (config.get("layer_types") or []) or config.get("use_sliding_window") \
            or _value(config, "use_swa"):
        found.append("sliding-window attention layers")
    if config.get("is_causal") or _value(config, "causal"):
        found.append("causal draft layers (DFlash's are bidirectional)")
    if config.get("attention_bias"):
        found.append("attention biases")
    if config.get("hidden_act", "silu") != "silu":
        found.append(f"activation {config['hidden_act']!r}")
    for name in ("input_embedding_scale", "output_multiplier"):
        if float(_value(config, name, 1.0)) != 1.0:
            found.append(f"{name} {_value(config, name)}")
    if float(_value(config, "final_logit_softcapping") or 0.0) > 0:
        found.append("final_logit_softcapping")
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        found.append(f"RoPE type {rope.get('rope_type', rope.get('type'))!r} (diffspec implements the default)")
    if _value(config, "mask_token_id") is None:
        found.append("no mask_token_id")
    return found


def check_supported(config: dict, where) -> None:
    found = unsupported_features(config)
    if found:
        raise DiffspecError(f"DFlash drafter {where} uses what diffspec does not implement: {'; '.join(found)}")


def is_dflash_folder(path) -> bool:
    """A folder in the DFlash layout that drafts exactly as the reference would read it."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return False
    config = json.loads(cfg_file.read_text())
    ours = config.get("diffspec") or {}  # diffspec's own settings that DFlash has no place for
    return config.get("architectures") == [DFLASH_ARCHITECTURE] and not unsupported_features(config) \
        and not (ours.get("draft_vocab") or ours.get("lookup_hints"))
