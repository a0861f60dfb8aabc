"""What SGLang and vLLM load as a DFlash / DFlash 2 drafter: the one place this package records their layout.

Every name, field and limit below was read from the engines' own loaders:

SGLang (`--speculative-algorithm DFLASH`; DFlash: https://github.com/sgl-project/sglang/pull/22077,
DFlash 2: https://github.com/sgl-project/sglang/pull/35371):
  - `python/sglang/srt/models/dflash.py`: `EntryClass` registers `DFlashDraftModel` and `DFlash2DraftModel`
    (architecture = class name). No embedding or LM head: the worker passes the target's embeddings
    (`input_embeds`) and points the selector at the target's `lm_head`. `load_weights` takes `layers.*`, `fc`,
    `hidden_norm`, `norm` with or without a `model.` prefix, fuses `q/k/v_proj` and `gate/up_proj`, ignores
    names it does not know and fails on parameters left unloaded. `DFlashGroupedConv` (`attention_conv`,
    `mlp_conv`: `base_kernel` [2, K, D], `kernel_projection` D -> 2*K*(D/G)) wraps every sublayer;
    `CandidateSelector` holds `predecessor_codebook` / `successor_codebook` [vocab_size, selector_rank]
    parameters (no `.weight`) and `hidden_projection`. Full attention layers run bidirectionally and sliding ones
    causally unless the config's `is_causal` says otherwise; the activation must be silu.
  - `python/sglang/srt/speculative/dflash_utils.py`, `parse_dflash_draft_config`: reads `dflash_config`'s
    `block_size` (else the top-level one), `target_layer_ids`, `mask_token_id`, `num_target_layers`,
    `conv_kernel_size` + `conv_group_size` (together), `selector_rank` + `selector_top_k` (together),
    `output_multiplier`, `final_logit_softcapping` (the last two only in the DFlash 2 selector's unary logits).
    It has no `input_embedding_scale`. Its ordinary DFlash path drafts from block rows 1..B-1; anchor-first
    checkpoints are not detected (https://github.com/sgl-project/sglang/issues/40144).

vLLM (`--speculative-config '{"method": "dflash", ...}'`; DFlash 2: https://github.com/vllm-project/vllm/pull/52816):
  - `vllm/model_executor/models/registry.py`: `DFlashDraftModel` -> `qwen3_dflash.DFlashQwen3ForCausalLM`,
    `DFlash2DraftModel` -> `qwen3_dflash2.DFlash2Qwen3ForCausalLM` (a DFlash 2 drafter forces the V2 runner).
  - `vllm/model_executor/models/qwen3_dflash.py`: the draft config is a transformers `Qwen3Config`
    (`model_type` qwen3); `load_weights` prepends `model.` to every name but `lm_head` (so names carry no
    `model.` prefix), loads an embedding / LM head / `d2t` map only if the checkpoint ships them (none here:
    the target's are shared); `mask_token_id` from `dflash_config`; causality from `is_causal`, else
    `dflash_config.causal`, else sliding layers causal. `vocab_size` sizes the drafter's vocabulary (a
    different one would make it a reduced-vocabulary drafter).
  - `vllm/model_executor/models/qwen3_dflash2.py`: `DFlashGroupedConv` and `CandidateSelector` as in SGLang,
    the tables sized `config.vocab_size` x `selector_rank`; reads `dflash_config`'s `conv_kernel_size`,
    `conv_group_size`, `selector_rank`, `selector_top_k`, `input_embedding_scale`, `output_multiplier`,
    `final_logit_softcapping`. The convolution's block is `1 + num_speculative_tokens`.
  - `vllm/v1/worker/gpu/spec_decode/eagle/eagle3_utils.py`: the tapped layers are `dflash_config.target_layer_ids`
    (+1, hidden-state numbering), unless `eagle_aux_hidden_state_layer_ids` is set (never written here).
  - `sample_from_anchor=True` drafters are not supported yet (https://github.com/vllm-project/vllm/pull/54154).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import DraftConfig

ARCHITECTURES = {"v1": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
DTYPE = "bfloat16"
SAFETENSORS_DTYPE = "BF16"
# dflash_config fields each kind must carry (read by both engines' config parsers)
DFLASH_FIELDS = {
    "v1": ("mask_token_id", "target_layer_ids", "block_size"),
    "dflash2": (
        "mask_token_id",
        "target_layer_ids",
        "block_size",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
    ),
}
# top-level fields of the transformers Qwen3Config both engines build the drafter from
TOP_FIELDS = (
    "architectures",
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "vocab_size",
    "hidden_act",
    "attention_bias",
    "layer_types",
    "is_causal",
    "dflash_config",
)
# names neither engine may find: their own embedding / LM head / reduced-vocabulary maps would be loaded
FORBIDDEN_NAMES = ("embed_tokens", "lm_head", "d2t", "t2d", "mask_embedding", "mask_hidden")


@dataclass(frozen=True)
class Engine:
    name: str
    reads_embedding_scale: tuple[str, ...]  # drafter kinds whose input_embedding_scale the engine applies
    reads_logit_settings: tuple[str, ...]  # kinds whose dflash_config output_multiplier / softcap it applies
    launch: str  # the server command; {target}, {drafter}, {block}, {drafts} filled by `launch_command`


ENGINES = {
    "sglang": Engine(
        "SGLang",
        reads_embedding_scale=(),
        reads_logit_settings=("dflash2",),
        launch="python -m sglang.launch_server --model-path {target} --speculative-algorithm DFLASH "
        "--speculative-draft-model-path {drafter} --speculative-dflash-block-size {block} --tp-size 1",
    ),
    "vllm": Engine(
        "vLLM",
        reads_embedding_scale=("dflash2",),
        reads_logit_settings=("dflash2",),
        launch="vllm serve {target} -tp 1 --speculative-config "
        '\'{{"method": "dflash", "model": "{drafter}", "num_speculative_tokens": {drafts}}}\'',
    ),
}


def engine(name: str) -> Engine:
    if name not in ENGINES:
        raise ValueError(f"unknown serving engine {name!r}; choose one of {sorted(ENGINES)}")
    return ENGINES[name]


def kind(config: DraftConfig) -> str:
    return "dflash2" if config.is_dflash2 else "v1"


def launch_command(name: str, drafter: str | Path, block_size: int, target: str = "TARGET") -> str:
    return engine(name).launch.format(target=target, drafter=drafter, block=block_size, drafts=block_size - 1)


@dataclass(frozen=True)
class Resolved:
    """What the drafter does once bound to its target, in the terms the engines read."""

    vocab_size: int | None
    num_target_layers: int | None
    embedding_scale: float  # the target's own scale times the drafter's input_embedding_scale
    output_multiplier: float | None  # None: unknown (no target given and the drafter leaves it to the target)
    final_logit_softcapping: float | None
    logits_known: bool  # whether the two above are known


def check_supported(name: str, config: DraftConfig, raw: dict[str, Any], resolved: Resolved) -> None:
    """Refuse, with the reason and the way out, a drafter the engine would load but run differently."""
    eng, k = engine(name), kind(config)
    dflash = raw.get("dflash_config") or {}
    if dflash.get("sample_from_anchor", raw.get("sample_from_anchor", False)):
        raise ValueError(
            f"{eng.name} runs DFlash drafters that draft from block rows 1..B-1 (sample_from_anchor false); this "
            "drafter samples from the anchor row. vLLM's support is https://github.com/vllm-project/vllm/pull/54154 "
            "(open), SGLang has none; serve it with `dflash2 serve` instead"
        )
    if resolved.vocab_size is None:
        raise ValueError(
            "the drafter's config does not name its vocabulary size, which both engines need (the selector's "
            "tables, the reduced-vocabulary check); pass the target with --model"
        )
    if k not in eng.reads_embedding_scale and resolved.embedding_scale != 1.0:
        raise ValueError(
            f"{eng.name} feeds a {ARCHITECTURES[k]} the target's unscaled token embeddings, but this drafter "
            f"scales them by {resolved.embedding_scale:g} (input_embedding_scale times the target's own scale); "
            + (
                "export it --for vllm (its DFlash 2 drafters read input_embedding_scale) or serve it with "
                "`dflash2 serve`"
                if k == "dflash2"
                else "serve it with `dflash2 serve`"
            )
        )
    if k not in eng.reads_logit_settings and (
        config.output_multiplier is not None or config.final_logit_softcapping is not None
    ):
        raise ValueError(
            f"{eng.name} computes a DFlashDraftModel's logits with the target's own head and settings, but this "
            f"drafter sets its own (output_multiplier {config.output_multiplier}, final_logit_softcapping "
            f"{config.final_logit_softcapping}); serve it with `dflash2 serve`"
        )


def serving_config(name: str, config: DraftConfig, resolved: Resolved, note: str | None = None) -> dict[str, Any]:
    """The config.json the engine loads: its architecture name, the Qwen3 fields, and a `dflash_config` with
    every field it reads (`block_size` also at the top level, where DFlash v1 checkpoints keep it)."""
    engine(name)
    k = kind(config)
    dflash = {
        "mask_token_id": config.mask_token_id,
        "target_layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size,
        "input_embedding_scale": resolved.embedding_scale,
        "sample_from_anchor": False,
    }
    if k == "dflash2":
        dflash.update(
            conv_kernel_size=config.conv_kernel_size,
            conv_group_size=config.conv_group_size,
            selector_rank=config.selector_rank,
            selector_top_k=config.selector_top_k,
        )
        if resolved.output_multiplier is not None:
            dflash["output_multiplier"] = resolved.output_multiplier
        if resolved.final_logit_softcapping:
            dflash["final_logit_softcapping"] = resolved.final_logit_softcapping
    is_causal = config.is_causal
    if is_causal is None and len(set(config.layer_types)) == 1:  # one kind of layer: say it outright
        is_causal = config.layer_is_causal(0)
    cfg = {
        "architectures": [ARCHITECTURES[k]],
        "model_type": "qwen3",
        "hidden_size": config.hidden_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": resolved.vocab_size,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "layer_types": list(config.layer_types),
        "is_causal": is_causal,
        "block_size": config.block_size,
        "dflash_config": dflash,
        "dtype": DTYPE,
        "torch_dtype": DTYPE,
    }
    if is_causal is None:
        del cfg["is_causal"]  # mixed layers, the reference's rule: sliding ones causal (both engines' default)
    optional = {
        "rope_scaling": config.rope_scaling,
        "sliding_window": config.sliding_window,
        "num_target_layers": resolved.num_target_layers,
    }
    cfg.update({key: value for key, value in optional.items() if value is not None})
    if note:
        cfg["dflash2_mlx_note"] = note
    return cfg


def expected_tensors(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor the engine loads for `cfg` (a `serving_config`), name -> shape, all bfloat16."""
    d, layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    inter, dflash = cfg["intermediate_size"], cfg["dflash_config"]
    out = {
        "fc.weight": (d, len(dflash["target_layer_ids"]) * d),
        "hidden_norm.weight": (d,),
        "norm.weight": (d,),
    }
    for i in range(layers):
        p = f"layers.{i}."
        out.update(
            {
                p + "input_layernorm.weight": (d,),
                p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (heads * hd, d),
                p + "self_attn.k_proj.weight": (kv * hd, d),
                p + "self_attn.v_proj.weight": (kv * hd, d),
                p + "self_attn.o_proj.weight": (d, heads * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "mlp.gate_proj.weight": (inter, d),
                p + "mlp.up_proj.weight": (inter, d),
                p + "mlp.down_proj.weight": (d, inter),
            }
        )
        if "conv_kernel_size" in dflash:
            taps, group = dflash["conv_kernel_size"], dflash["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                out[p + conv + ".base_kernel"] = (2, taps, d)
                out[p + conv + ".kernel_projection.weight"] = (2 * taps * (d // group), d)
    if "selector_rank" in dflash:
        rank, vocab = dflash["selector_rank"], cfg["vocab_size"]
        out["candidate_selector.hidden_projection.weight"] = (rank, d)
        out["candidate_selector.predecessor_codebook"] = (vocab, rank)
        out["candidate_selector.successor_codebook"] = (vocab, rank)
    return out


def safetensors_header(path: Path) -> dict[str, dict[str, Any]]:
    """name -> {dtype, shape} of a safetensors file, from its header alone."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return header


def check_folder(name: str, folder: Path) -> list[str]:
    """What in an exported folder the engine would not load as written here (empty when all is well)."""
    engine(name)
    cfg = json.loads((folder / "config.json").read_text())
    problems = [f"config.json lacks {field}" for field in TOP_FIELDS if field not in cfg and field != "is_causal"]
    arch = (cfg.get("architectures") or [None])[0]
    k = next((key for key, value in ARCHITECTURES.items() if value == arch), None)
    if k is None:
        return problems + [f"architecture {arch!r} is not one of {sorted(ARCHITECTURES.values())}"]
    dflash = cfg.get("dflash_config", {})
    problems += [f"dflash_config lacks {field}" for field in DFLASH_FIELDS[k] if field not in dflash]
    if problems:
        return problems
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(safetensors_header(f))
    want = expected_tensors(cfg)
    problems += [f"missing tensor {n}" for n in sorted(want.keys() - tensors.keys())]
    problems += [f"unexpected tensor {n}" for n in sorted(tensors.keys() - want.keys())]
    problems += [
        f"{n} has shape {tuple(meta['shape'])}, expected {want[n]}"
        for n, meta in tensors.items()
        if n in want and tuple(meta["shape"]) != want[n]
    ]
    problems += [
        f"{n} is {meta['dtype']}, expected {SAFETENSORS_DTYPE}"
        for n, meta in tensors.items()
        if meta["dtype"] != SAFETENSORS_DTYPE
    ]
    problems += [
        f"{n} is a name the engine would load as its own embedding, head or vocabulary map"
        for n in tensors
        if any(part in n.split(".") for part in FORBIDDEN_NAMES)
    ]
    return problems
