"""One drafter folder format for everything diffspec trains or converts.

A folder holds `config.json` and `model.safetensors`. config.json carries a `diffspec` object:

    {"format_version": 1, "kind": "block-diffusion" | "masked-diffusion" | "conditioned",
     "mask_token_id": ..., "block_size": ..., "sub_block_size": ..., "unmask_threshold": ...,
     "logit_shift": ..., "steps": ..., "target": "<model it was trained for>",
     "tokenizer_fingerprint": "<hash of the vocabulary>", "target_vocab_size": ..., "training": {...}}

next to the model's own fields: a transformers config (Qwen2/Llama body) for the diffusion kinds,
the DFlash layout (Qwen3 fields, `architectures: ["DFlashDraftModel"]`, `num_target_layers`,
`dflash_config`) for the conditioned kind, whose file then holds only the drafter's own weights
(the target's embeddings and LM head are shared, never stored). A conditioned drafter with a
reduced draft vocabulary is not a DFlash checkpoint (dflash_layout.py says why; dflash_format.py what to do).

Published checkpoints without the `diffspec` object load through presets: `fast-dllm-v2:PATH`
and `dream:PATH` (a Qwen2 body), and DFlash folders are recognised by their `architectures`.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from .dflash_layout import check_supported, dflash_config_dict
from .drafters.block_diffusion import BlockDiffusionConfig, BlockDiffusionDrafter
from .drafters.conditioned import HINT_RULE, ConditionedConfig, ConditionedDrafter, ConditionedDraftModel
from .drafters.masked_diffusion import MaskedDiffusionConfig, MaskedDiffusionDrafter
from .errors import DiffspecError

FORMAT_VERSION = 1
KINDS = ("block-diffusion", "masked-diffusion", "conditioned")
DRAFT_IDS_FILE = "draft_token_ids.safetensors"  # a block-diffusion drafter's reduced draft vocabulary

# Published layouts: (drafter kind, settings) for checkpoints that carry no `diffspec` object.
PRESETS = {
    "fast-dllm-v2": ("block-diffusion", dict(mask_token_id=151665, block_size=32, sub_block_size=8,
                                             unmask_threshold=0.05, logit_shift=True)),
    "dream": ("masked-diffusion", dict(mask_token_id=151666, steps=4, logit_shift=True)),
}


def _kind_of(drafter) -> str:
    if isinstance(drafter, BlockDiffusionDrafter):
        return "block-diffusion"
    if isinstance(drafter, MaskedDiffusionDrafter):
        return "masked-diffusion"
    if isinstance(drafter, ConditionedDrafter):
        return "conditioned"
    raise DiffspecError(f"drafter '{drafter.name}' has no checkpoint format")


def save_drafter(drafter, path, target_name: Optional[str] = None, target_vocab_size: Optional[int] = None,
                 training: Optional[dict] = None, dtype: torch.dtype = torch.float16) -> Path:
    """Write `drafter` as a diffspec drafter folder (weights stored in `dtype`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kind = _kind_of(drafter)
    meta = {"format_version": FORMAT_VERSION, "kind": kind, "target": target_name,
            "tokenizer_fingerprint": drafter.tokenizer_fingerprint,
            "target_vocab_size": target_vocab_size or drafter.vocab_size, "training": training or {}}
    if kind == "conditioned":
        cfg = drafter.cfg
        meta.update(mask_token_id=cfg.mask_token_id, block_size=cfg.block_size, logit_shift=False,
                    draft_vocab=cfg.draft_vocab, lookup_hints=cfg.lookup_hints)
        if cfg.lookup_hints:
            meta["lookup_hint_rule"] = HINT_RULE
        config = dflash_config_dict(cfg, dtype)
        save_file(_stored(drafter.model.state_dict(), dtype), str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        drafter.model.save_pretrained(path, state_dict=_stored(drafter.model.state_dict(), dtype))
        config = json.loads((path / "config.json").read_text())
        meta.update(asdict(drafter.config))
        ids = getattr(drafter, "draft_token_ids", None)
        meta["draft_vocab"] = 0 if ids is None else int(ids.numel())
        if ids is not None:  # the head stays whole in the weights; these are the rows it drafts from
            save_file({"draft_token_ids": ids.detach().cpu().contiguous()}, str(path / DRAFT_IDS_FILE))
    config["diffspec"] = meta
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _stored(state: dict, dtype: torch.dtype) -> dict:
    """Floating tensors in the storage dtype; integer tensors (token ids) untouched: fp16 cannot
    hold integers above 2048 exactly."""
    return {k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).cpu().contiguous() for k, v in state.items()}


def shipped_drafter_path(target_name: Optional[str], kind: str) -> Optional[Path]:
    """Trained weights that ship inside the package for (target, kind), if any."""
    if not target_name:
        return None
    folder = Path(__file__).parent / "weights" / target_name / kind
    return folder if (folder / "config.json").is_file() else None


def _read_config(path: Path) -> dict:
    if not path.is_dir():
        raise DiffspecError(f"drafter folder not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise DiffspecError(f"drafter folder {path} has no config.json")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise DiffspecError(f"drafter config {cfg_file} is not valid JSON: {e}") from None


def _load_hf_body(path: Path, dtype: torch.dtype, device: str, qwen2: bool = False):
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

    from .models import _no_progress_bars

    with _no_progress_bars():
        if qwen2:  # published dLLM folders declare custom classes (remote code); their body is Qwen2
            config = Qwen2Config.from_pretrained(path)
            return Qwen2ForCausalLM.from_pretrained(path, config=config, dtype=dtype).to(device).eval()
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()


def _folder_fingerprint(path: Path) -> Optional[str]:
    if not any((path / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    from .target import tokenizer_fingerprint

    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(path))


def load_drafter(path, dtype: torch.dtype = torch.float32, device: str = "cpu", preset: Optional[str] = None):
    """Load any drafter folder: a diffspec folder, a preset layout, or a DFlash checkpoint."""
    path = Path(path).expanduser()
    if preset is not None:
        if preset not in PRESETS:
            raise DiffspecError(f"unknown preset '{preset}' (choose from: {', '.join(PRESETS)})")
        kind, settings = PRESETS[preset]
        local = path.is_dir()
        if not local and (str(path).startswith((".", "/", "~")) or path.exists()):
            raise DiffspecError(f"drafter folder not found: {path}")
        if local:
            _read_config(path)
        model = _load_hf_body(path if local else str(path), dtype, device, qwen2=True)
        fp = _folder_fingerprint(path) if local else None
        if kind == "block-diffusion":
            return BlockDiffusionDrafter(model, BlockDiffusionConfig(**settings), fp, name=f"{preset}:{path}")
        return MaskedDiffusionDrafter(model, MaskedDiffusionConfig(**settings), fp, name=f"{preset}:{path}")

    config = _read_config(path)
    meta = config.get("diffspec")
    if meta is None:
        if any("DFlash" in a for a in config.get("architectures") or []):  # a published DFlash drafter
            meta = {"kind": "conditioned", "tokenizer_fingerprint": None}
        else:
            raise DiffspecError(f"{path} is not a diffspec drafter folder (config.json has no 'diffspec' object); "
                                f"for a published checkpoint name its layout: "
                                + ", ".join(f"{p}:{path}" for p in PRESETS))
    kind = meta.get("kind")
    if kind not in KINDS:
        raise DiffspecError(f"drafter folder {path}: unknown kind {kind!r} (known: {', '.join(KINDS)})")
    if meta.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
        raise DiffspecError(f"drafter folder {path} has format version {meta['format_version']}; this diffspec "
                            f"reads up to {FORMAT_VERSION}: upgrade diffspec")
    fp = meta.get("tokenizer_fingerprint")
    name = str(path)
    if kind == "conditioned":
        check_supported(config, path)
        return ConditionedDrafter(load_conditioned_model(path, config, dtype, device), fp, name=name)
    # the settings the drafter was trained with, checked before its weights load: a missing block size taken from a
    # default drafts blocks of another length than it learned (lossless, but accepted far less, and nothing says why)
    required = ("mask_token_id", "block_size") if kind == "block-diffusion" else ("mask_token_id",)
    missing = [k for k in required if k not in meta]
    if missing:
        raise DiffspecError(f"drafter folder {path}: config.json's 'diffspec' object lacks {', '.join(missing)} "
                            f"(the {kind} drafter's settings it was trained with)")
    if kind == "block-diffusion":
        fields = {k: meta[k] for k in ("mask_token_id", "block_size", "sub_block_size", "unmask_threshold",
                                       "logit_shift") if k in meta}
        settings = _settings(BlockDiffusionConfig, fields, path)
        draft_ids = _draft_token_ids(path, meta)
        return BlockDiffusionDrafter(_load_hf_body(path, dtype, device), settings, fp, name=name,
                                     draft_token_ids=draft_ids)
    fields = {k: meta[k] for k in ("mask_token_id", "steps", "logit_shift", "context_window") if k in meta}
    settings = _settings(MaskedDiffusionConfig, fields, path)
    return MaskedDiffusionDrafter(_load_hf_body(path, dtype, device), settings, fp, name=name)


def _settings(config_class, fields: dict, path: Path):
    try:
        return config_class(**fields)
    except (TypeError, ValueError) as e:
        raise DiffspecError(f"drafter folder {path}: config.json's 'diffspec' settings are not valid: {e}") from None


def _draft_token_ids(path: Path, meta: dict) -> Optional[torch.Tensor]:
    """A block-diffusion folder's reduced draft vocabulary (None: the whole head drafts)."""
    size = int(meta.get("draft_vocab", 0) or 0)
    if not size:
        return None
    file = path / DRAFT_IDS_FILE
    if not file.is_file():
        raise DiffspecError(f"drafter folder {path} declares a draft vocabulary of {size} but has no {DRAFT_IDS_FILE}")
    ids = load_file(str(file)).get("draft_token_ids")
    if ids is None or ids.dim() != 1 or ids.numel() != size or ids.is_floating_point():
        raise DiffspecError(f"{file} does not hold the {size} draft token ids its config declares")
    return ids.long()


def _flag(value, name: str, path: Path) -> bool:
    if not isinstance(value, bool):
        raise DiffspecError(f"drafter folder {path}: config.json's 'diffspec' setting {name} must be true or false, "
                            f"got {value!r}")
    return value


def load_conditioned_model(path: Path, config: dict, dtype: torch.dtype, device: str) -> ConditionedDraftModel:
    dcfg, ours = config.get("dflash_config", {}), config.get("diffspec") or {}
    try:
        cfg = ConditionedConfig(
            hidden_size=config["hidden_size"], num_attention_heads=config["num_attention_heads"],
            num_key_value_heads=config.get("num_key_value_heads", config["num_attention_heads"]),
            head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
            intermediate_size=config["intermediate_size"], num_target_layers=config["num_target_layers"],
            target_layer_ids=tuple(dcfg.get("target_layer_ids", config.get("target_layer_ids", ()))),
            vocab_size=config["vocab_size"], mask_token_id=dcfg.get("mask_token_id", config.get("mask_token_id")),
            num_hidden_layers=config["num_hidden_layers"], block_size=dcfg["block_size"] if "block_size" in dcfg else config["block_size"],
            rms_norm_eps=config.get("rms_norm_eps", 1e-6),
            rope_theta=float((config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10000.0))),
            max_position_embeddings=config.get("max_position_embeddings", 8192),
            draft_vocab=int(ours.get("draft_vocab", 0)),
            lookup_hints=_flag(ours.get("lookup_hints", False), "lookup_hints", path))
    except KeyError as e:
        raise DiffspecError(f"conditioned drafter config in {path} lacks the field {e}") from None
    rule = ours.get("lookup_hint_rule")
    if cfg.lookup_hints and rule != HINT_RULE:
        raise DiffspecError(f"drafter folder {path} was trained with lookup hints from {rule!r}; this diffspec makes "
                            f"them by {HINT_RULE!r}: it would draft from inputs it was not trained on")
    weights = path / "model.safetensors"
    if not weights.is_file():
        raise DiffspecError(f"drafter folder {path} has no model.safetensors")
    model = ConditionedDraftModel(cfg).to(dtype)  # in the load dtype first: load_state_dict casts into it
    state = load_file(str(weights))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise DiffspecError(f"drafter weights in {weights} do not fit the config: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    return model.to(device=device, dtype=dtype).eval()


def random_drafter(kind: str, target, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A randomly initialised drafter shaped for `target` (lossless, accepts little). Warns."""
    from transformers import LlamaConfig, LlamaForCausalLM

    warnings.warn(f"no trained '{kind}' drafter for target '{target.name}': using random weights "
                  f"(output stays identical to the target's; acceptance will be low)", stacklevel=3)
    v = target.vocab_size
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        if kind == "conditioned":
            cfg = ConditionedConfig.for_target(target.config, mask_token_id=0)
            model = ConditionedDraftModel(cfg).to(device=target.device, dtype=dtype)
            return ConditionedDrafter(model, target.tokenizer_fingerprint, name=f"{kind} (random)")
        body = LlamaConfig(vocab_size=v + 1, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=target.max_context,
                           tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=None)
        model = LlamaForCausalLM(body).to(device=target.device, dtype=dtype).eval()
    if kind == "block-diffusion":
        return BlockDiffusionDrafter(model, BlockDiffusionConfig(mask_token_id=v), target.tokenizer_fingerprint,
                                     name=f"{kind} (random)")
    if kind == "masked-diffusion":
        return MaskedDiffusionDrafter(model, MaskedDiffusionConfig(mask_token_id=v), target.tokenizer_fingerprint,
                                      name=f"{kind} (random)")
    raise DiffspecError(f"unknown drafter kind '{kind}'")
