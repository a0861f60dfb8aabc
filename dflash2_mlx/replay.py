"""Block-size policies replayed on recorded drafts: what `dflash_steps` would decide and how fast it would go,
without timing noise (T = 0).

A speculative generation's speed on a shared machine varies by 5-10% from one run to the next, more than most
policy changes are worth; a bench resolves them only over hours. At T = 0 everything the policy sees is fixed
by the target's greedy answer and the drafter's proposals along it, so both are recorded once (`record`: plain
decoding, and at every position the drafter's proposal from a block of each size asked), and any policy then
replays against a cost model in milliseconds (`replay`): the same calls in the same order as the decode loop
makes them, each cycle and plain step timed at the model's cost. The times are the model's, the decisions the
policy's own: a replay ranks policies (and block sizes) on the recorded answers, a bench confirms on the clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import mlx.core as mx

from .adaptive import AcceptanceEstimates, AdaptiveBlocks, BlockPolicy
from .batched_costs import BatchedCostModel, plan
from .costs import CostModel
from .drafter import DFlashDraftModel
from .sampling import SamplingParams
from .target import Target


@dataclass
class Trace:
    """A greedy answer and the drafter's proposals along it: `drafts[B][j]` are the B - 1 tokens the drafter
    proposes after `tokens[j]` (its anchor) from a block of B, given everything up to it, and `confidence[B][j]`
    its rows' confidences (`Proposal.confidence`; None in traces recorded without them: adaptive mode then
    verifies the blocks it chose)."""

    tokens: list[int]
    drafts: dict[int, list[list[int]]]
    confidence: dict[int, list[list[float]]] | None = None

    def matches(self, j: int, drafted: int, n: int) -> list[float]:
        """Whether each of the first n drafts after tokens[j] from a block of `drafted` is the answer's token (1.0)
        or not (0.0), never past the answer's end. A block not recorded (a fixed block cut short where max_tokens
        ends) reads the smallest recorded block above it."""
        drafts = self.drafts[min(b for b in self.drafts if b >= drafted)][j][:n]
        return [float(d == t) for d, t in zip(drafts, self.tokens[j + 1 :])]

    def confidences(self, j: int, drafted: int) -> mx.array | None:
        """The confidences of the block of `drafted` proposed after tokens[j] (None if not recorded)."""
        if self.confidence is None:
            return None
        return mx.array(self.confidence[min(b for b in self.confidence if b >= drafted)][j])

    def accepted(self, j: int, B: int, drafted: int) -> int:
        """Drafts a cycle anchored at tokens[j] accepts when it verifies the first B - 1 of a block of `drafted`:
        their leading matches with the answer (T = 0)."""
        matches = self.matches(j, drafted, B - 1)
        return matches.index(0.0) if 0.0 in matches else len(matches)


def record(
    target: Target,
    drafter: DFlashDraftModel,
    prompt: Iterable[int],
    max_tokens: int,
    blocks: Iterable[int],
    eos: Iterable[int] = (),
    walk: str = "greedy",
) -> Trace:
    """Greedy-decode `prompt` by plain steps (up to `max_tokens` tokens, or an `eos` token) and propose, at every
    token, a block of each size in `blocks` (each a drafter pass: this costs about 1 + 0.2 x len(blocks) plain
    steps per token)."""
    sizes, eos = sorted(set(blocks)), set(eos)
    if min(sizes) < 2:
        raise ValueError(f"block sizes start at 2 (an anchor and a draft), got {min(sizes)}")
    params = SamplingParams()
    tokens, drafts, confidence = [], {B: [] for B in sizes}, {B: [] for B in sizes}
    with target.capture() as tap:
        cache, draft_cache = target.make_cache(), drafter.make_cache()
        logits, context = tap.prefill(mx.array(list(prompt), mx.uint32), cache)
        anchor = mx.argmax(logits).astype(mx.uint32)
        while True:
            for i, B in enumerate(sizes):  # the first pass takes the new context in; the drafter keeps it
                fed = context[None] if i == 0 else context[None, :0]
                proposal = drafter.propose(drafter.input_block(anchor, B), fed, draft_cache, params, walk)
                drafts[B].append(proposal.tokens.tolist())  # read now: the drafter's cache moves on with the next
                confidence[B].append(proposal.confidence.tolist())
            tokens.append(anchor.item())
            if len(tokens) == max_tokens or tokens[-1] in eos:
                break
            logits, context = tap.forward(anchor.reshape(1), cache)
            anchor = mx.argmax(logits[-1]).astype(mx.uint32)
    return Trace(tokens, drafts, confidence)


@dataclass
class Replayed:
    """A policy's replay of one trace: seconds on the cost model, tokens committed, and how."""

    seconds: float = 0.0
    tokens: int = 1  # the prefill's token (its time is not counted: every policy pays it alike)
    plain_steps: int = 0  # tokens committed by plain steps (a cycle that verified no draft is one)
    probes: int = 0
    blocks: list[int] = field(default_factory=list)  # each cycle's block size (plain steps: not listed)
    accepted: list[int] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return (self.tokens - 1) / self.seconds if self.seconds else 0.0


