"""An mlx-lm causal LM seen as a DFlash target.

What the decode loop needs from the target, and nothing else: logits together with the drafter's
features from the same forward (no second pass), chunked prefill, and a cache that can be rolled back
after a partial acceptance: KV caches are trimmed, sliding-window caches cut, and the recurrent states of
hybrid models (GatedDeltaNet layers) rebuilt from what their layers recorded (`recurrent.py`).

A pipeline stage of a target sharded over several processes (mlx-lm's `model.model.pipeline(group)`) holds a
slice of the layers: its list has None before the first layer it runs and ends after its last, and its cache
covers its own layers only. `Target` counts the layers from the config, taps only the drafter's layers it holds
and indexes its cache from its first layer; the collective part is `distributed.py`'s.

Features are captured by re-classing only the few layer *instances* the drafter reads (a per-instance
subclass whose `__call__` records the output), for the duration of a `with target.capture() as tap:` block
owned by one generation. The layers keep their parameters and names, no class is modified, and the model is
restored on exit even if generation raises. A verify pass returns a record (`Verified`) and a rollback takes
it: nothing depends on which forward ran last.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import (
    ArraysCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from . import patches, recurrent

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
    sources = [
        owner,
        getattr(owner, "args", None),
        getattr(owner, "config", None),
        getattr(inner, "args", None),
        getattr(inner, "config", None),
    ]

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


class Verified(NamedTuple):
    """One verify pass: its logits [L, V] and features [L, k*D] (None without layer ids), and what
    `Capture.rollback` needs to undo any suffix of its rows."""

    logits: mx.array
    features: mx.array | None
    rows: int
    offset: int  # the KV caches' offset right after the pass (a rollback checks nothing came after it)
    recurrences: dict  # layer index -> what that recurrent layer saw (`recurrent.Recorded`)


class Capture:
    """A target's forwards with the drafter's features, for one generation (`with target.capture() as tap`).

    It owns the model's tapped layers while open: a second capture of the same model (another generation
    interleaved with this one) is refused, never allowed to write into this one's records."""

    def __init__(self, target: Target):
        self.target = target
        self.outputs: dict[int, mx.array] = {}
        self.recorders = {i: recurrent.Recorder() for i in target.recurrent}

    def forward(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array | None]:
        """Logits [L, V] and features [L, k*D] (None without layer ids) of `tokens` [L]; not undoable."""
        return self._forward(tokens, cache)

    def _forward(self, tokens: mx.array, cache: list) -> tuple[mx.array, mx.array | None]:
        logits = self.target.model(tokens[None], cache=cache)[0]
        features = self._features()
        return logits, None if features is None else features[0]

    def prefill(self, prompt: mx.array, cache: list, step_size: int = 2048) -> tuple[mx.array, mx.array | None]:
        """`Target.prefill`, with the features of every prompt row [n, k*D] (None without layer ids)."""
        features = []

        def forward(chunk):
            logits, feats = self.forward(chunk, cache)
            features.extend([] if feats is None else [feats])
            return logits, features

        logits = self.target._prefill(prompt, cache, step_size, forward)
        return logits, (mx.concatenate(features) if features else None)

    def verify(self, tokens: mx.array, cache: list) -> Verified:
        """A forward whose rows `rollback` can undo (recurrent layers record what they need)."""
        for r in self.recorders.values():
            r.active = True
        try:
            logits, features = self._forward(tokens, cache)
        finally:
            for r in self.recorders.values():
                r.active = False
        seen = {i: r.take() for i, r in self.recorders.items()}
        return Verified(logits, features, tokens.size, _offset(cache), seen)

    def rollback(self, cache: list, verified: Verified, keep: int) -> None:
        """Keep the first `keep` rows of the `verified` pass in `cache` and forget the rest. The pass must be
        the last thing fed to `cache`."""
        if not 0 <= keep <= verified.rows:
            raise ValueError(f"cannot keep {keep} rows of a {verified.rows}-row verify pass")
        if _offset(cache) != verified.offset:
            raise RuntimeError(
                "the cache moved since this verify pass: only the last pass fed to it can be rolled back"
            )
        n = verified.rows - keep
        for i, seen in verified.recurrences.items():
            if n > 0:
                seen.rebuild(cache[i - self.target.first_layer], keep)
        if n > 0:
            self._trim(cache, n)

    def _trim(self, cache: list, n: int) -> None:
        """The KV caches' part of a rollback (`distributed.ShardedCapture`'s is announced with the rollback)."""
        self.target._trim(cache, n)

    def _features(self) -> mx.array | None:
        """The recorded outputs of the drafter's layers this target holds (all of them, unsharded),
        concatenated in the drafter's order: [S, L, k*D]; None when it holds none."""
        target = self.target
        if not target.held_ids:
            return None
        outputs, self.outputs = self.outputs, {}
        rows = []
        for i in target.held_ids:
            h = outputs[i]
            # Hugging Face's hidden_states[N] (the last layer's output) is taken after the final norm.
            if i == target.num_layers - 1 and target.final_norm is not None:
                h = target.final_norm(h)
            rows.append(h)
        return mx.concatenate(rows, axis=-1)


