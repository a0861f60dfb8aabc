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

Checked against mlx-lm 0.32.2 (pyproject pins mlx-lm to the releases whose internals were read). The tests
`test_hybrid.py` (rollback, hybrid targets) and `test_tree.py` (tree masks and positions, and the refusal of a
model that ignores them) fail if a new mlx-lm changes what these rely on.
"""

from __future__ import annotations

import types

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
        _PER_INSTANCE_CALL[cls] = type(cls.__name__, (cls,), {
            "__call__": lambda self, *a, **k: self.__dict__["_dflash_call"](self, *a, **k)})
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
        (module, types.FunctionType(original.__code__, globals_, original.__name__, original.__defaults__,
                                    original.__closure__)),
        (module.conv1d, recording_conv),
    ]
    done = []
    for obj, call in calls:
        cls = type(obj)
        obj.__dict__["_dflash_call"] = call
        obj.__class__ = _per_instance_call(cls)
        done.append((obj, cls, ("_dflash_call",)))
    return done


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
