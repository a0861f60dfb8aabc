"""Everything this package changes inside mlx-lm's models, in one place.

Speculative decoding needs three things an mlx-lm model does not offer, and gets each by changing single
model instances for the length of one generation (never a class, a module or another instance; every change is
undone on exit, even when the generation raises):

1. Tapped layers (`Target.capture`): the drafter is conditioned on the outputs of a few target layers. Each
   such layer instance is re-classed to a subclass (made once per layer class) whose `__call__` runs the
   original and stores its output in the capture. mlx-lm models run their layers as `layer(h, mask, cache)`
   and return the hidden state (or a tuple starting with it); nothing else about the layer is assumed.
2. Recording recurrent layers (`recurrent.py`): hybrid targets' GatedDeltaNet layers cannot be rolled back like
   a KV cache, so during a verify pass each records the inputs of its delta-rule update and of its `conv1d`.
   The layer instance is re-classed to a subclass that runs its own `__call__` code with `gated_delta_update`
   rebound, in a private copy of that function's module globals, to a recording wrapper; its `conv1d` child is
   re-classed to record its input. The recurrence is found as the name `gated_delta_update` in the globals of
   the layer's `__call__` (mlx-lm's `qwen3_next` and `qwen3_5` models call it so).
3. Tree verification (`tree.tree_attention`): one forward over a token tree needs a tree-shaped mask and
   per-node positions. Each cache gets an instance attribute `make_mask` (mlx-lm's attention layers ask their
   cache for the mask through `create_attention_mask`, which calls `cache.make_mask` when the cache has one)
   and each attention layer an instance attribute `rope` that rotates every node at its own depth. The tree
   code checks afterwards that both were used, and refuses a model that builds masks another way.

One change is made at load time and kept for the model's life (the instance belongs to a sharded target):

4. A pipeline stage of a dense target whose mlx-lm model has no pipeline (`pipeline_stage`; mlx-lm 0.32.2 pipelines
   qwen2, qwen3_5, qwen3_moe and others through `mlx_lm.models.pipeline.PipelineMixin`, but not qwen3 or llama).
   The inner model instance (`model.model`) is re-classed to a subclass of mlx-lm's `PipelineMixin` and its own
   class, with the mixin's state and a pipelined `__call__` built as mlx-lm's pipelined models build theirs: the
   stage receives the hidden state from rank + 1, runs its layers, sends to rank - 1, and every rank takes rank 0's
   output (all_gather). The outer model is re-classed so that its `layers` are the stage's (its caches then cover
   the stage's layers only, as mlx-lm's pipelined models' do). Only a forward that is, instruction for instruction,
   one mlx-lm's pipeline composition was checked against is changed (`PIPELINE_FORWARDS`: the bytecode, names
   and constants of the inner `__call__` compared with qwen3's and llama's, and its `create_attention_mask` mlx-lm's);
   any other forward is refused, so a new mlx-lm that changes these forwards is refused rather than mis-run.

Checked against mlx-lm 0.32.2 (pyproject pins mlx-lm to the releases whose internals were read). The tests
`test_hybrid.py` (rollback, hybrid targets) and `test_tree.py` (tree masks and positions, and the refusal of a
model that ignores them) fail if a new mlx-lm changes what these rely on; `test_distributed.py` (a pipeline stage
against the unpatched layers, and two-process pipelines of qwen3 and llama against one process) for item 4.
"""

from __future__ import annotations

import types

import mlx.core as mx
import mlx.nn as nn

Restore = list[tuple[object, type, tuple[str, ...]]]  # (instance, its class before, instance keys to drop)


_TAPPED: dict[type, type] = {}
_PER_INSTANCE_CALL: dict[type, type] = {}


def _tapped_class(cls: type) -> type:
    """A subclass of `cls` whose instances store their output in their tap (made once per layer class)."""
    if cls not in _TAPPED:

        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            capture, i = self.__dict__["_dflash_tap"]
            capture.outputs[i] = out[0] if isinstance(out, tuple) else out
            return out

        _TAPPED[cls] = type(cls.__name__, (cls,), {"__call__": __call__})
    return _TAPPED[cls]


def tap_layer(layer: nn.Module, capture, i: int) -> Restore:
    """Make `layer` store each output as `capture.outputs[i]`; returns what `restore` undoes."""
    cls = type(layer)
    layer.__dict__["_dflash_tap"] = (capture, i)
    layer.__class__ = _tapped_class(cls)
    return [(layer, cls, ("_dflash_tap",))]


