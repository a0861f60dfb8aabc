"""Prefix reuse: the caches one speculative generation leaves for the next one on the same target and drafter.

A `PromptCache` holds the target's KV cache, the drafter's context cache, the tokens the target cache
covers, and the target features of the last rows the drafter has not taken in yet. A generation given one
(`stream_generate(..., prompt_cache=pc)`) starts from the longest prefix its prompt shares with those tokens:
both caches are trimmed at the first differing token and only the rest of the prompt is prefilled. A second
chat turn, whose prompt is the first turn's conversation plus a new message, prefills just the new part.

Trimming needs caches that can forget their newest rows: KV caches, and sliding-window caches that have not
wrapped. Hybrid targets (GatedDeltaNet layers) keep no snapshot of their recurrent state: they reuse the
cache only when it covers a prefix of the new prompt whole (nothing to trim, as in a chat's next turn), and
start fresh otherwise; so does a wrapped sliding-window cache. Memory is bounded by holding one sequence
(the last generation's), which that generation needed anyway.

`PromptCaches` keeps several such sequences (slots), least recently used first out, within a number of slots and
a byte budget, as mlx_lm.server's `LRUPromptCache` does (its `--prompt-cache-size` and `--prompt-cache-bytes`):
interleaved conversations each find their own prefix. A generation takes the slot sharing the longest prefix
with its prompt, whole when its prompt extends the slot's sequence (a chat's next turn), as a copy when it
shares only part of it (so the slot's own conversation keeps it), and gives it back when done.
"""

from __future__ import annotations

import contextlib
import copy
from collections import OrderedDict

import mlx.core as mx

from .target import Target, _offset


class PromptCache:
    """Pass one to consecutive `stream_generate` calls (`prompt_cache=`) on the same model and drafter; one
    generation at a time uses it (the model's capture refuses a second)."""

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        """Forget everything: the next generation starts fresh."""
        self.owner = None  # (target model, drafter) the caches belong to
        self.target_cache: list | None = None
        self.draft_cache: list | None = None
        self.tokens: list[int] = []  # prompt + committed tokens; the target cache covers the first `_offset` of them
        self.pending: list[mx.array] = []  # features of the rows the target cache covers and the drafter's does not
        self.reused = 0  # prompt tokens the last generation took from the cache

    def start(self, target: Target, drafter, prompt: mx.array) -> tuple[list, list | None, mx.array | None, mx.array]:
        """(target cache, drafter cache, features of covered rows the drafter has yet to see (or None), the
        prompt rows still to prefill) for a generation of `prompt`, reusing the longest shared prefix.
        `drafter` None: plain decoding, a target cache alone."""
        prompt_ids = prompt.tolist()
        keep, context = self._shared(target, drafter, prompt_ids), None
        if 0 < keep < len(self.tokens):
            target._trim(self.target_cache, len(self.tokens) - keep)
        if keep == 0:
            self.target_cache = target.make_cache()
            self.draft_cache = None if drafter is None else drafter.make_cache()
        elif drafter is not None:
            seen = self.draft_cache[0].offset  # rows the drafter's cache holds
            if keep >= seen:
                context = mx.concatenate(self.pending)[: keep - seen] if keep > seen else None
            else:
                for c in self.draft_cache:
                    c.trim(seen - keep)
        self.owner, self.tokens, self.pending, self.reused = (target.model, drafter), prompt_ids, [], keep
        return self.target_cache, self.draft_cache, context, prompt[keep:]

    def _shared(self, target: Target, drafter, prompt: list[int]) -> int:
        """How many leading prompt tokens the caches can be kept for (0: start fresh)."""
        return self.shared(target.model, drafter, prompt)

    def shared(self, model, drafter, prompt: list[int], target_only: bool = False) -> int:
        """How many leading tokens of `prompt` a generation on `model` and `drafter` can take from this slot (0:
        none); `target_only`: for a generation that needs the target's cache alone (batched plain decoding),
        whatever drafter filled the slot. `model` may be a `Target` (a sharded target's rank 0 passes one)."""
        if isinstance(model, Target):
            model = model.model
        if self.owner is None or self.owner[0] is not model or (self.owner[1] is not drafter and not target_only):
            return 0
        covered = _offset(self.target_cache)
        if covered < 0:  # no KV layer to say how far the cache goes
            return 0
        self.tokens = self.tokens[:covered]  # tokens committed but never fed are not covered
        limit = min(len(self.tokens), len(prompt) - 1)  # at least one prompt token is fed, for its logits
        keep = next((i for i in range(limit) if self.tokens[i] != prompt[i]), limit)
        trimmable = all(c.is_trimmable() for c in self.target_cache)
        return keep if keep == len(self.tokens) or trimmable else 0

    @property
    def nbytes(self) -> int:
        """Bytes the slot's caches and pending features hold."""
        caches = [*(self.target_cache or []), *(self.draft_cache or [])]
        return sum(c.nbytes for c in caches) + sum(p.nbytes for p in self.pending)

    def copy(self) -> PromptCache:
        """An independent slot with the same content (the model and drafter shared, the caches copied)."""
        other = PromptCache()
        other.owner, other.tokens, other.pending = self.owner, list(self.tokens), list(self.pending)
        other.target_cache, other.draft_cache = copy.deepcopy(self.target_cache), copy.deepcopy(self.draft_cache)
        return other

    def target_prefix(self, keep: int) -> list:
        """A copy of the target's cache holding its first `keep` rows (`keep` from `shared(..., target_only=True)`)."""
        cache = copy.deepcopy(self.target_cache)
        covered = _offset(cache)
        if keep < covered:
            Target._trim(cache, covered - keep)
        return cache

    def resume(self) -> tuple[list, list[int], list[int]]:
        """(a copy of the target's cache, the tokens it covers, the committed tokens it does not: at least one),
        to continue this slot's sequence elsewhere (batched plain decoding); the slot keeps its own caches."""
        covered = min(_offset(self.target_cache), len(self.tokens) - 1)
        return self.target_prefix(covered), self.tokens[:covered], self.tokens[covered:]

    @classmethod
    def of_target(cls, model, tokens: list[int], cache: list) -> PromptCache:
        """A slot holding the target's cache alone (no drafter context), covering `tokens`; e.g. what batched
        plain decoding leaves."""
        slot = cls()
        slot.owner, slot.tokens, slot.target_cache = (model, None), list(tokens), cache
        return slot

    def commit(self, step, pending: list[mx.array]):
        """Called by the decode loop at each step it yields: the tokens it committed and the features of the
        rows its target cache covers beyond the drafter's."""
        self.tokens += step.tokens
        self.pending = pending
        return step

    @contextlib.contextmanager
    def filling(self):
        """Around a generation that fills the caches: one that fails inside a forward leaves them undefined,
        so they are dropped; one closed between steps leaves them whole."""
        try:
            yield
        except GeneratorExit:
            raise
        except BaseException:
            self.clear()
            raise


