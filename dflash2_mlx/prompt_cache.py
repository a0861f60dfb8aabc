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
"""

from __future__ import annotations

import contextlib

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
        if self.owner is None or self.owner[0] is not target.model or self.owner[1] is not drafter:
            return 0
        covered = _offset(self.target_cache)
        if covered < 0:  # no KV layer to say how far the cache goes
            return 0
        self.tokens = self.tokens[:covered]  # tokens committed but never fed are not covered
        limit = min(len(self.tokens), len(prompt) - 1)  # at least one prompt token is fed, for its logits
        keep = next((i for i in range(limit) if self.tokens[i] != prompt[i]), limit)
        trimmable = all(c.is_trimmable() for c in self.target_cache)
        return keep if keep == len(self.tokens) or trimmable else 0

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
