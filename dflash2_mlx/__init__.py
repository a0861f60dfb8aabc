"""DFlash / DFlash 2 block-diffusion speculative decoding for mlx-lm models."""

from .drafter import DFlashDraftModel
from .formats.config import DraftConfig
from .generate import CycleResponse, GenerationResponse, GenerationResult, generate, stream_cycles, stream_generate
from .loading import load, load_drafter
from .prompt_cache import PromptCache, PromptCaches
from .sampling import SamplingParams, make_sampler
from .target import Target

__version__ = "0.1.0"

__all__ = [
    "CycleResponse",
    "DFlashDraftModel",
    "DraftConfig",
    "GenerationResponse",
    "GenerationResult",
    "PromptCache",
    "PromptCaches",
    "SamplingParams",
    "Target",
    "generate",
    "load",
    "load_drafter",
    "make_sampler",
    "stream_cycles",
    "stream_generate",
]