class PromptCaches:
    """Prompt-cache slots, least recently used first out, bounded by `max_size` slots and `max_bytes` bytes
    (None: no byte bound). One thread uses it: `take` a slot for a generation, `put` it back after."""

    def __init__(self, max_size: int = 10, max_bytes: int | None = None):
        if max_size < 1:
            raise ValueError(f"a prompt cache holds at least 1 slot, got {max_size} (--prompt-cache-size)")
        if max_bytes is not None and max_bytes < 0:
            raise ValueError(f"the prompt cache's byte budget must be >= 0, got {max_bytes} (--prompt-cache-bytes)")
        self.max_size, self.max_bytes = max_size, max_bytes
        self.slots: OrderedDict[int, PromptCache] = OrderedDict()  # id(slot) -> slot, least recently used first

    def __len__(self) -> int:
        return len(self.slots)

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots.values())

    def _best(self, model, drafter, prompt: list[int], target_only: bool) -> tuple[PromptCache | None, int]:
        best, keep = None, 0
        for slot in self.slots.values():
            n = slot.shared(model, drafter, prompt, target_only)
            if n > keep:
                best, keep = slot, n
        return best, keep

    def take(self, model, drafter, prompt: list[int]) -> PromptCache:
        """The slot for a generation of `prompt` on `model` with `drafter` (None: plain decoding): the one sharing
        the longest prefix with it, taken out of the pool when the prompt extends its whole sequence, else copied
        (the slot stays, now the most recently used); a new empty slot when none shares anything. Give it back
        with `put`."""
        slot, keep = self._best(model, drafter, prompt, False)
        if slot is None:
            return PromptCache()
        if keep >= len(slot.tokens):  # `shared` cut its tokens to those the cache covers
            del self.slots[id(slot)]
            return slot
        self.slots.move_to_end(id(slot))  # used: the most recent now
        return slot.copy()

    def borrow(self, model, prompt: list[int]) -> tuple[list | None, int]:
        """(a copy of the target's cache for the longest prefix of `prompt` any slot holds, its length), or
        (None, 0); the slot stays in the pool, now most recently used."""
        slot, keep = self._best(model, None, prompt, True)
        if slot is None:
            return None, 0
        self.slots.move_to_end(id(slot))
        return slot.target_prefix(keep), keep

    def put(self, slot: PromptCache) -> None:
        """Keep `slot` as the most recently used; slots whose whole sequence it extends (same owner) are
        dropped, then the least recently used ones while over the bounds."""
        if slot.target_cache is None or not slot.tokens:
            return
        for other in list(self.slots.values()):
            n = len(other.tokens)
            same = all(a is b for a, b in zip(other.owner, slot.owner))
            if same and n <= len(slot.tokens) and other.tokens == slot.tokens[:n]:
                del self.slots[id(other)]
        self.slots[id(slot)] = slot
        self.slots.move_to_end(id(slot))
        while len(self.slots) > self.max_size:
            self.slots.popitem(last=False)
        if self.max_bytes is not None:
            self.trim_to(self.max_bytes)

    def trim_to(self, n_bytes: int) -> None:
        """Drop the least recently used slots until they hold at most `n_bytes` (e.g. the budget less what the
        running generations hold, as mlx_lm.server trims its cache while it batches)."""
        while self.slots and self.nbytes > n_bytes:
            self.slots.popitem(last=False)

    def clear(self) -> None:
        self.slots.clear()
