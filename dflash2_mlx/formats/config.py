"""Drafter configuration, read from the Hugging Face `config.json` of a published drafter.

Published drafters come in several config layouts; each is one row of `_LAYOUTS`, which says how to read
the DFlash fields. Everything else (the Qwen3-style decoder fields) is read the same way for all of them.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    block_size: int
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    architecture: str = "DFlashDraftModel"
    # The target's vocabulary; v1 drafters store no vocabulary-sized tensor, and some configs omit it.
    vocab_size: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 32768
    layer_types: tuple[str, ...] = ()
    sliding_window: int | None = None
    # None means "as the reference decides": causal inside the block for sliding layers only.
    is_causal: bool | None = None
    num_target_layers: int | None = None
    # None = not set by the drafter's config: the target's own logit settings apply (see DFlashDraftModel.bind).
    final_logit_softcapping: float | None = None
    output_multiplier: float | None = None
    # Times the target's own embedding scale.
    input_embedding_scale: float = 1.0
    # DFlash 2 (zero = absent): dynamic short convolution and path selector.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    # Ours: the selector's codebooks as rank-R maps of the target's embeddings instead of V x R tables.
    selector_factorized: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = ("full_attention",) * self.num_hidden_layers
        self.layer_types = tuple(self.layer_types)
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"drafter config: layer_types has {len(self.layer_types)} entries but "
                f"num_hidden_layers is {self.num_hidden_layers}; they must match"
            )
        unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise ValueError(f"drafter config: unsupported layer_types {sorted(unknown)}")
        if "sliding_attention" in self.layer_types and not self.sliding_window:
            raise ValueError("drafter config: sliding_attention layers need a positive sliding_window")
        if self.block_size < 2:
            raise ValueError(f"drafter config: block_size must be at least 2, got {self.block_size}")
        if not self.target_layer_ids:
            raise ValueError("drafter config: target_layer_ids is empty")
        if self.is_dflash2:
            if self.conv_kernel_size < 1 or self.conv_group_size < 1:
                raise ValueError("DFlash 2 drafter config: conv_kernel_size and conv_group_size must be positive")
            if self.hidden_size % self.conv_group_size:
                raise ValueError(
                    f"DFlash 2 drafter config: hidden_size {self.hidden_size} is not a multiple of "
                    f"conv_group_size {self.conv_group_size}"
                )
            if self.selector_rank < 1 or self.selector_top_k < 1:
                raise ValueError("DFlash 2 drafter config: selector_rank and selector_top_k must be positive")
            if not self.selector_factorized and self.vocab_size is None:
                raise ValueError("DFlash 2 drafter config: vocab_size is needed for the selector codebooks")

    @property
    def is_dflash2(self) -> bool:
        return self.architecture == "DFlash2DraftModel"

    def layer_is_causal(self, layer_idx: int) -> bool:
        sliding = self.layer_types[layer_idx] == "sliding_attention"
        return sliding if self.is_causal is None else self.is_causal

    def to_hf_dict(self) -> dict[str, Any]:
        """The Hugging Face layout of this architecture (the one `from_hf_dict` reads back)."""
        cfg = dict(self.extra)
        cfg.update(
            architectures=[self.architecture],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            intermediate_size=self.intermediate_size,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            layer_types=list(self.layer_types),
        )
        dflash = {
            "mask_token_id": self.mask_token_id,
            "target_layer_ids": list(self.target_layer_ids),
            "input_embedding_scale": self.input_embedding_scale,
        }
        # Unset logit settings stay unset (the target's apply), so a saved drafter binds as the loaded one.
        if self.output_multiplier is not None:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping is not None:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        if self.is_dflash2:
            dflash.update(
                block_size=self.block_size,
                conv_kernel_size=self.conv_kernel_size,
                conv_group_size=self.conv_group_size,
                selector_rank=self.selector_rank,
                selector_top_k=self.selector_top_k,
            )
            if self.selector_factorized:
                dflash["selector_factorized"] = True
        else:
            cfg["block_size"] = self.block_size
        if self.architecture == "MuseGlimmerAssistantModel":
            cfg.update(dflash)  # Muse keeps every field at the top level
            cfg["model_type"] = "muse_glimmer_assistant"
        else:
            cfg["dflash_config"] = dflash
        optional = {
            "rope_scaling": self.rope_scaling,
            "vocab_size": self.vocab_size,
            "sliding_window": self.sliding_window,
            "is_causal": None if self.architecture == "MuseGlimmerAssistantModel" else self.is_causal,
            "num_target_layers": self.num_target_layers,
        }
        cfg.update({k: v for k, v in optional.items() if v is not None})
        return cfg

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> DraftConfig:
        architecture = (cfg.get("architectures") or ["DFlashDraftModel"])[0]
        if architecture not in _LAYOUTS:
            raise ValueError(f"unknown drafter architecture {architecture!r}; supported: {sorted(_LAYOUTS)}")
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing:
            raise ValueError(f"drafter config.json lacks required fields {missing}")
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope_scaling = rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        known = set(_REQUIRED) | _OTHER_FIELDS
        return cls(
            architecture=architecture,
            hidden_size=cfg["hidden_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=cfg["num_attention_heads"],
            num_key_value_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg.get("vocab_size"),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 32768),
            layer_types=tuple(cfg.get("layer_types") or ()),
            sliding_window=cfg.get("sliding_window"),
            num_target_layers=cfg.get("num_target_layers"),
            extra={k: v for k, v in cfg.items() if k not in known},
            **_LAYOUTS[architecture](cfg),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> DraftConfig:
        path = Path(path) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in drafter folder {path.parent}")
        return cls.from_hf_dict(json.loads(path.read_text()))


_REQUIRED = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
)
_OTHER_FIELDS = {
    "vocab_size",
    "architectures",
    "model_type",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_parameters",
    "rope_scaling",
    "max_position_embeddings",
    "layer_types",
    "sliding_window",
    "num_target_layers",
    "block_size",
    "dflash_config",
    "is_causal",
    "mask_token_id",
    "target_layer_ids",
    "final_logit_softcapping",
    "output_multiplier",
    "input_embedding_scale",
    "mlx",
    "quantization",  # written by `dflash2 convert`, read by load_drafter
}


def _optional_float(value) -> float | None:
    return None if value is None else float(value)


def _dflash_v1_fields(cfg: dict) -> dict:
    """z-lab's DFlashDraftModel: block_size at the top level, ids under `dflash_config`."""
    dflash = cfg.get("dflash_config") or {}
    if "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
        raise ValueError("drafter config: dflash_config must hold target_layer_ids and mask_token_id")
    return dict(
        block_size=int(cfg.get("block_size", dflash.get("block_size", 16))),
        target_layer_ids=tuple(dflash["target_layer_ids"]),
        mask_token_id=int(dflash["mask_token_id"]),
        final_logit_softcapping=_optional_float(
            dflash.get("final_logit_softcapping", cfg.get("final_logit_softcapping"))
        ),
        output_multiplier=_optional_float(dflash.get("output_multiplier")),
        input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)),
        is_causal=cfg.get("is_causal"),
    )


