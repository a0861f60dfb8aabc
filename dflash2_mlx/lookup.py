"""Copy drafts (`--copyspec-mode`): continuations looked up in the context, verified beside the drafter's block.

Where the answer repeats its context (a file with one function changed, a paragraph with its typos fixed, the
arguments of the last tool call), the next tokens are already there. `LookupIndex` finds the longest suffix of
the committed tokens (prompt and answer so far) that occurred before, and proposes the tokens that followed it.
The index is a suffix automaton over the tokens, extended as they commit (amortized O(1) per token, never a scan
of the context); a proposal is deterministic, a one-hot draft distribution (`one_hot_proposal`), so rejection
sampling at T > 0 stays exact.

A cycle with a proposal verifies it and the drafter's path in one target pass, as two branches of a token tree
(`branch_tree`, `graft`: `tree.py`'s verification, the shared prefix fed once), or, on a target that cannot verify
a tree (recurrent layers, a sharded target, caches whose rows cannot be reordered), the one branch with the more
expected tokens (`CopySpec.lookup_wins`). How the modes are set and what they bought: docs/copy.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx

from .adaptive import AcceptanceEstimates, expected_tokens
from .sampling import Proposal
from .tree import Tree, check_cache, check_target

COPYSPEC_MODES = ("auto", "conservative", "aggressive", "off")


@dataclass(frozen=True)
class LookupConfig:
    """What a lookup proposes.

    Args:
        min_match: the shortest suffix match (in tokens) that proposes a continuation.
        max_draft: the most tokens a proposal holds.
    """

    min_match: int
    max_draft: int

    def __post_init__(self):
        if not isinstance(self.min_match, int) or self.min_match < 1:
            raise ValueError(f"min_match must be an integer >= 1 (tokens of context matched), got {self.min_match!r}")
        if not isinstance(self.max_draft, int) or self.max_draft < 1:
            raise ValueError(f"max_draft must be an integer >= 1 (tokens proposed), got {self.max_draft!r}")


# Each mode's lookup; "off" looks nothing up (docs/copy.md: what each is for).
MODES = {
    "conservative": LookupConfig(min_match=8, max_draft=8),
    "auto": LookupConfig(min_match=4, max_draft=16),
    "aggressive": LookupConfig(min_match=2, max_draft=32),
}


def copyspec_config(mode: str | LookupConfig | None) -> LookupConfig | None:
    """The lookup of a `--copyspec-mode` (a `LookupConfig` is taken as given); None for "off" or None.

    Raises:
        ValueError: an unknown mode, naming the known ones.
    """
    if mode is None or isinstance(mode, LookupConfig):
        return mode
    if mode not in COPYSPEC_MODES:
        raise ValueError(f"copyspec mode must be one of {COPYSPEC_MODES}, got {mode!r}")
    return MODES.get(mode)


class Match(NamedTuple):
    """A lookup's proposal: the tokens that followed the match, and the match's length."""

    tokens: list[int]
    length: int


class LookupIndex:
    """The longest earlier occurrence of the committed tokens' suffix, kept as tokens commit.

    A suffix automaton (Blumer et al.): each state a class of substrings ending at the same positions, with the
    length of its longest, a suffix link and the end of its first occurrence. After each token the suffix link of
    the state holding the whole sequence is the longest suffix that occurred before, and its first occurrence
    ends before the sequence does, so the tokens after it are known. Adding a token is amortized O(1) (at most
    two states and amortized constant link walking), whatever the context's length.

    Args:
        config: the shortest match proposed and the longest proposal.
        tokens: the tokens to start from (a prompt).
    """

    def __init__(self, config: LookupConfig, tokens: Sequence[int] = ()):
        self.config = config
        self.tokens: list[int] = []
        self.next: list[dict[int, int]] = [{}]
        self.link, self.length, self.first = [-1], [0], [-1]
        self.last = 0
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Commit `tokens` (ints) after those already indexed."""
        for t in tokens:
            self._add(int(t))

    def _add(self, t: int) -> None:
        nxt, link, length, first = self.next, self.link, self.length, self.first
        pos = len(self.tokens)
        self.tokens.append(t)
        cur = len(length)
        nxt.append({})
        link.append(0)
        length.append(length[self.last] + 1)
        first.append(pos)
        p = self.last
        while p != -1 and t not in nxt[p]:
            nxt[p][t] = cur
            p = link[p]
        if p != -1:
            q = nxt[p][t]
            if length[p] + 1 == length[q]:
                link[cur] = q
            else:  # split q: a clone keeps the shorter strings, which now also end here
                clone = len(length)
                nxt.append(dict(nxt[q]))
                link.append(link[q])
                length.append(length[p] + 1)
                first.append(first[q])
                while p != -1 and nxt[p].get(t) == q:
                    nxt[p][t] = clone
                    p = link[p]
                link[q] = link[cur] = clone
        self.last = cur

    def match(self) -> tuple[int, int]:
        """(the length of the longest suffix that occurred before, the position just after its first
        occurrence); (0, -1) when no token recurs."""
        state = self.link[self.last]
        if state <= 0:
            return 0, -1
        return self.length[state], self.first[state] + 1

    def propose(self, limit: int | None = None) -> Match | None:
        """The tokens after the longest earlier occurrence of the suffix (at most `limit`, and `max_draft`), or None
        when the match is shorter than `min_match`."""
        length, start = self.match()
        if length < self.config.min_match:
            return None
        n = self.config.max_draft if limit is None else min(limit, self.config.max_draft)
        return Match(self.tokens[start : start + n], length) if n > 0 else None


