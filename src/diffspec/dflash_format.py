"""DFlash folders in and out: export a conditioned drafter for z-lab's reference package (`dflash`),
vLLM and SGLang; fetch a published one from the Hub; hand the reference package the exact weights
diffspec runs. The layout itself (config fields, what diffspec can run, why a drafter with a reduced
draft vocabulary is not a DFlash checkpoint) is dflash_layout.py's; `export_dflash` refuses such a
drafter unless asked to drop the restriction (`full_vocab=True`).

Here:
- `export_dflash(drafter, out, ...)` writes a conditioned drafter as a DFlash folder;
- `reference()` imports the reference package, or says how to install it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from .checkpoint import _kind_of, save_drafter
from .dflash_layout import is_dflash_folder
from .drafter_names import make_drafter
from .hub import hub_folder, looks_like_hub_id
from .drafters.conditioned import ConditionedDrafter, ConditionedDraftModel
from .errors import DiffspecError

INSTALL_HINT = "pip install --no-deps dflash==0.1.0  (or: pip install 'diffspec[dflash]')"


def reference():
    """(DFlashDraftModel, dflash_generate) from the reference package; a clear error without it."""
    try:
        from dflash.model import DFlashDraftModel, dflash_generate
    except ImportError:
        raise DiffspecError(f"the DFlash reference package is not installed: {INSTALL_HINT}") from None
    return DFlashDraftModel, dflash_generate


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
    if not isinstance(drafter, ConditionedDrafter):
        raise DiffspecError(f"--format dflash holds target-conditioned drafters; '{drafter.describe()}' is a "
                            f"{_kind_of(drafter)} drafter, which the DFlash layout has no place for")
    meta = dict(meta or {})
    if drafter.cfg.lookup_hints:
        raise DiffspecError(
            f"drafter '{drafter.name}' reads prompt lookup's copy in its block (lookup hints, diffspec's own); DFlash "
            f"engines fill the block with masks only, so these weights would draft there from inputs they were not "
            f"trained on. Serve it with diffspec, or train a drafter without --lookup-hints for DFlash engines")
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