def _dflash2_fields(cfg: dict) -> dict:
    """DFlash2DraftModel: every DFlash field under `dflash_config`."""
    fields = _dflash_v1_fields(cfg)
    dflash = cfg["dflash_config"]
    missing = [k for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k") if k not in dflash]
    if missing:
        raise ValueError(f"DFlash 2 drafter config: dflash_config lacks {missing}")
    fields.update(
        block_size=int(dflash.get("block_size", cfg.get("block_size", 16))),
        conv_kernel_size=int(dflash["conv_kernel_size"]),
        conv_group_size=int(dflash["conv_group_size"]),
        selector_rank=int(dflash["selector_rank"]),
        selector_top_k=int(dflash["selector_top_k"]),
        selector_factorized=bool(dflash.get("selector_factorized", False)),
    )
    return fields


def _muse_v1_fields(cfg: dict) -> dict:
    """Muse-style v1 drafters keep every DFlash field at the top level. Their engines run the block
    bidirectionally even though `layer_types` says sliding (vLLM sets causal=False for them)."""
    missing = [k for k in ("target_layer_ids", "mask_token_id") if k not in cfg]
    if missing:
        raise ValueError(f"drafter config lacks {missing}")
    return dict(
        block_size=int(cfg.get("block_size", 16)),
        target_layer_ids=tuple(cfg["target_layer_ids"]),
        mask_token_id=int(cfg["mask_token_id"]),
        final_logit_softcapping=_optional_float(cfg.get("final_logit_softcapping")),
        output_multiplier=_optional_float(cfg.get("output_multiplier")),
        input_embedding_scale=float(cfg.get("input_embedding_scale", 1.0)),
        is_causal=False,
    )


_LAYOUTS: dict[str, Callable[[dict], dict]] = {
    "DFlashDraftModel": _dflash_v1_fields,
    "DFlash2DraftModel": _dflash2_fields,
    "MuseGlimmerAssistantModel": _muse_v1_fields,
}


def default_target_layer_ids(num_target_layers: int, num_features: int = 5) -> tuple[int, ...]:
    """The layer ids DFlash uses for an N-layer target: round(1 + i*(N-4)/(k-1))."""
    if num_features == 1:
        return (num_target_layers // 2,)
    return tuple(int(round(1 + i * (num_target_layers - 4) / (num_features - 1))) for i in range(num_features))
