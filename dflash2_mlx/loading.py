"""Loading a target (any mlx-lm model) and a DFlash drafter folder, from local paths or hub ids."""

from __future__ import annotations

import glob
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .config import DraftConfig
from .drafter import DFlashDraftModel
from .target import Target

# Names some engines give the same tensors.
_RENAMES = (("model.", ""), ("encoder.fc.", "fc."), ("encoder.output_norm_enc.", "hidden_norm."))


def resolve_path(path_or_repo: str, allow_patterns: list[str] | None = None) -> Path:
    """A local folder as is; otherwise a Hugging Face hub id, fetched (or found in the local hub cache)."""
    path = Path(path_or_repo).expanduser()
    if path.exists():
        return path
    if path_or_repo.startswith((".", "/", "~")) or path_or_repo.count("/") != 1:
        raise FileNotFoundError(f"{path_or_repo!r} is neither an existing path nor a hub id (owner/name)")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(path_or_repo, allow_patterns=allow_patterns))
    except Exception as e:  # network errors, missing repos, gated repos: all say the same to a user
        raise FileNotFoundError(
            f"could not fetch {path_or_repo!r} from the Hugging Face hub ({type(e).__name__}: {e}); "
            "pass a local folder instead, or check the id and your network"
        ) from e


def load_drafter(path_or_repo: str) -> DFlashDraftModel:
    """A drafter folder in the published DFlash v1 layout: config.json + *.safetensors, no embedding
    or LM head (the target lends them, see `DFlashDraftModel.bind`)."""
    path = resolve_path(path_or_repo, allow_patterns=["*.json", "*.safetensors"])
    config = DraftConfig.from_path(path)
    files = sorted(glob.glob(str(path / "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in drafter folder {path}")
    weights = {}
    for f in files:
        for name, value in mx.load(f).items():
            for old, new in _RENAMES:
                if name.startswith(old):
                    name = new + name[len(old) :]
            weights[name] = value
    model = DFlashDraftModel(config)
    expected = {k for k, _ in tree_flatten(model.parameters())}
    missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
    if missing or unexpected:
        raise ValueError(
            f"drafter weights in {path} do not match its config: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    model.eval()
    return model


def bind_drafter(drafter: DFlashDraftModel, model: nn.Module) -> Target:
    """Check that `drafter` fits `model` and lend it the target's embedding and LM head."""
    cfg = drafter.config
    target = Target(model, cfg.target_layer_ids)
    if cfg.hidden_size != target.hidden_size:
        raise ValueError(
            f"drafter hidden size {cfg.hidden_size} does not match the target's {target.hidden_size}: "
            "the drafter was trained for another target"
        )
    if cfg.vocab_size is not None and cfg.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter vocabulary ({cfg.vocab_size}) differs from the target's ({target.vocab_size}): "
            "the drafter was trained for another target"
        )
    if not 0 <= cfg.mask_token_id < target.vocab_size:
        raise ValueError(
            f"drafter mask_token_id {cfg.mask_token_id} is outside the target's embedding table "
            f"(vocabulary {target.vocab_size})"
        )
    drafter.bind(target.embed_tokens, target.lm_head, target.vocab_size, target.embed_scale)
    return target


DTYPES = ("float32", "bfloat16", "float16")


def load_target(model: str | None = None, dtype: str | None = None, tokenizer_config: dict | None = None):
    """(model, tokenizer) for a target: an mlx-lm folder, a hub id, or a GGUF file; None is the default
    target (see `assets.default_target`).

    dtype casts the float weights. For GGUF files, None keeps Q4_0/Q4_1/Q8_0 tensors quantized on Metal
    and dequantizes to float32 elsewhere (quantized matmuls are ~50x slower than float32 on CPUs).
    """
    from mlx_lm import load as mlx_lm_load
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    from .assets import default_target
    from .checkpoints.gguf import load_gguf

    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if model is None:
        model = str(default_target())
    if str(model).endswith(".gguf"):
        if dtype is None and not mx.metal.is_available():
            dtype = "float32"
        return load_gguf(resolve_path(model), dtype)
    path = resolve_path(model, allow_patterns=DEFAULT_ALLOW_PATTERNS)
    target_model, tokenizer = mlx_lm_load(str(path), tokenizer_config=tokenizer_config)
    if dtype is not None:
        target_model.set_dtype(getattr(mx, dtype))
    return target_model, tokenizer


def load(model: str | None = None, draft_model: str | None = None, dtype: str | None = None, **kwargs):
    """Load a target (see `load_target`) and, optionally, a DFlash drafter bound to it.

    Returns (model, tokenizer, drafter) with drafter None when `draft_model` is None.
    """
    target_model, tokenizer = load_target(model, dtype, **kwargs)
    drafter = None
    if draft_model is not None:
        drafter = load_drafter(draft_model)
        bind_drafter(drafter, target_model)
    return target_model, tokenizer, drafter
