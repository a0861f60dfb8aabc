"""Exact rollback for hybrid targets (Qwen3.5 / 3.6 / 3.8, Qwen3-Next): their linear-attention
(GatedDeltaNet) layers keep a recurrent state and a short-conv state that cannot be trimmed like a KV cache.

During a verify pass each such layer records the inputs of its delta-rule recurrence (q, k, v, a, b and the
state it started from) and the input of its depthwise conv (the previous conv state followed by the new
rows). After `n` of the pass's rows are accepted, its states are rebuilt for exactly those rows: the
recurrence is replayed for n steps from the recorded state (no projection is recomputed), and the conv
state is rows n .. n+K-2 of the recorded conv input. Memory: O(rows of one verify pass) per layer.

Recording needs no patching: a recorded layer is re-classed, for one generation, to a subclass whose
`__call__` is mlx-lm's own code with `gated_delta_update` rebound (in a private copy of its globals) to a
recording wrapper, and its `conv1d` child is re-classed to record its input. Nothing is shared with other
instances, and `Target.capture` restores the classes on exit.
"""

from __future__ import annotations

import types
from typing import Callable, NamedTuple

import mlx.core as mx
import mlx.nn as nn


class Recorded(NamedTuple):
    """What one recurrent layer saw during one verify pass."""

    recurrence: tuple  # (args, kwargs) of its gated_delta_update call
    conv_input: mx.array
    update: Callable  # the gated_delta_update it called

    def rebuild(self, cache, n: int) -> None:
        """Set `cache` ([conv state, recurrent state]) to its value after the first n recorded rows."""
        (q, k, v, a, b, A_log, dt_bias, state0, _mask), kwargs = self.recurrence
        if n == 0:  # the whole pass undone: the state it started from (None if it had none)
            state = state0
        else:
            first = lambda x: x[:, :n]  # noqa: E731
            _, state = self.update(first(q), first(k), first(v), first(a), first(b), A_log, dt_bias, state0, None, **kwargs)
        kept = self.conv_input.shape[1] - q.shape[1]  # the K - 1 rows of the previous conv state
        cache[0] = mx.contiguous(self.conv_input[:, n : n + kept])
        cache[1] = state


class Recorder:
    """Where one recurrent layer puts what it sees while `active` (one verify pass)."""

    def __init__(self):
        self.active = False
        self.recurrence: tuple | None = None
        self.conv_input: mx.array | None = None
        self._update = None

    def take(self) -> Recorded:
        """What the pass just run recorded; the recorder is empty again after."""
        if self.recurrence is None or self.conv_input is None:
            raise RuntimeError("the recurrent layer recorded nothing during the verify pass")
        seen = Recorded(self.recurrence, self.conv_input, self._update)
        self.recurrence = self.conv_input = None
        return seen


def is_recurrent(module: nn.Module) -> bool:
    """A GatedDeltaNet-style layer: a depthwise conv1d and a delta-rule recurrence in its __call__."""
    call = type(module).__call__
    return (
        isinstance(getattr(module, "conv1d", None), nn.Conv1d)
        and hasattr(module, "A_log")
        and "gated_delta_update" in getattr(call, "__globals__", {})
    )


def recurrent_module(layer: nn.Module) -> nn.Module | None:
    for child in layer.children().values():
        if isinstance(child, nn.Module) and is_recurrent(child):
            return child
    return None


def _per_instance_call(cls: type) -> type:
    """A subclass of `cls` that runs the `__call__` stored on each instance."""
    return type(cls.__name__, (cls,), {"__call__": lambda self, *a, **k: self.__dict__["_dflash_call"](self, *a, **k)})


_SUBCLASSES: dict[type, type] = {}


def install(module: nn.Module, recorder: Recorder) -> list[tuple[nn.Module, type]]:
    """Make `module` and its conv1d record into `recorder`; returns (object, class) pairs to restore."""
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
    restore = []
    for obj, call in calls:
        cls = type(obj)
        restore.append((obj, cls))
        obj.__dict__["_dflash_call"] = call
        obj.__class__ = _SUBCLASSES.setdefault(cls, _per_instance_call(cls))
    return restore


def uninstall(restore: list[tuple[nn.Module, type]]) -> None:
    for obj, cls in restore:
        obj.__class__ = cls
        obj.__dict__.pop("_dflash_call", None)
