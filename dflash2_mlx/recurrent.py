"""Exact rollback for hybrid targets (Qwen3.5 / 3.6 / 3.8, Qwen3-Next): their linear-attention
(GatedDeltaNet) layers keep a recurrent state and a short-conv state that cannot be trimmed like a KV cache.

During a verify pass each such layer records the inputs of its delta-rule recurrence (q, k, v, a, b and the
state it started from) and the input of its depthwise conv (the previous conv state followed by the new
rows). After `n` of the pass's rows are accepted, its states are rebuilt for exactly those rows: the
recurrence is replayed for n steps from the recorded state (no projection is recomputed), and the conv
state is rows n .. n+K-2 of the recorded conv input. Memory: O(rows of one verify pass) per layer.

How a layer is made to record, without changing mlx-lm for anyone else, is in `patches.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx


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
        else:  # the first n rows of q, k, v, a and b
            _, state = self.update(*(x[:, :n] for x in (q, k, v, a, b)), A_log, dt_bias, state0, None, **kwargs)
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