def replay(trace: Trace, policy: BlockPolicy, costs: CostModel, max_tokens: int | None = None) -> Replayed:
    """Run `policy` over `trace` as `decode.dflash_steps` would with `max_tokens` (default: the answer's length;
    the answer ends there or at EOS): the same calls, in the same order, with the same arguments, each cycle and
    plain step timed at `costs` (a plain run's time includes its shadow probe)."""
    n, out = len(trace.tokens), Replayed()
    limit, step_s = max_tokens or n, costs.verify_s[0]
    if isinstance(policy, AdaptiveBlocks) and policy.block_max not in trace.drafts:
        raise ValueError(f"adaptive mode's cycles and probes propose blocks of {policy.block_max}: record them too")
    probe_s = costs.draft_s[policy.block_max - 2] if isinstance(policy, AdaptiveBlocks) else 0.0
    while out.tokens < n:
        B = policy.next_block(limit - out.tokens + 1)
        if B == 1:
            timed = None  # steps timed as the loop times them: from the first one read, then run by run
            while B == 1:
                produced = out.tokens
                run = policy.plain_run(limit - produced)
                scored = min(run, policy.block_max - 1)  # the shadow probe's drafts the run's tokens are matched with
                out.probes, out.seconds = out.probes + 1, out.seconds + probe_s
                for i in range(run):
                    out.tokens, out.plain_steps, out.seconds = out.tokens + 1, out.plain_steps + 1, out.seconds + step_s
                    if i == scored - 1:
                        single = trace.matches(produced - 1, policy.block_max, scored)
                        rows = trace.confidences(produced - 1, policy.block_max)
                        policy.observe_shadow(
                            [float(all(single[: k + 1])) for k in range(scored)],
                            single,
                            None if rows is None else rows.tolist(),
                        )
                    if out.tokens >= n:  # the loop's caller stops reading here
                        return out
                    timed = 0 if timed is None else timed + 1
                    if i == scored - 1 and i < run - 1 and policy.drafting_wins(limit - produced - i):
                        break
                if timed:
                    policy.observe_plain(timed, timed * step_s + probe_s, probes=1)
                timed = 0
                B = policy.next_block(limit - out.tokens + 1)
            # the step in flight commits its token; the cycle drafts from the next
            out.tokens, out.plain_steps, out.seconds = out.tokens + 1, out.plain_steps + 1, out.seconds + step_s
            if out.tokens >= n:
                return out
            B = max(2, min(B, limit - out.tokens + 1))
        drafted = policy.drafted_block(B)
        B = policy.verified_block(B, trace.confidences(out.tokens - 1, drafted), limit - out.tokens + 1)
        if B == 1:  # no draft verified: a plain step after the drafter pass, its token scoring the first draft
            seconds = costs.passes_s(1, drafted)
            policy.observe_unverified(trace.matches(out.tokens - 1, drafted, 1)[0], seconds)
            out.tokens, out.plain_steps, out.seconds = out.tokens + 1, out.plain_steps + 1, out.seconds + seconds
            continue
        a = trace.accepted(out.tokens - 1, B, drafted)
        seconds = costs.passes_s(B, drafted)
        policy.observe_cycle(B, a, seconds)
        out.tokens, out.seconds = min(n, out.tokens + a + 1), out.seconds + seconds
        out.blocks.append(B)
        out.accepted.append(a)
    return out


@dataclass
class BatchedReplayed:
    """A batched replay: seconds on the batched cost model, tokens committed over every request, and steps."""

    seconds: float = 0.0
    tokens: int = 0  # past each request's prefill token
    steps: int = 0
    cycles: int = 0  # steps in which at least one request verified drafts
    accepted: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def replay_batched(
    traces: list[Trace],
    concurrency: int,
    costs: BatchedCostModel,
    block_max: int,
    prior: list[float] | None,
    drafting: bool = True,
) -> BatchedReplayed:
    """The traces' answers decoded `concurrency` at a time as `batched.BatchedDecoder` decodes them with `costs`
    (T = 0): each request joins as one leaves, in the traces' order; every step's blocks are `batched_costs.plan`'s
    from each request's own acceptance estimates (the drafter card's `prior`, then its cycles, counted as the decoder
    counts them); each step is timed at `costs.step`. `drafting=False`: batched plain steps, every block 1.

    Args:
        traces: the recorded answers (their drafts recorded at blocks up to `block_max`).
        concurrency: the most requests decoded together.
        costs: the batched cost curve the steps are timed at and chosen by.
        block_max: the largest block a request verifies.
        prior: the drafter's acceptance by draft position (its card's), None: no counts.
        drafting: whether requests draft at all.
    """
    waiting, running, out = list(traces), [], BatchedReplayed()
    while waiting or running:
        while waiting and len(running) < concurrency:
            running.append([waiting.pop(0), 1, AcceptanceEstimates(block_max - 1, prior)])  # trace, produced, counts
        k = len(running)
        lefts = [len(trace.tokens) - produced + 1 for trace, produced, _ in running]
        blocks = [1] * k
        if drafting:
            blocks, _, _ = plan(costs, [e.estimates() for _, _, e in running], lefts, [True] * k, block_max)
        n, out.steps = max(blocks), out.steps + 1
        out.seconds += costs.step(k, n, sum(B > 1 for B in blocks))
        out.cycles += n > 1
        for r, B in zip(running, blocks):
            trace, produced, estimates = r
            a = 0
            if B > 1:
                a = trace.accepted(produced - 1, B, B)
                estimates.observe_block(a, B - 1)
                out.accepted += a
            r[1] = min(len(trace.tokens), produced + a + 1)
            out.tokens += r[1] - produced
        running = [r for r in running if r[1] < len(r[0].tokens)]
    return out
