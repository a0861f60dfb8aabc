"""Copy drafts (`lookup.py`, `--copyspec-mode`): the index against a brute-force search, the branch trees, and
lossless decoding with lookups firing in every verify mode."""

from __future__ import annotations

import random

import pytest

from dflash2_mlx.lookup import (MODES, CopySpec, LookupConfig, LookupIndex, Match, branch_tree, copyspec_config,
                                graft, leading_matches, match_bucket)
from dflash2_mlx.tree import Tree


def brute_force(tokens: list[int], min_match: int, max_draft: int) -> Match | None:
    """The longest suffix that also occurs ending before the last token, its first such occurrence, and the tokens
    after it, by trying every length and start."""
    n = len(tokens)
    for length in range(n - 1, 0, -1):
        suffix = tokens[n - length:]
        for start in range(0, n - length):  # ends at start + length - 1 <= n - 2
            if tokens[start: start + length] == suffix:
                if length < min_match:
                    return None
                return Match(tokens[start + length: start + length + max_draft], length)
    return None


@pytest.mark.parametrize("alphabet", [2, 3, 8, 50])
def test_index_is_the_brute_force_search(alphabet):
    """After every token of random sequences (small alphabets: long, nested repeats), the proposal is the brute
    force's, also when the tokens come in chunks."""
    rng = random.Random(alphabet)
    checked = fired = 0
    for trial in range(12):
        config = LookupConfig(min_match=rng.choice([1, 2, 3]), max_draft=rng.choice([1, 4, 9]))
        seq = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 120))]
        if trial % 3 == 0:  # a copied stretch, as in an edit
            seq += seq[: rng.randrange(1, len(seq) + 1)]
        split = rng.randrange(0, len(seq) + 1)
        index = LookupIndex(config, seq[:split])
        for i in range(split, len(seq) + 1):
            if i > split:
                index.extend(seq[i - 1: i])
            if i == 0:
                continue
            expected = brute_force(seq[:i], config.min_match, config.max_draft)
            assert index.propose() == expected, (seq[:i], config)
            checked += 1
            fired += expected is not None
    assert 20 < fired < checked  # both outcomes were tested


def test_proposal_is_limited_and_states_stay_linear():
    index = LookupIndex(LookupConfig(min_match=2, max_draft=10), [5, 6, 7, 8, 9, 5, 6])
    assert index.propose() == Match([7, 8, 9, 5, 6], 2)  # only what is known after the match
    assert index.propose(limit=2) == Match([7, 8], 2)
    assert index.propose(limit=0) is None
    index.extend([7, 8, 9])
    assert index.propose() == Match([5, 6, 7, 8, 9], 5)  # the match grew with the copy
    long = LookupIndex(LookupConfig(1, 4), [random.Random(0).randrange(4) for _ in range(5000)])
    assert len(long.length) <= 2 * 5000  # a suffix automaton has fewer than 2n states


def test_modes_and_bad_settings():
    assert copyspec_config("off") is None and copyspec_config(None) is None
    assert copyspec_config("auto") == MODES["auto"]
    assert MODES["conservative"].min_match > MODES["auto"].min_match > MODES["aggressive"].min_match
    with pytest.raises(ValueError, match="copyspec mode must be one of"):
        copyspec_config("always")
    with pytest.raises(ValueError, match="min_match must be an integer >= 1"):
        LookupConfig(0, 4)
    with pytest.raises(ValueError, match="max_draft must be an integer >= 1"):
        LookupConfig(2, 0)


def test_branch_tree_shares_the_common_prefix():
    tree = branch_tree(100, [1, 2, 3, 4], [1, 2, 9, 8])
    assert tree.tokens == [100, 1, 2, 3, 4, 9, 8]
    assert tree.parents == [-1, 0, 1, 2, 3, 2, 5]
    assert tree.depths == [0, 1, 2, 3, 4, 3, 4]
    assert branch_tree(100, [1, 2], [1, 2]).tokens == [100, 1, 2]  # the same path: nothing added
    assert branch_tree(100, [1], [7, 1]).parents == [-1, 0, 0, 2]
    grafted, path = graft(Tree([0, 5, 6], [-1, 0, 0], [0, 1, 1]), [6, 7])
    assert path == [2, 3] and grafted.parents == [-1, 0, 0, 2]
    # the walk follows the lookup branch where the target's choices do
    assert tree.walk([1, 2, 9, 0, 0, 8, 42]) == ([0, 1, 2, 5, 6], 42)


def test_acceptance_is_tracked_by_match_length():
    assert [match_bucket(n) for n in (1, 2, 3, 4, 7, 8, 16, 31, 32, 1000)] == [0, 1, 1, 2, 2, 3, 4, 4, 5, 5]
    assert leading_matches([1, 2, 3], [1, 2, 4, 5]) == 2
    spec = CopySpec(LookupConfig(2, 4), [], trees=True)
    long, short = Match([1, 2, 3, 4], 20), Match([1, 2, 3, 4], 2)
    for _ in range(10):
        assert spec.observe(long, [1, 2, 3, 4, 5], [1, 9, 9]) == "lookup"
        assert spec.observe(short, [7, 7], [7, 9, 9]) == "drafter"
    assert spec.expected(long) > 4.5 and spec.expected(short) < 1.2
    assert spec.lookup_wins(long) and not spec.lookup_wins(short)
    assert spec.observe(None, [1], [1]) is None
