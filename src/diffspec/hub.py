"""Drafters named by a Hugging Face Hub id (owner/name): recognised, and fetched (config.json and
safetensors only, cached by huggingface_hub). Users with the internet get published drafters
this way; offline, a hub id is one clear error line."""

from __future__ import annotations

import re
from pathlib import Path

from .errors import DiffspecError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


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
