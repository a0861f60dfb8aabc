"""Answers that go round in a loop: a small target at T = 0 often repeats itself, and a loop is easy to draft,
so speed and acceptance are reported over loop-free answers beside the overall figure."""

from __future__ import annotations

from collections.abc import Sequence

# An answer is "in a loop" when at least this share of its n-grams (`repetition_share`) occurred earlier in it:
# drafting such an answer is easy, so its speedup says little about the prompts a user sends.
LOOP_SHARE = 0.5


NGRAM = 8  # the n-gram length `repetition_share` counts


def repetition_share(tokens: Sequence[int], n: int = NGRAM) -> float:
    """The share of an answer's n-grams that occurred earlier in the same answer.

    The n-grams of an answer of L token ids are its L - n + 1 windows `tokens[i:i + n]`; window i counts as
    repeated when the same n ids stand at some earlier start j < i (the two windows may overlap). The share is
    the repeated windows over all windows: 0.0 for an answer without a repeated n-gram (or shorter than n),
    close to 1.0 for one that says the same thing over and over. A sentence of 10 distinct ids said 5 times
    (L = 50) has 43 windows, of which the first 10 are new: 33 / 43.

    Args:
        tokens: the answer's token ids.
        n: the n-gram length.

    Returns:
        The repeated share of the n-grams, in [0, 1].
    """
    windows = len(tokens) - n + 1
    if windows <= 0:
        return 0.0
    seen, repeated = set(), 0
    for i in range(windows):
        gram = tuple(tokens[i : i + n])
        repeated += gram in seen
        seen.add(gram)
    return repeated / windows


def in_a_loop(tokens: Sequence[int]) -> bool:
    """Whether an answer is in a loop: at least `LOOP_SHARE` of its n-grams occurred earlier in it."""
    return repetition_share(tokens) >= LOOP_SHARE
