"""The DFlash checkpoint layout: z-lab's reference package (`dflash`), vLLM and SGLang read it.

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
a different drafter - still lossless anywhere, its acceptance is its own).

Here:
- `export_dflash(drafter, out, ...)` writes a conditioned drafter as a DFlash folder;
- `check_supported(config, where)` refuses DFlash folders that use what diffspec does not
  implement (DFlash 2, sliding-window or causal draft layers, logit scaling, other RoPE types),
  naming the feature, instead of drafting something else silently;
- `hub_folder(repo_id)` fetches a published drafter (config + safetensors) from the Hub;
- `reference()` imports the reference package, or says how to install it.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from .drafters.conditioned import ConditionedDrafter, ConditionedDraftModel
from .errors import DiffspecError

DFLASH_ARCHITECTURE = "DFlashDraftModel"
REDUCED_VOCAB_ARCHITECTURE = "DiffspecConditionedDraftModel"  # diffspec-only: a reduced draft vocabulary
INSTALL_HINT = "pip install --no-deps dflash==0.1.0  (or: pip install 'diffspec[dflash]')"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def reference():
    """(DFlashDraftModel, dflash_generate) from the reference package; a clear error without it."""
    try:
        from dflash.model import DFlashDraftModel, dflash_generate
    except ImportError:
        raise DiffspecError(f"the DFlash reference package is not installed: {INSTALL_HINT}") from None
    return DFlashDraftModel, dflash_generate


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
    return config.get("architectures") == [DFLASH_ARCHITECTURE] and not unsupported_features(config) \
        and not (config.get("diffspec") or {}).get("draft_vocab")


def looks_like_hub_id(spec: str) -> bool:
    return bool(_HUB_ID.match(spec)) and not Path(spec).expanduser().exists()


def hub_folder(repo_id: str) -> Path:
    """Download a drafter's config.json and safetensors from the Hugging Face Hub (cached)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, allow_patterns=["config.json", "*.safetensors"]))
    except Exception as e:  # offline, unknown repo, gated, no network: one line, not a traceback
        raise DiffspecError(f"drafter '{repo_id}' is not a local folder and could not be fetched from the "
                            f"Hugging Face Hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def without_draft_vocab(drafter: ConditionedDrafter) -> ConditionedDrafter:
    """The same weights scoring the target's whole LM head (no reduced draft vocabulary)."""
    cfg = replace(drafter.cfg, draft_vocab=0)
    p = next(drafter.model.parameters())
    model = ConditionedDraftModel(cfg).to(device=p.device, dtype=p.dtype)
    model.load_state_dict({k: v for k, v in drafter.model.state_dict().items() if k != "draft_token_ids"})
    return ConditionedDrafter(model.eval(), drafter.tokenizer_fingerprint, name=f"{drafter.name} (full vocabulary)")


def export_dflash(drafter, out, target=None, dtype: torch.dtype = torch.float16, full_vocab: bool = False,
                  meta: Optional[dict] = None) -> Path:
    """Write a conditioned drafter as a DFlash folder loadable by the reference's
    `DFlashDraftModel.from_pretrained`, vLLM (`method: "dflash"`) and SGLang (`DFLASH`).

    `target` (optional) names the mask token as text too (`dflash_config.mask_token`, what older
    SGLang releases read). `meta`: diffspec metadata of the source (target, training record),
    kept under `diffspec`. Refuses a reduced draft vocabulary unless `full_vocab`."""
    from .checkpoint import _kind_of, save_drafter

    if not isinstance(drafter, ConditionedDrafter):
        raise DiffspecError(f"--format dflash holds target-conditioned drafters; '{drafter.describe()}' is a "
                            f"{_kind_of(drafter)} drafter, which the DFlash layout has no place for")
    meta = dict(meta or {})
    if drafter.cfg.draft_vocab:
        if not full_vocab:
            raise DiffspecError(
                f"drafter '{drafter.name}' drafts from a reduced vocabulary of {drafter.cfg.draft_vocab} tokens "
                f"(its draft_token_ids); a DFlash drafter scores the target's whole LM head, so DFlash engines would "
                f"draft other tokens with these weights. Train a full-vocabulary drafter (diffspec train-drafter "
                f"--draft-vocab 0) for an exact export, or pass --full-vocab to export these weights drafting over "
                f"the whole vocabulary (still lossless; acceptance not what diffspec measured)")
        meta["draft_vocab_dropped"] = drafter.cfg.draft_vocab
        drafter = without_draft_vocab(drafter)
    vocab = target.vocab_size if target is not None else None
    path = save_drafter(drafter, out, target_name=meta.get("target") or (target.name if target is not None else None),
                        target_vocab_size=vocab, training=meta.get("training"), dtype=dtype)
    config = json.loads((path / "config.json").read_text())
    mask_text = target.tokenizer.convert_ids_to_tokens(drafter.cfg.mask_token_id) \
        if target is not None and target.tokenizer is not None else None
    if mask_text:
        config["dflash_config"]["mask_token"] = mask_text
    config["diffspec"].update({k: v for k, v in meta.items() if k not in config["diffspec"] and k != "default"})
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def reference_folder(spec: str, target, scratch) -> Path:
    """A folder the reference package loads with exactly the weights diffspec runs for `spec`:
    a DFlash folder as it is; anything else (a name, a diffspec folder, a hub id) is loaded by
    diffspec and exported in float32 to `scratch` (refused as export_dflash refuses)."""
    from .drafters import make_drafter

    path = Path(spec).expanduser()
    if path.is_dir() and is_dflash_folder(path):
        return path
    if looks_like_hub_id(spec):
        path = hub_folder(spec)
        if is_dflash_folder(path):
            return path
        spec = str(path)
    drafter = make_drafter(spec, target, dtype=torch.float32, device=str(target.device))
    return export_dflash(drafter, Path(scratch) / "drafter", target, dtype=torch.float32)
