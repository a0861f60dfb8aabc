"""DFlash / DFlash 2 block-diffusion speculative decoding for mlx-lm models."""

from .formats.config import DraftConfig
from .drafter import DFlashDraftModel
from .generate import GenerationResponse, GenerationResult, generate, stream_generate
from .loading import load, load_drafter
from .prompt_cache import PromptCache, PromptCaches
from .sampling import SamplingParams
from .target import Target

__version__ = "0.1.0"

__all__ = [
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
    "stream_generate",
]
