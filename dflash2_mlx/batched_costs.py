"""What a batched step costs on this machine, and the choice it makes (`plan`): plain batched steps, or a batched
cycle (and which requests draft in it), by expected tokens per second over the batch.

The curve (`BatchedCostModel`) is the target's forward over n tokens for each of k requests, with the per-request
rollback that follows it (`batched.roll_back_rows`), and the drafter's pass; it is measured once per target,
drafter and machine (`batched.measure_batched_costs`) and cached beside the single-request curve (`costs.py`).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .adaptive import expected_tokens
from .costs import cost_key


@dataclass
class BatchedCostModel:
    """Seconds per batched step part on one machine.

    Args:
        forward_s: `forward_s[k - 1][n - 1]` is a target forward over n tokens for each of k requests, with the
            rollback of each request's rows after it (n = 1: a plain batched step).
        draft_s: `draft_s[B - 2]` is one drafter pass for a block of B (one request).
        draft_batch: `draft_batch[j - 1]` is one drafter pass over j requests' blocks (`propose_batch`), in passes
            for one request; past the measured j, in proportion to j. None (a curve measured before): j passes.
    """

    forward_s: list[list[float]]
    draft_s: list[float]
    draft_batch: list[float] | None = None

    @property
    def batch_max(self) -> int:
        return len(self.forward_s)

    @property
    def block_max(self) -> int:
        return len(self.forward_s[0])

    def forward(self, k: int, n: int) -> float:
        """Seconds of a forward over n tokens for each of k requests; past the measured batch, scaled from the
        largest measured one in proportion to k."""
        K = min(k, self.batch_max)
        return self.forward_s[K - 1][n - 1] * k / K

    def drafting(self, n: int, j: int) -> float:
        """Seconds of the drafter pass of j requests drafting blocks of n."""
        if not j or n < 2:
            return 0.0
        if self.draft_batch is None:
            return j * self.draft_s[n - 2]
        J = min(j, len(self.draft_batch))
        return self.draft_s[n - 2] * self.draft_batch[J - 1] * j / J

    def step(self, k: int, n: int, drafting: int) -> float:
        """Seconds of a batched step: the forward over n tokens for k requests and the drafter pass of `drafting`
        of them."""
        return self.forward(k, n) + self.drafting(n, drafting)


def plan(
    costs: BatchedCostModel,
    acceptances: Sequence[Sequence[float]],
    lefts: Sequence[int],
    drafting: Sequence[bool],
    block_max: int,
    lookups: Sequence[bool] | None = None,
) -> tuple[list[int], float, float]:
    """Each request's block for the next batched step, by expected tokens per second over the batch.

    A step's forward is padded to its longest block n, so a request that drafts verifies n (or what it has
    left); a request drafts where its expected extra tokens pay for its share of the drafter pass, and one whose
    drafts come from a lookup (no drafter pass) wherever it verifies a block at all. Every n and every count of
    the drafter's requests with the most to gain is priced; a plain step (every block 1) wins ties.

    Args:
        costs: the measured batched costs.
        acceptances: per request, P(draft i accepted | drafts before it accepted), by position.
        lefts: per request, the largest block it may verify (a lookup's: its drafts and the anchor).
        drafting: per request, whether it has drafts to verify (a drafter or a lookup's).
        block_max: the largest block.
        lookups: per request, whether its drafts come from a lookup (default: none do).

    Returns:
        (each request's block, the step's expected tokens per second, a plain step's).
    """
    k = len(acceptances)
    lookups = lookups or [False] * k
    plain = k / costs.forward(k, 1)
    best, best_rate = [1] * k, plain
    for n in range(2, min(block_max, costs.block_max) + 1):
        gains = [
            (expected_tokens(acc, min(n, left)) - 1.0, i)
            for i, (acc, left, d) in enumerate(zip(acceptances, lefts, drafting))
            if d and left > 1
        ]
        free = {i for _, i in gains if lookups[i]}
        paid = sorted(((g, i) for g, i in gains if i not in free), reverse=True)
        tokens = k + sum(g for g, i in gains if i in free)
        for j in range(len(paid) + 1):
            if j:
                tokens += paid[j - 1][0]
            if not j and not free:
                continue
            rate = tokens / costs.step(k, n, j)
            if rate > best_rate:
                chosen = free | {i for _, i in paid[:j]}
                best = [min(n, lefts[r]) if r in chosen else 1 for r in range(k)]
                best_rate = rate
    return best, best_rate, plain


def cycles_pay(costs: BatchedCostModel, estimates: Sequence[float], block_max: int, concurrency: int) -> bool:
    """Whether `plan` runs a batched cycle rather than a plain batched step for some batch of 2..`concurrency`
    requests, each drafting with acceptance `estimates` by position and far from its max_tokens."""
    for k in range(2, min(concurrency, costs.batch_max) + 1):
        blocks, _, _ = plan(costs, [estimates] * k, [1 << 30] * k, [True] * k, block_max)
        if max(blocks) > 1:
            return True
    return False


def batch_points(batch_max: int) -> list[int]:
    """The batch sizes timed: powers of two up to batch_max, and batch_max."""
    return sorted({*(2**i for i in range(batch_max.bit_length()) if 2**i <= batch_max), batch_max})


def block_points(block_max: int) -> list[int]:
    """The forward sizes timed: 1..4, every fourth after, and block_max."""
    return sorted({*range(1, min(block_max, 4) + 1), *range(4, block_max + 1, 4), block_max})


def grid(ks: list[int], ns: list[int], seconds: dict, batch_max: int, block_max: int) -> list[list[float]]:
    """The timed (k, n) points interpolated to every k <= batch_max and n <= block_max, never falling with n."""
    rows = [list(itertools.accumulate((seconds[k, n] for n in ns), max)) for k in ks]
    by_n = [np.interp(np.arange(1, block_max + 1), ns, row) for row in rows]  # [len(ks), block_max]
    table = np.array([np.interp(np.arange(1, batch_max + 1), ks, column) for column in np.array(by_n).T]).T
    return [[float(s) for s in row] for row in table]


def batched_cost_key(target, drafter, block_max: int, batch_max: int) -> str:
    """The cache key of a batched cost model: the single-request curve's key, marked batched, with its batch."""
    return f"batched k<={batch_max}, drafter passes batched | {cost_key(target, drafter, block_max)}"


def read_batched_costs(path: str) -> BatchedCostModel:
    """A batched cost model from a JSON file ({"forward_s": [[...], ...], "draft_s": [...]}): a replay's `--costs`."""
    with open(path) as f:
        return BatchedCostModel(**json.load(f))
