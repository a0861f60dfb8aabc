"""Loading a target (any mlx-lm model) and a DFlash drafter folder, from local paths or hub ids."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .assets import default_target
from .drafter import DFlashDraftModel
from .formats.card import read_acceptance
from .formats.config import DraftConfig
from .formats.gguf import load_gguf
from .formats.quantize import DraftQuant, quantize_drafter
from .formats.vocab import COUNTS_FILE, check_ids, most_frequent, read_counts, read_draft_vocab
from .formats.weights import read_weights
from .target import Target

logger = logging.getLogger(__name__)


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


def drafter_dtype(stored: mx.Dtype, dtype: str | None) -> mx.Dtype:
    """The drafter's compute dtype: bfloat16 or float32, never float16 (DFlash 2 drafters give NaN
    logits in float16). Default: float32 on CPUs (fast with OpenBLAS), the stored dtype on Metal."""
    if dtype == "float16":
        raise ValueError(
            "float16 drafters are refused: DFlash drafters overflow to NaN in float16; use bfloat16 or float32"
        )
    if dtype is not None:
        if dtype not in ("bfloat16", "float32"):
            raise ValueError(f"drafter dtype must be bfloat16 or float32, got {dtype!r}")
        return getattr(mx, dtype)
    if not mx.metal.is_available():
        return mx.float32
    if stored == mx.float16:
        logger.warning("this drafter is stored in float16; running it in bfloat16 (float16 gives NaN logits)")
        return mx.bfloat16
    return stored if stored in (mx.bfloat16, mx.float32) else mx.bfloat16


def load_drafter(
    path_or_repo: str,
    dtype: str | None = None,
    quant: DraftQuant | None = None,
    draft_vocab: int | None = None,
    vocab_counts: str | Path | None = None,
    kernels: str = "auto",
) -> DFlashDraftModel:
    """A drafter folder: a published Hugging Face layout (DFlash v1, DFlash 2, Muse-style; config.json +
    safetensors, no embedding or LM head: the target lends them, see `DFlashDraftModel.bind`) or an MLX
    folder written by `dflash2 convert` (possibly quantized). `quant` quantizes it at load (oMLX's draft
    quantization); see `drafter_dtype` for `dtype`.

    The drafter proposes only tokens of its draft vocabulary (`vocab.py`): the one stored in the folder, or
    with `draft_vocab` N, the N most frequent tokens of `vocab_counts` (a `dflash2 data` folder or a .npy of
    counts; default: the folder's own `token_counts.npy`). `kernels`: see `DFlashDraftModel.use_kernels`."""
    path = resolve_path(path_or_repo, allow_patterns=["*.json", "*.safetensors", "*.npy"])
    config = DraftConfig.from_path(path)
    raw = json.loads((path / "config.json").read_text())
    weights = read_weights(path)
    model = DFlashDraftModel.from_config(config).use_kernels(kernels)
    stored_quant = raw.get("mlx", {}).get("quantization")
    if stored_quant:
        stored_quant = DraftQuant.parse(stored_quant)
        nn.quantize(
            model,
            group_size=stored_quant.group_size,
            bits=stored_quant.bits,
            class_predicate=lambda p, _: f"{p}.scales" in weights,
        )
    expected = dict(tree_flatten(model.parameters()))
    missing, unexpected = sorted(expected.keys() - weights.keys()), sorted(weights.keys() - expected.keys())
    if missing or unexpected:
        raise ValueError(
            f"drafter weights in {path} do not match its config: "
            f"missing {missing[:8]}{' ...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}"
        )
    wrong = [
        f"{k} {tuple(v.shape)} (config: {tuple(expected[k].shape)})"
        for k, v in weights.items()
        if v.shape != expected[k].shape
    ]
    if wrong:
        raise ValueError(f"drafter tensors in {path} do not match its config's shapes: {', '.join(wrong[:4])}")
    model.load_weights(list(weights.items()))
    if stored_quant:
        if quant is not None:
            raise ValueError(f"{path} is already quantized ({stored_quant}); drop the draft quantization")
        model.set_dtype(stored_quant.compute_dtype)
    else:
        model.set_dtype(drafter_dtype(weights["norm.weight"].dtype, dtype))
        if quant is not None:
            quantize_drafter(model, quant)
    mx.eval(model.parameters())
    model.eval()
    model.draft_vocab = read_draft_vocab(path)
    model.acceptance_prior = read_acceptance(path)
    if draft_vocab is not None:
        source = vocab_counts if vocab_counts is not None else path / COUNTS_FILE
        if vocab_counts is None and not Path(source).is_file():
            raise FileNotFoundError(
                f"--draft-vocab {draft_vocab} needs a frequency table: {path} has no {COUNTS_FILE}; pass "
                "--draft-vocab-counts (a `dflash2 data` folder of this target, or a .npy of counts per token id)"
            )
        counts = read_counts(source, config.vocab_size)
        model.draft_vocab = most_frequent(counts, draft_vocab, config.vocab_size or counts.size)
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
    vocab = None
    if drafter.draft_vocab is not None:
        ids = mx.array(check_ids(drafter.draft_vocab, "the drafter's draft vocabulary", target.vocab_size))
        vocab = (ids, target.head_rows(ids).astype(drafter.norm.weight.dtype))
    drafter.bind(
        target.embed_tokens, target.lm_head, target.embed_scale, target.logit_multiplier, target.logit_softcap, vocab
    )
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


def load(
    model: str | None = None,
    draft_model: str | None = None,
    dtype: str | None = None,
    draft_dtype: str | None = None,
    draft_quant: DraftQuant | str | None = None,
    draft_vocab: int | None = None,
    draft_vocab_counts: str | None = None,
    kernels: str = "auto",
    **kwargs,
):
    """Load a target (see `load_target`) and, optionally, a DFlash drafter bound to it (see
    `load_drafter`; `draft_quant` may be a spec string like "w4a16:gs64"; `draft_vocab` N keeps the N most
    frequent tokens of `draft_vocab_counts` as the drafter's draft vocabulary; `kernels`: 'auto', 'metal' or
    'mlx', see `DFlashDraftModel.use_kernels`).

    Returns (model, tokenizer, drafter) with drafter None when `draft_model` is None.
    """
    target_model, tokenizer = load_target(model, dtype, **kwargs)
    drafter = None
    if draft_model is not None:
        if isinstance(draft_quant, str):
            draft_quant = DraftQuant.parse(draft_quant)
        drafter = load_drafter(draft_model, draft_dtype, draft_quant, draft_vocab, draft_vocab_counts, kernels)
        bind_drafter(drafter, target_model)
    return target_model, tokenizer, drafter