def one_hot_proposal(tokens: Sequence[int]) -> Proposal:
    """A lookup's drafts as a `Proposal` whose every row puts probability 1 on its token: the law its
    deterministic drafts were drawn from, so `sampling.accept` keeps each with probability p(token) and resamples
    a rejection from p without it (exact at T > 0)."""
    ids = mx.array(list(tokens), dtype=mx.uint32)
    return Proposal(ids, ids[:, None], mx.ones((ids.size, 1), mx.float32), mx.array(True))


def graft(tree: Tree, tokens: Sequence[int]) -> tuple[Tree, list[int]]:
    """`tree` with the path anchor -> tokens added: existing nodes are followed as far as they hold the tokens
    (a shared prefix is verified once), new nodes hang below. Returns (the tree, the path's node indices)."""
    children = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens))}
    out, parents, depths = list(tree.tokens), list(tree.parents), list(tree.depths)
    node, path = 0, []
    for t in tokens:
        child = children.get((node, t))
        if child is None:
            child = len(out)
            out.append(int(t))
            parents.append(node)
            depths.append(depths[node] + 1)
            children[(node, t)] = child
        path.append(child)
        node = child
    return Tree(out, parents, depths), path


def branch_tree(anchor: int, drafts: Sequence[int], copied: Sequence[int]) -> Tree:
    """The anchor, the drafter's path (nodes 1..len(drafts)) and the lookup's tokens grafted beside it."""
    chain = Tree([anchor, *drafts], [-1, *range(len(drafts))], list(range(len(drafts) + 1)))
    return graft(chain, copied)[0]