def is_recurrent(module: nn.Module) -> bool:
    """A GatedDeltaNet-style layer: a depthwise conv1d and a delta-rule recurrence in its __call__."""
    call = type(module).__call__
    return (
        isinstance(getattr(module, "conv1d", None), nn.Conv1d)
        and hasattr(module, "A_log")
        and "gated_delta_update" in getattr(call, "__globals__", {})
    )


def recurrent_module(layer: nn.Module) -> nn.Module | None:
    """The GatedDeltaNet module of a decoder layer, if it has one."""
    for child in layer.children().values():
        if isinstance(child, nn.Module) and is_recurrent(child):
            return child
    return None


def _per_instance_call(cls: type) -> type:
    """A subclass of `cls` that runs the `__call__` stored on each instance (made once per class)."""
    if cls not in _PER_INSTANCE_CALL:
        _PER_INSTANCE_CALL[cls] = type(
            cls.__name__, (cls,), {"__call__": lambda self, *a, **k: self.__dict__["_dflash_call"](self, *a, **k)}
        )
    return _PER_INSTANCE_CALL[cls]


def record_recurrent(module: nn.Module, recorder) -> Restore:
    """Make a recurrent `module` and its conv1d record into `recorder` (a `recurrent.Recorder`) while it is
    active; returns what `restore` undoes."""
    original = type(module).__call__
    update = original.__globals__["gated_delta_update"]
    recorder._update = update

    def recording_update(*args, **kwargs):
        if recorder.active:
            padded = args + (None,) * (9 - len(args))  # state and mask may be left to their defaults
            recorder.recurrence = (padded, kwargs)
        return update(*args, **kwargs)

    globals_ = {**original.__globals__, "gated_delta_update": recording_update}
    conv_call = type(module.conv1d).__call__

    def recording_conv(conv, x):
        if recorder.active:
            recorder.conv_input = x
        return conv_call(conv, x)

    calls = [
        (
            module,
            types.FunctionType(
                original.__code__, globals_, original.__name__, original.__defaults__, original.__closure__
            ),
        ),
        (module.conv1d, recording_conv),
    ]
    done = []
    for obj, call in calls:
        cls = type(obj)
        obj.__dict__["_dflash_call"] = call
        obj.__class__ = _per_instance_call(cls)
        done.append((obj, cls, ("_dflash_call",)))
    return done


# -- a pipeline stage (item 4) ------------------------------------------------------------------------------------
# mlx-lm inner-model forwards (module, class) that the pipelined forward below reproduces: embed_tokens (or the input
# embeddings), one attention mask per kind of layer (llama: sliding-window layers, `use_sliding`, get a windowed
# mask), `layer(h, mask, cache)` over the layers, `norm`
PIPELINE_FORWARDS = (("mlx_lm.models.qwen3", "Qwen3Model"), ("mlx_lm.models.llama", "LlamaModel"))
_PIPELINED: dict[type, type] = {}


def _code(f) -> tuple:
    code = f.__code__
    return code.co_code, code.co_names, code.co_consts


def pipeline_forward(inner: nn.Module) -> str | None:
    """The mlx-lm forward (e.g. "mlx_lm.models.qwen3.Qwen3Model") that `inner`'s `__call__` is, instruction for
    instruction, if it is one this module can pipeline; None otherwise."""
    import importlib

    from mlx_lm.models.base import create_attention_mask

    call = type(inner).__call__  # type's own where the class has none: no __code__
    if (
        getattr(call, "__code__", None) is None
        or call.__globals__.get("create_attention_mask") is not create_attention_mask
        or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm"))
    ):
        return None
    for module, name in PIPELINE_FORWARDS:
        if _code(call) == _code(getattr(importlib.import_module(module), name).__call__):
            return f"{module}.{name}"
    return None