def _layer_count(model: nn.Module, inner: nn.Module, listed: int) -> int:
    """The target's number of layers: the config's for a pipeline stage (whose list stops after its own last
    layer), else the length of its layer list."""
    if getattr(inner, "pipeline_size", 1) <= 1:
        return listed
    lm = getattr(model, "language_model", None)
    for source in (inner, getattr(inner, "args", None), getattr(lm if lm is not None else model, "args", None)):
        n = getattr(source, "num_hidden_layers", None)
        if isinstance(n, int):
            return n
    raise ValueError(
        f"{type(model).__module__}: a pipeline stage whose config does not say how many layers the "
        "target has (num_hidden_layers)"
    )


def _offset(cache: list) -> int:
    """The KV caches' offset (-1 when the cache holds no KV layer)."""
    return next((c.offset for c in cache if isinstance(c, _ROLLBACK_CACHES)), -1)


class Target:
    def __init__(self, model: nn.Module, layer_ids: tuple[int, ...] = ()):
        self.model = model
        layers, inner = _parts(model)
        # a pipeline stage's list: None before its first layer (its cache starts there), ending after its last
        self.first_layer = next((i for i, layer in enumerate(layers) if layer is not None), len(layers))
        self.layers = list(layers[self.first_layer :])
        self.num_layers = _layer_count(model, inner, len(layers))
        self.layer_ids = tuple(layer_ids)
        bad = [i for i in self.layer_ids if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"drafter reads target layers {bad}, but the target "
                f"({getattr(model, 'model_type', type(model).__name__)}) has only {self.num_layers} "
                f"layers (0..{self.num_layers - 1}); this drafter was trained for a different target"
            )
        # the drafter's layers this process runs, in the drafter's order (all of them unless pipelined)
        self.held_ids = tuple(i for i in self.layer_ids if self.holds(i))
        self.embed_tokens = inner.embed_tokens
        self.final_norm = getattr(inner, "norm", None)
        if isinstance(self.embed_tokens, nn.QuantizedEmbedding):
            self.vocab_size, self.hidden_size = self.embed_tokens.num_embeddings, self.embed_tokens.dims
        else:
            self.vocab_size, self.hidden_size = self.embed_tokens.weight.shape
        # What the drafter borrows: the target's input embedding and output projection, as its own forward uses them.
        self.lm_head, self.logit_multiplier, self.logit_softcap = output_head(model, inner, self.embed_tokens)
        self.embed_scale = input_embedding_scale(inner)
        # layer index -> its GatedDeltaNet module, for hybrid targets
        self.recurrent = {
            self.first_layer + j: module
            for j, layer in enumerate(self.layers)
            if (module := patches.recurrent_module(layer))
        }

    def holds(self, i: int) -> bool:
        """Whether layer i runs in this process (always, unless the target is a pipeline stage)."""
        return self.first_layer <= i < self.first_layer + len(self.layers)

    def fingerprint(self) -> str:
        """Names the target and its tapped layers: weights of the first embedding rows + the layer ids."""
        h = hashlib.sha256(np.array(self.embed_tokens.weight[:4]).tobytes())
        h.update(json.dumps([list(self.layer_ids), self.hidden_size, self.num_layers]).encode())
        return h.hexdigest()[:12]

    def head_rows(self, ids: mx.array) -> mx.array:
        """The output projection's rows [n, D] of tokens `ids`, dequantized (tied heads: embedding rows):
        `h @ head_rows(ids).T` is the head's logits of those tokens (before the logit settings)."""
        head = self.lm_head
        if not isinstance(head, nn.Module):  # the embedding's as_linear (a quantized embedding dequantizes its rows)
            return self.embed_tokens(ids)
        if isinstance(head, nn.QuantizedLinear):
            return mx.dequantize(
                head.weight[ids],
                head.scales[ids],
                head.get("biases")[ids] if "biases" in head else None,
                head.group_size,
                head.bits,
                mode=head.mode,
            )
        return head.weight[ids]

    @property
    def model_type(self) -> str:
        return getattr(self.model, "model_type", type(self.model).__module__.rsplit(".", 1)[-1])

    # -- cache -------------------------------------------------------------------------------------
    def make_cache(self) -> list:
        cache = make_prompt_cache(self.model)
        unsupported = {
            type(c).__name__
            for i, c in enumerate(cache)
            if not isinstance(c, _ROLLBACK_CACHES)
            and not (isinstance(c, ArraysCache) and self.first_layer + i in self.recurrent)
        }
        if unsupported:
            raise ValueError(
                f"target model type {self.model_type!r} keeps state that cannot be rolled back "
                f"({', '.join(sorted(unsupported))}): speculative decoding needs trimmable KV caches or "
                "GatedDeltaNet layers; use --verify-mode off for this model"
            )
        return cache

    @staticmethod
    def _trim(cache: list, n: int) -> None:
        """Forget the last `n` tokens of every KV cache in `cache` (recurrent layers are `Capture`'s)."""
        for c in cache:
            if not isinstance(c, _ROLLBACK_CACHES):
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
    def capture(self) -> Iterator[Capture]:
        """Forwards that also give the drafter's features and can be rolled back, for one generation: the
        few layers they need are re-classed (per instance) while the block is open, and restored on exit even
        if generation raises. A model already being captured (by another generation) is refused."""
        layers = [self.layers[i - self.first_layer] for i in sorted(set(self.held_ids))]
        busy = [m for m in layers + list(self.recurrent.values()) if patches.is_patched(m)]
        if busy:
            raise RuntimeError(
                "this model is already being captured by another speculative generation; run generations on "
                "one model one after the other (or load a second copy of the model)"
            )
        tap, restore = self._capture(), []
        try:
            for i, module in self.recurrent.items():
                restore += patches.record_recurrent(module, tap.recorders[i])
            for i in sorted(set(self.held_ids)):
                restore += patches.tap_layer(self.layers[i - self.first_layer], tap, i)
            yield tap
        finally:
            patches.restore(restore)

    def _capture(self) -> Capture:
        return Capture(self)

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        """Logits [L, V] for `tokens` [L] (no features: those come from a `capture()`)."""
        return self.model(tokens[None], cache=cache)[0]

    def sequence_features(self, tokens: mx.array) -> mx.array:
        """Features [S, L, k*D] of whole sequences [S, L] (no cache; right padding cannot leak into
        earlier rows of a causal model). For training."""
        return self.teacher(tokens)[0]

    def teacher(self, tokens: mx.array, top_k: int = 0) -> tuple[mx.array, mx.array, mx.array]:
        """What training learns from, in one forward over whole sequences [S, L]: the features [S, L, k*D],
        and the ids [S, L, top_k] and log-probabilities of the target's top_k next tokens at every row
        (descending; empty when top_k is 0), for distillation."""
        with self.capture() as tap:
            logits = self.model(tokens)
            features = mx.stop_gradient(tap._features())
        if top_k == 0:
            empty = mx.zeros((*tokens.shape, 0))
            return features, empty.astype(mx.int32), empty
        logits = logits.astype(mx.float32)
        top = mx.argpartition(-logits, top_k - 1, axis=-1)[..., :top_k]
        values = mx.take_along_axis(logits, top, axis=-1)
        order = mx.argsort(-values, axis=-1)
        ids = mx.take_along_axis(top, order, axis=-1).astype(mx.int32)
        logprobs = mx.take_along_axis(values, order, axis=-1) - mx.logsumexp(logits, axis=-1, keepdims=True)
        return features, ids, logprobs

    def prefill(self, prompt: mx.array, cache: list, step_size: int = 2048) -> mx.array:
        """Feed the prompt in chunks of `step_size`; returns the last logits row [V]. (`Capture.prefill`
        also returns the features.)"""
        return self._prefill(prompt, cache, step_size, lambda chunk: (self(chunk, cache), []))

    @staticmethod
    def _prefill(prompt: mx.array, cache: list, step_size: int, forward) -> mx.array:
        if step_size <= 0:
            raise ValueError(f"prefill step size must be positive, got {step_size}")
        if prompt.size == 0:
            raise ValueError("the prompt is empty: nothing to condition the target on")
        for start in range(0, prompt.size, step_size):
            logits, kept = forward(prompt[start : start + step_size])
            if start + step_size < prompt.size:
                mx.eval([c.state for c in cache], kept)
                mx.clear_cache()
        return logits[-1]
