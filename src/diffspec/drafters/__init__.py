"""The drafter classes, one file per kind (the two-method contract is in base.py).

Choosing one by its name (`make_drafter("prompt-lookup+conditioned", target)`) is
`diffspec.drafter_names`: it reads checkpoints, and checkpoint.py builds these classes, so the
name table lives above both and this package imports neither.
"""

from __future__ import annotations

from .autoregressive import AutoregressiveDrafter
from .base import Drafter, DrafterCapabilities, DraftBuilder
from .block_diffusion import BlockDiffusionConfig, BlockDiffusionDrafter
from .combined import CombinedDrafter
from .conditioned import ConditionedConfig, ConditionedDrafter, ConditionedDraftModel
from .masked_diffusion import MaskedDiffusionConfig, MaskedDiffusionDrafter
from .prompt_lookup import PromptLookupDrafter

__all__ = ["Drafter", "DrafterCapabilities", "DraftBuilder", "PromptLookupDrafter", "AutoregressiveDrafter",
           "BlockDiffusionDrafter", "BlockDiffusionConfig", "MaskedDiffusionDrafter", "MaskedDiffusionConfig",
           "ConditionedDrafter", "ConditionedDraftModel", "ConditionedConfig", "CombinedDrafter"]