def _pipelined_call(self, inputs: mx.array, cache=None, input_embeddings: mx.array | None = None):
    """The stage's part of the forward: rank + 1's hidden state in (the embeddings on the last rank), the stage's
    layers, rank 0's output out on every rank (as mlx-lm's pipelined models run it)."""
    h = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
    rank, size, group = self.pipeline_rank, self.pipeline_size, self.__dict__.get("_dflash_group")
    layers = self.pipeline_layers
    if cache is None:
        cache = [None] * len(layers)
    masks = stage_masks(self, h, layers, cache)
    if rank < size - 1:
        h = mx.distributed.recv_like(h, rank + 1, group=group)
    h = run_stage(h, layers, masks, cache)
    if rank != 0:
        h = mx.distributed.send(h, (rank - 1) % size, group=group)
        if cache[-1] is not None:
            cache[-1].keys = mx.depends(cache[-1].keys, h)
    if size > 1:
        h = mx.distributed.all_gather(h, group=group)[: h.shape[0]]
    return self.norm(h)


def stage_masks(inner: nn.Module, h: mx.array, layers: list, cache: list) -> list:
    """Each layer's attention mask, as the unpipelined forward makes it: one per kind of layer (full attention, or a
    sliding window for llama's `use_sliding` layers), from a cache of that kind (they all hold the same tokens)."""
    from mlx_lm.models.base import create_attention_mask

    made, masks = {}, []
    for layer, c in zip(layers, cache):
        sliding = bool(getattr(layer, "use_sliding", False))
        if sliding not in made:
            made[sliding] = (
                create_attention_mask(h, c, window_size=inner.sliding_window)
                if sliding
                else create_attention_mask(h, c)
            )
        masks.append(made[sliding])
    return masks


def run_stage(h: mx.array, layers: list, masks: list, cache: list) -> mx.array:
    """The stage's layers on `h`."""
    for layer, mask, c in zip(layers, masks, cache):
        h = layer(h, mask, c)
    return h


def _pipeline(self, group, split=None):
    """mlx-lm's `PipelineMixin.pipeline`, the group kept for the stage's exchanges."""
    from mlx_lm.models.pipeline import PipelineMixin

    self.__dict__["_dflash_group"] = group
    PipelineMixin.pipeline(self, group, split)


def pipeline_stage(model: nn.Module) -> None:
    """Give an mlx-lm model whose inner model has no pipeline one (item 4 above; kept for the model's life): after
    this, `model.model.pipeline(group)` makes it a stage as mlx-lm's own pipelined models are. Raises ValueError
    for a forward this module was not checked against."""
    from mlx_lm.models.pipeline import PipelineMixin

    inner = model.model
    if hasattr(inner, "pipeline"):
        return
    if pipeline_forward(inner) is None:
        raise ValueError(
            f"{type(inner).__module__}.{type(inner).__name__} has a forward this version cannot "
            "pipeline (pipelined: mlx-lm's own pipelined models and "
            + ", ".join(m.rsplit(".", 1)[-1] for m, _ in PIPELINE_FORWARDS)
            + ")"
        )
    inner_cls, outer_cls = type(inner), type(model)
    if inner_cls not in _PIPELINED:
        _PIPELINED[inner_cls] = type(
            inner_cls.__name__,
            (PipelineMixin, inner_cls),
            {"__call__": _pipelined_call, "pipeline": _pipeline, "__module__": inner_cls.__module__},
        )
    if outer_cls not in _PIPELINED:
        _PIPELINED[outer_cls] = type(
            outer_cls.__name__,
            (outer_cls,),
            {"layers": property(lambda self: self.model.pipeline_layers), "__module__": outer_cls.__module__},
        )
    for key, value in (("pipeline_rank", 0), ("pipeline_size", 1), ("start_idx", 0), ("end_idx", None)):
        inner.__dict__[key] = value  # PipelineMixin.__init__'s state
    inner.__class__ = _PIPELINED[inner_cls]
    model.__class__ = _PIPELINED[outer_cls]


def set_attributes(changes: list[tuple[object, str, object]]) -> Restore:
    """Give instances attributes of their own that shadow their class's (a cache's `make_mask`, an attention
    layer's `rope`); returns what `restore` undoes."""
    done = []
    for obj, name, value in changes:
        obj.__dict__[name] = value
        done.append((obj, type(obj), (name,)))
    return done


def is_patched(obj) -> bool:
    """Whether an instance is changed by one of the functions above (by another generation, say)."""
    return any(key in obj.__dict__ for key in ("_dflash_tap", "_dflash_call"))


def restore(done: Restore) -> None:
    """Undo what the functions above did, newest first."""
    for obj, cls, keys in reversed(done):
        obj.__class__ = cls
        for key in keys:
            obj.__dict__.pop(key, None)
