"""A NumPy forward of both drafter versions, read straight from a Hugging Face checkpoint.

It stands for the CUDA side: it shares no code with the MLX model (its own safetensors reader, its own
attention, RoPE, convolution and selector), so MLX logits that match it mean a number measured on a Mac
and one measured on a CUDA engine come from the same function. Float64 throughout; default RoPE only.
"""

from __future__ import annotations

import json
import struct
from functools import partial
from pathlib import Path

import numpy as np

_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I64": np.int64, "I32": np.int32}


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """Tensors of one safetensors file as float64 (bfloat16 widened bit-exactly)."""
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, meta in header.items():
        start, end = meta["data_offsets"]
        raw = data[8 + n + start : 8 + n + end]
        if meta["dtype"] == "BF16":
            arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw, _DTYPES[meta["dtype"]])
        out[name] = arr.reshape(meta["shape"]).astype(np.float64)
    return out


def load_checkpoint(path: str | Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(config, tensors) of a Hugging Face drafter folder; names without `model.` / Muse prefixes."""
    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, value in read_safetensors(f).items():
            name = name.removeprefix("model.")
            name = name.replace("encoder.fc.", "fc.").replace("encoder.output_norm_enc.", "hidden_norm.")
            tensors[name] = value
    return cfg, tensors


def _settings(cfg: dict) -> dict:
    d = cfg.get("dflash_config") or {}

    def get(key, default=None):
        return d.get(key, cfg.get(key, default))

    rope = cfg.get("rope_parameters") or {}
    return dict(
        heads=cfg["num_attention_heads"],
        kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        eps=cfg.get("rms_norm_eps", 1e-6),
        theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
        layer_types=cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"],
        window=cfg.get("sliding_window"),
        causal=cfg.get("is_causal"),
        multiplier=get("output_multiplier", 1.0),
        softcap=get("final_logit_softcapping"),
        embed_scale=get("input_embedding_scale", 1.0),
        group=get("conv_group_size"),
        muse=(cfg.get("architectures") or [""])[0] == "MuseGlimmerAssistantModel",
    )


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, positions, theta):
    """Rotate-half RoPE on x [heads, L, d] at `positions` [L]."""
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2) / d)
    ang = positions[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))
    rotated = np.concatenate([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + rotated * sin


def _conv(x, base, dyn, group):
    """out[t, c] = sum_o (base[o, c] + dyn[t, o, c // G]) x[t - o, c]."""
    out = np.zeros_like(x)
    for o in range(base.shape[0]):
        shifted = np.zeros_like(x)
        shifted[o:] = x[: len(x) - o] if o else x
        out += (base[o] + np.repeat(dyn[:, o], group, axis=-1)) * shifted
    return out


def _attention(W, p, s, i, x, ctx):
    L, S = len(x), len(ctx)
    h, kvh, hd = s["heads"], s["kv_heads"], s["head_dim"]

    def split(a, n):
        return a.reshape(len(a), n, hd).transpose(1, 0, 2)

    q = _rms(split(x @ W[p + "q_proj.weight"].T, h), W[p + "q_norm.weight"], s["eps"])
    kv_in = np.concatenate([ctx, x])
    k = _rms(split(kv_in @ W[p + "k_proj.weight"].T, kvh), W[p + "k_norm.weight"], s["eps"])
    v = split(kv_in @ W[p + "v_proj.weight"].T, kvh)
    pos = np.arange(S + L, dtype=np.float64)
    q, k = _rope(q, pos[S:], s["theta"]), _rope(k, pos, s["theta"])
    k, v = np.repeat(k, h // kvh, axis=0), np.repeat(v, h // kvh, axis=0)
    scores = q @ k.transpose(0, 2, 1) / np.sqrt(hd)
    qpos, kpos = pos[S:, None], pos[None, :]
    visible = np.ones((L, S + L), bool)
    sliding = s["layer_types"][i] == "sliding_attention"
    causal = (False if s["muse"] else sliding) if s["causal"] is None else s["causal"]
    if causal:
        visible &= (kpos < S) | (kpos <= qpos)
    if sliding:
        visible &= qpos - kpos < s["window"]
    scores = np.where(visible, scores, -np.inf)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    out = (w / w.sum(-1, keepdims=True)) @ v
    return out.transpose(1, 0, 2).reshape(L, h * hd) @ W[p + "o_proj.weight"].T


def _mlp(W, p, x):
    """The SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""
    gate = x @ W[p + "gate_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * (x @ W[p + "up_proj.weight"].T)) @ W[p + "down_proj.weight"].T


def draft_hidden(cfg: dict, W: dict, embed: np.ndarray, block, context) -> np.ndarray:
    """Normed final hidden rows [B, D] of `block` (anchor + masks), given the target features of the
    committed rows `context` [S, k*D] at positions 0..S-1, with the target's `embed`."""
    s = _settings(cfg)
    x = embed[np.asarray(block)] * s["embed_scale"]
    ctx = _rms(np.asarray(context, np.float64) @ W["fc.weight"].T, W["hidden_norm.weight"], s["eps"])
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        sublayers = (
            ("input_layernorm", "attention_conv", partial(_attention, W, p + "self_attn.", s, i, ctx=ctx)),
            ("post_attention_layernorm", "mlp_conv", partial(_mlp, W, p + "mlp.")),
        )
        for norm, conv, f in sublayers:
            xn = _rms(x, W[p + norm + ".weight"], s["eps"])
            if p + conv + ".base_kernel" in W:
                base = W[p + conv + ".base_kernel"]
                dyn = (xn @ W[p + conv + ".kernel_projection.weight"].T).reshape(len(xn), 2, base.shape[1], -1)
                x = x + _conv(f(_conv(xn, base[0], dyn[:, 0], s["group"])), base[1], dyn[:, 1], s["group"])
            else:
                x = x + f(xn)
    return _rms(x, W["norm.weight"], s["eps"])


def head_logits(cfg: dict, hidden: np.ndarray, lm_head: np.ndarray) -> np.ndarray:
    """`lm_head(h) * output_multiplier`, softcapped when the config says so."""
    s = _settings(cfg)
    logits = hidden @ lm_head.T * s["multiplier"]
    if s["softcap"]:
        logits = np.tanh(logits / s["softcap"]) * s["softcap"]
    return logits


def draft_logits(cfg: dict, W: dict, embed: np.ndarray, lm_head: np.ndarray, block, context) -> np.ndarray:
    """Logits [B-1, V] of the draft rows of `block` (see `draft_hidden`), with the target's `lm_head`."""
    return head_logits(cfg, draft_hidden(cfg, W, embed, block, context)[1:], lm_head)


def selector_walk(cfg: dict, W: dict, hidden: np.ndarray, logits: np.ndarray, anchor: int):
    """DFlash 2's reference walk over the draft rows (hidden [T, D] normed, logits [T, V]): candidates = each
    row's top-k logits (best first, ties to the lower id); from prev = anchor, take the candidate b maximising
    S_t(prev, b) = logits[t, b] + sum_r A[prev, r] H_t[r] B[b, r] (A / B the predecessor / successor tables,
    H_t = hidden_projection(h_t)). Returns (tokens [T], candidates [T, k], chosen rows' scores [T, k])."""
    k = (cfg.get("dflash_config") or {})["selector_top_k"]
    A = W["candidate_selector.predecessor_codebook"]
    B = W["candidate_selector.successor_codebook"]
    H = hidden @ W["candidate_selector.hidden_projection.weight"].T
    candidates = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    tokens, rows, prev = [], [], int(anchor)
    for t in range(len(logits)):
        scores = logits[t, candidates[t]] + (A[prev] * H[t]) @ B[candidates[t]].T
        prev = int(candidates[t, np.argmax(scores)])
        tokens.append(prev)
        rows.append(scores)
    return np.array(tokens), candidates, np.array(rows)
