"""Runtime settings as oMLX names them, read from its per-model `model_settings.json`, so a user's oMLX
DFlash setup runs here unchanged: `{"version": ..., "models": {"<model id>": {"dflash_enabled": ..., ...}}}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .formats.quantize import DraftQuant
from .lookup import COPYSPEC_MODES

# oMLX keys this package does not act on; named in `ignored` so nothing is dropped silently.
_NOT_SUPPORTED = ("dflash_draft_window_size", "dflash_draft_sink_size")


@dataclass
class RuntimeSettings:
    verify_mode: str = "adaptive"
    draft_model: str | None = None
    draft_quant: DraftQuant | None = None
    block_size: int | None = None  # None: the drafter's default (DFlash 2: min(5, trained))
    max_context: int | None = None  # prompts at or above it run plain decoding
    copyspec_mode: str | None = None  # copy drafts (`--copyspec-mode`); None: the default (auto)
    notes: list[str] = field(default_factory=list)  # what was read differently from oMLX, and why


def _int_or_none(value) -> int | None:
    return None if value in (None, "") else int(value)


def from_omlx(path: str | Path, model_id: str) -> RuntimeSettings:
    path = Path(path)
    try:
        models = json.loads(path.read_text())["models"]
    except FileNotFoundError:
        raise FileNotFoundError(f"oMLX settings file {path} does not exist") from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not an oMLX model_settings.json ({e})") from e
    if model_id not in models:
        raise ValueError(f"no entry for {model_id!r} in {path}; it has {sorted(models)}")
    entry = models[model_id]
    settings = RuntimeSettings(
        draft_model=entry.get("dflash_draft_model") or None,
        block_size=_int_or_none(entry.get("dflash_block_size")),
        max_context=_int_or_none(entry.get("dflash_max_ctx")),
    )
    mode = entry.get("dflash_verify_mode") or "adaptive"  # oMLX's default
    if not entry.get("dflash_enabled", False):
        mode = "off"
    elif mode not in ("adaptive", "dflash", "ddtree", "off"):
        raise ValueError(
            f"oMLX verify mode {mode!r} is not supported here; use 'adaptive', 'dflash', 'ddtree' or 'off'"
        )
    settings.verify_mode = mode
    copyspec = entry.get("copyspec_mode")
    if copyspec not in (None, "") and copyspec not in COPYSPEC_MODES:
        raise ValueError(f"{path}: copyspec_mode {copyspec!r} of {model_id!r} is not one of {COPYSPEC_MODES}")
    settings.copyspec_mode = copyspec or None
    if entry.get("dflash_draft_quant_enabled"):
        settings.draft_quant = DraftQuant(
            int(entry.get("dflash_draft_quant_weight_bits") or 4),
            int(entry.get("dflash_draft_quant_activation_bits") or 16),
            int(entry.get("dflash_draft_quant_group_size") or 64),
        )
    settings.notes += [f"{key} is not supported and was ignored" for key in _NOT_SUPPORTED if entry.get(key)]
    return settings
