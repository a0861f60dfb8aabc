"""An mlx-lm causal LM seen as a DFlash target.

What the decode loop needs from the target, and nothing else: logits together with the drafter's
features from the same forward (no second pass), chunked prefill, and a cache that can be rolled back
after a partial acceptance: KV caches are trimmed, sliding-window caches cut, and the recurrent states of
hybrid models (GatedDeltaNet layers) rebuilt from what their layers recorded (`recurrent.py`).

Features are captured by re-classing only the few layer *instances* the drafter reads (a per-instance
subclass whose `__call__` records the output), for the duration of a `with target.capturing():` block.
The layers keep their parameters and names, no class is modified, and the model is restored on exit
even if generation raises.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import (
    ArraysCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from . import recurrent

_ROLLBACK_CACHES = (KVCache, RotatingKVCache, QuantizedKVCache, ConcatenateKVCache)


def _parts(model: nn.Module):
    """(decoder layers, inner model holding embed_tokens and norm) of an mlx-lm model."""
    for owner in (model, getattr(model, "language_model", None)):
        inner = getattr(owner, "model", None)
        if inner is not None and hasattr(inner, "layers") and hasattr(inner, "embed_tokens"):
            return inner.layers, inner
    raise ValueError(
        f"{type(model).__module__}.{type(model).__name__} is not a supported mlx-lm causal LM: "
        "expected model.model.layers and model.model.embed_tokens"
    )


class OutputHead(NamedTuple):
    """What the target does to its final normed hidden state h to get its logits, read from how its
    mlx-lm `Model.__call__` computes them: softcap(project(h) * multiplier), where softcap(x) =
    tanh(x / cap) * cap (None: no cap)."""

    project: Callable[[mx.array], mx.array]  # the untied LM head, or the embedding used as a linear map
    multiplier: float
    softcap: float | None


def output_head(model: nn.Module, inner: nn.Module, embed: nn.Module) -> OutputHead:
    """The target's output projection. `inner` is its decoder (holding `embed` and the layers); the head
    sits beside it: on the model, or on `model.language_model` for the multimodal wrappers (Qwen3.5/3.6,
    Gemma 3, Mistral 3, ...), untied or tied (as the model's own tie flag says), possibly quantized."""
    lm = getattr(model, "language_model", None)
    owner = lm if lm is not None and getattr(lm, "model", None) is inner else model
    sources = [owner, getattr(owner, "args", None), getattr(owner, "config", None),
               getattr(inner, "args", None), getattr(inner, "config", None)]

    def setting(name):
        return next((v for s in sources if s is not None and (v := getattr(s, name, None)) is not None), None)

    head = getattr(owner, "lm_head", None)
    if head is None and isinstance(getattr(owner, "output", None), (nn.Linear, nn.QuantizedLinear)):
        head = owner.output  # llama4_text's name for it
    tied = head is None or setting("tie_word_embeddings") is True
    multiplier = 1.0
    if setting("logits_scaling") is not None:  # granite: logits / logits_scaling
        multiplier /= setting("logits_scaling")
    if setting("logit_scale") is not None:  # cohere: logits * logit_scale
        multiplier *= setting("logit_scale")
    if setting("output_multiplier") is not None:  # Muse Glimmer
        multiplier *= setting("output_multiplier")
    if not tied and setting("dim_model_base") is not None:  # minicpm: lm_head(h / (hidden / dim_model_base))
        multiplier *= setting("dim_model_base") / setting("hidden_size")
    cap = setting("final_logit_softcapping")  # gemma2, gemma4, Muse Glimmer
    return OutputHead(embed.as_linear if tied else head, float(multiplier), float(cap) if cap else None)


# Decoders that scale their embeddings inside `__call__` by sqrt(hidden_size) (gemma3_text rounds it to bfloat16).
_SQRT_HIDDEN_EMBEDDINGS = {"gemma": None, "gemma2": None, "gemma3_text": mx.bfloat16}


def input_embedding_scale(inner: nn.Module) -> float:
    """The factor the target's decoder multiplies its token embeddings by before its first layer."""
    for name in ("embed_scale", "embedding_multiplier"):  # gemma4_text, gear; granite
        if getattr(inner, name, None) is not None:
            return float(getattr(inner, name))
    args = getattr(inner, "args", None)
    if getattr(args, "scale_emb", None) is not None:  # minicpm
        return float(args.scale_emb)
    kind = type(inner).__module__.rsplit(".", 1)[-1]
    if kind in _SQRT_HIDDEN_EMBEDDINGS:
        scale, dtype = args.hidden_size**0.5, _SQRT_HIDDEN_EMBEDDINGS[kind]
        return float(mx.array(scale, dtype)) if dtype is not None else float(scale)
    return 1.0


class _Recorder:
    """Where tapped layers put their outputs during one forward."""

    def __init__(self):
        self.outputs: dict[int, mx.array] = {}


_TAPPED_CLASSES: dict[type, type] = {}


def _tapped_class(cls: type) -> type:
    """A subclass of `cls` whose instances record their output; made once per layer class."""
    if cls not in _TAPPED_CLASSES:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            tap = self.__dict__["_dflash_tap"]
            tap[0].outputs[tap[1]] = out[0] if isinstance(out, tuple) else out
            return out

        _TAPPED_CLASSES[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _TAPPED_CLASSES[cls]


class Target:
    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = ()):
        self.model = model
        self.layers, inner = _parts(model)
        self.num_layers = len(self.layers)
        self.layer_ids = tuple(layer_ids)
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"drafter reads target layers {bad}, but the target "
                f"({getattr(model, 'model_type', type(model).__name__)}) has only {self.num_layers} "
                f"layers (0..{self.num_layers - 1}); this drafter was trained for a different target"
            )
        self.embed_tokens = inner.embed_tokens
        self.final_norm = getattr(inner, "norm", None)
        if isinstance(self.embed_tokens, nn.QuantizedEmbedding):
            self.vocab_size, self.hidden_size = self.embed_tokens.num_embeddings, self.embed_tokens.dims
        else:
            self.vocab_size, self.hidden_size = self.embed_tokens.weight.shape
        # What the drafter borrows: the target's input embedding and output projection, as its own forward uses them.
        self.lm_head, self.logit_multiplier, self.logit_softcap = output_head(model, inner, self.embed_tokens)
        self.embed_scale = input_embedding_scale(inner)
        self._recorder = _Recorder()
        self._capturing = False
        # layer index -> its GatedDeltaNet module, for hybrid targets
        self.recurrent = {
            i: module for i, layer in enumerate(self.layers) if (module := recurrent.recurrent_module(layer))
        }
        self._recurrent_records: dict[int, recurrent.Recorder] = {}

    @property
    def model_type(self) -> str:
        return getattr(self.model, "model_type", type(self.model).__module__.rsplit(".", 1)[-1])

    # -- cache -------------------------------------------------------------------------------------
    def make_cache(self) -> list:
        cache = make_prompt_cache(self.model)
        unsupported = {
            type(c).__name__ for i, c in enumerate(cache)
            if not isinstance(c, _ROLLBACK_CACHES) and not (isinstance(c, ArraysCache) and i in self.recurrent)
        }
        if unsupported:
            raise ValueError(
                f"target model type {self.model_type!r} keeps state that cannot be rolled back "
                f"({', '.join(sorted(unsupported))}): speculative decoding needs trimmable KV caches or "
                "GatedDeltaNet layers; use --verify-mode off for this model"
            )
        return cache

    def rollback(self, cache: list, n: int) -> None:
        """Forget the last `n` tokens fed to the target (by the last recorded forward, for recurrent
        layers)."""
        for i, record in self._recurrent_records.items():
            if n > 0:
                record.rebuild(cache[i], record.rows - n)
            record.recurrence = record.conv_input = None
        if n <= 0:
            return
        for i, c in enumerate(cache):
            if i in self._recurrent_records:
                continue
            if isinstance(c, RotatingKVCache) and c.offset >= c.max_size:
                # Past its window the ring buffer refuses trim(); right after a multi-token update it
                # holds max_size-1+L rows in temporal order, so dropping the newest n is exact.
                keys, values = c._temporal_order(c.keys), c._temporal_order(c.values)
                c.keys, c.values = keys[..., :-n, :], values[..., :-n, :]
                c.offset -= n
                c._idx = c.keys.shape[2]
            elif c.trim(n) != n:
                raise RuntimeError(f"could not roll back {n} tokens of a {type(c).__name__}")

    # -- forward -------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def capturing(self) -> Iterator["Target"]:
        """Record the drafter's feature layers, and what recurrent layers need for a rollback, during
        forwards inside this block."""
        if self._capturing or not (self.layer_ids or self.recurrent):
            yield self
            return
        originals, restore = {}, []
        try:
            for i, module in self.recurrent.items():
                self._recurrent_records[i] = recurrent.Recorder()
                restore += recurrent.install(module, self._recurrent_records[i])
            for i in set(self.layer_ids):
                layer = self.layers[i]
                originals[i] = type(layer)
                layer.__dict__["_dflash_tap"] = (self._recorder, i)
                layer.__class__ = _tapped_class(type(layer))
            self._capturing = True
            yield self
        finally:
            for i, cls in originals.items():
                self.layers[i].__class__ = cls
                self.layers[i].__dict__.pop("_dflash_tap", None)
            recurrent.uninstall(restore)
            self._recurrent_records.clear()
            self._capturing = False
            self._recorder.outputs.clear()

    def __call__(self, tokens: mx.array, cache: list, record: bool = False) -> tuple[mx.array, mx.array | None]:
        """Logits [L, V] and features [L, k*D] (None without layer ids) for `tokens` [L]. With `record`,
        recurrent layers keep what `rollback` needs to undo any suffix of these tokens."""
        if record and self.recurrent and not self._capturing:
            raise RuntimeError("recurrent layers record only inside `with target.capturing():`")
        for r in self._recurrent_records.values():
            r.active = record
        try:
            logits = self.model(tokens[None], cache=cache)[0]
        finally:
            for r in self._recurrent_records.values():
                r.active = False
        if not self.layer_ids:
            return logits, None
        if not self._capturing:
            raise RuntimeError("Target features are recorded only inside `with target.capturing():`")
        return logits, self._features()[0]

    def _features(self) -> mx.array:
        """The recorded outputs of the drafter's layers, concatenated: [S, L, k*D]."""
        outputs, self._recorder.outputs = self._recorder.outputs, {}
        rows = []
        for i in self.layer_ids:
            h = outputs[i]
            # Hugging Face's hidden_states[N] (the last layer's output) is taken after the final norm.
            if i == self.num_layers - 1 and self.final_norm is not None:
                h = self.final_norm(h)
            rows.append(h)
        return mx.concatenate(rows, axis=-1)

    def sequence_features(self, tokens: mx.array) -> mx.array:
        """Features [S, L, k*D] of whole sequences [S, L] (no cache; right padding cannot leak into
        earlier rows of a causal model). For training."""
        with self.capturing():
            self.model(tokens)
            return mx.stop_gradient(self._features())

    def prefill(
        self, prompt: mx.array, cache: list, step_size: int = 2048
    ) -> tuple[mx.array, mx.array | None]:
        """Feed the prompt in chunks of `step_size`; returns the last logits row [V] and the features
        of every prompt row [n, k*D] (None without layer ids)."""
        if step_size <= 0:
            raise ValueError(f"prefill step size must be positive, got {step_size}")
        if prompt.size == 0:
            raise ValueError("the prompt is empty: nothing to condition the target on")
        features = []
        for start in range(0, prompt.size, step_size):
            logits, feats = self(prompt[start : start + step_size], cache)
            if feats is not None:
                features.append(feats)
            if start + step_size < prompt.size:
                mx.eval([c.state for c in cache], features)
                mx.clear_cache()
        return logits[-1], (mx.concatenate(features) if features else None)