def leading_matches(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def verifies_trees(target, cache: list) -> bool:
    """Whether `target` with `cache` can verify a token tree in one pass (`tree.check_target`, `check_cache`)."""
    try:
        check_target(target)
        check_cache(cache)
    except ValueError:
        return False
    return True


def match_bucket(length: int) -> int:
    """The match-length class acceptance is tracked by: 1, 2-3, 4-7, 8-15, 16-31, 32 and more."""
    return min(length.bit_length(), 6) - 1


class CopySpec:
    """One generation's lookups: the index, whether cycles verify two branches, and what each branch is worth.

    Acceptance of lookup drafts is tracked on its own, per match-length class and draft position
    (`adaptive.AcceptanceEstimates`, from neutral estimates, each class starting from the shorter one's), and the
    drafter's as tokens per cycle; adaptive mode prices a lookup with them (`AdaptiveBlocks.lookup_drafts`). A
    match left unverified is watched (`watch`): the tokens committed after it score it as a cycle verifying it
    would have, so acceptance is learnt during plain steps too, at no cost.

    Args:
        config: the lookup (`copyspec_config`).
        prompt: the prompt's tokens, indexed first.
        trees: verify a lookup beside the drafter's path as a tree (False: one branch per cycle).
    """

    def __init__(self, config: LookupConfig, prompt: Sequence[int], trees: bool):
        self.config, self.trees = config, trees
        self.index = LookupIndex(config, prompt)
        self.lookups = [AcceptanceEstimates(config.max_draft, decay=0.8) for _ in range(6)]
        # decayed mean of tokens a drafter's cycle committed, from one and half a draft: a lookup (which wins ties)
        # is tried
        self.drafter_tokens = 1.5
        # a match left unverified, scored by the tokens committed after it: (its match-length class, its tokens,
        # the position the next committed token is compared with)
        self.shadow: tuple[int, list[int], int] | None = None

    def propose(self, limit: int | None = None) -> Match | None:
        return self.index.propose(limit)

    def acceptance(self, match: Match) -> list[float]:
        """P(lookup draft i accepted | the drafts before it accepted) for a match of this length.

        The shortest class's are its counts' (`AcceptanceEstimates`, from neutral estimates). A class not yet seen
        takes the next shorter class's; once seen, its first position's counts are shrunk, by one observation's
        worth, toward the shorter class's first-position estimate, and each later position's toward its own
        estimate at the position before (a copy that held so far tends to go on).
        """
        reference = self.lookups[0].estimates()
        for estimates in self.lookups[1 : match_bucket(match.length) + 1]:
            if not any(estimates.seen):
                continue
            previous, mine = reference[0], []
            for h, n in zip(estimates.hits, estimates.seen):
                previous = (h + previous) / (n + 1.0)
                mine.append(previous)
            reference = mine
        return reference

    def expected(self, match: Match, n: int | None = None) -> float:
        """Tokens a cycle verifying the first `n` (default all) of the match's drafts is expected to commit."""
        n = len(match.tokens) if n is None else n
        return expected_tokens(self.acceptance(match), n + 1)

    def watch(self, match: Match) -> None:
        """Score `match`, left unverified, by the tokens committed next (`commit`): its acceptance is counted as a
        cycle verifying it would have counted it, at no cost (one match watched at a time)."""
        if self.shadow is None and match.tokens:
            self.shadow = (match_bucket(match.length), list(match.tokens), 0)

    def commit(self, tokens: Sequence[int]) -> None:
        """Index committed `tokens`, scoring the watched match by them first."""
        if self.shadow is not None:
            bucket, drafts, i = self.shadow
            estimates = self.lookups[bucket]
            for t in tokens:
                hit = int(t) == drafts[i]
                estimates.count(i, 1.0, float(hit))
                i += 1
                if not hit or i == len(drafts):
                    self.shadow = None
                    break
            else:
                self.shadow = (bucket, drafts, i)
        self.index.extend(tokens)

    def lookup_wins(self, match: Match, drafter_expected: float | None = None) -> bool:
        """Whether a one-branch cycle verifies the lookup rather than the drafter's path: the lookup is expected
        to commit at least as many tokens (`drafter_expected`: the drafter's, default its decayed mean)."""
        return self.expected(match) >= (self.drafter_tokens if drafter_expected is None else drafter_expected)

    def observe(self, match: Match | None, committed: Sequence[int], drafts: Sequence[int] | None) -> None:
        """Count a cycle: its lookup's outcome (`match`, None: none verified) and its drafter's (`drafts`, None: no
        drafter path verified) against the tokens it committed (the positions reached: those accepted and the
        first rejection)."""
        if drafts is not None:
            self.drafter_tokens = 0.8 * self.drafter_tokens + 0.2 * (leading_matches(drafts, committed[:-1]) + 1)
        if match is None:
            return
        self.shadow = None  # the verified lookup's outcome is counted instead
        accepted = leading_matches(match.tokens, committed[:-1])
        estimates = self.lookups[match_bucket(match.length)]
        for i in range(min(accepted + 1, len(match.tokens))):
            estimates.count(i, 1.0, float(i < accepted))
