"""diffspec: lossless speculative decoding for autoregressive LMs, drafted by diffusion LMs."""

from .api import generate, load_engine
from .drafters import AutoregressiveDrafter, Drafter, DrafterCapabilities, PromptLookupDrafter
from .drafter_names import make_drafter
from .engine import GenerationStream, SpeculativeEngine
from .errors import DiffspecError
from .policies import FailFastPolicy, FixedPolicy, LengthPolicy, make_policy
from .target import Target
from .types import Draft, GenerationResult, RoundStats, SamplingParams

__version__ = "0.1.0"

__all__ = ["generate", "load_engine", "SpeculativeEngine", "GenerationStream", "Target", "Drafter",
           "DrafterCapabilities", "PromptLookupDrafter", "AutoregressiveDrafter", "make_drafter", "LengthPolicy",
           "FixedPolicy", "FailFastPolicy", "make_policy", "SamplingParams", "Draft", "RoundStats",
           "GenerationResult", "DiffspecError"]
