"""Choosing the block size of each cycle: oMLX's `adaptive` verify mode.

Speculative decoding pays off only when a cycle commits more tokens than the time it costs would have
bought by plain decoding. That needs two numbers per block size B on this machine and with this drafter:

- its cost: one drafter pass plus one target pass over B tokens plus the loop's own work (`CostModel`:
  the target's forward time for 1..B tokens, measured once per model, drafter and machine and cached on
  disk, then corrected online by the cycles actually timed);
- its yield: 1 + sum over i of P(drafts 1..i all accepted), from running per-position acceptance
  estimates (exponentially decayed, so a drafter that stops being right is noticed within a few cycles).

`AdaptiveBlocks` picks the B with the most committed tokens per second, B = 1 meaning plain steps, and
while drafting drafts on as long as its cycles' own confidences say they gain on plain steps. The
estimates start from the drafter card's held-out acceptance by position (neutral without a card). While
plain steps win it runs them block_max at a time, each run after a shadow probe: one drafter pass (a fifth
of a target step or less), whose drafts are scored against the tokens the run then commits (the run ends
there if they say drafting pays), so a drafter that starts accepting again is noticed within a run or two at
a fraction of a verify's cost. The runs are pipelined from one to the next (`decode.dflash_steps`). The choice
reads only committed tokens and the drafter's own outputs, and only decides how many drafts a cycle
verifies (each cycle's drafter pass proposes a block of block_max, the size the estimates describe: see
`AdaptiveBlocks.drafted_block`): every committed token is still the target's, so any choice is lossless.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from .assets import cache_dir
from .kernels import backend_name
from .runtime import blas
from .sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class CostModel:
    """Seconds per cycle part on one machine: `verify_s[n - 1]` is a target forward over n tokens (n = 1 is
    a plain decoding step), `draft_s[B - 2]` one drafter pass for a block of B. The verify curve may reach
    past the largest block (a token tree verifies more tokens than its depth)."""

    verify_s: list[float]
    draft_s: list[float]

    @property
    def block_max(self) -> int:
        return len(self.draft_s) + 1

    def passes_s(self, B: int, drafted: int | None = None) -> float:
        """A cycle's two passes verifying a block of B, the drafter's over a block of `drafted` (default B: it
        proposes only what is verified). B = 1: one plain step, after a drafter pass only if `drafted` is given (a
        cycle that verified none of its drafts)."""
        return self.verify_s[B - 1] + (self.draft_s[(drafted or B) - 2] if drafted or B > 1 else 0.0)

    def curve(self) -> list[tuple[int, float]]:
        """(n, target forward over n tokens / a plain step): the verify cost curve."""
        return [(n, s / self.verify_s[0]) for n, s in enumerate(self.verify_s, 1)]


def _best_seconds(fns: list, repeats: int) -> list[float]:
    """The fastest of `repeats` timed calls of each of `fns`, after a warm-up call of each: what the machine can
    do, with the noise of other work on it left out (the decode loop corrects for a busy machine online). The
    calls go in rounds, every fn once per round, so that a machine that slows down during the measurement
    (another job starting) weighs on every size alike instead of bending the curve."""
    for fn in fns:
        fn()  # warm-up (compilation, allocation)
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            tic = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - tic)
    return best


MEASURE_CONTEXT_TOKENS = 64


def verify_points(block_max: int, verify_max: int) -> list[int]:
    """The forward sizes timed for a verify curve to `verify_max` tokens: every n up to block_max, then every
    fourth and the last (the curve is smooth there; it is interpolated in between)."""
    return sorted({*range(1, block_max + 1), *range(block_max + 4, verify_max, 4), verify_max})


def _interpolate(points: list[int], seconds: list[float]) -> list[float]:
    """seconds at every n in points[0]..points[-1], linear between the timed points."""
    return [float(s) for s in np.interp(np.arange(points[0], points[-1] + 1), points, seconds)]


def measure_costs(target, drafter, block_max: int, context_tokens: int = MEASURE_CONTEXT_TOKENS,
                  repeats: int = 5, verify_max: int | None = None) -> CostModel:
    """Time the target's forward over 1..verify_max tokens (default block_max) and the drafter's pass up to
    block_max, after a prefill of `context_tokens` tokens (each the best of `repeats`; a few dozen forwards in
    all). A forward over more tokens never costs less than one over fewer: timing noise that says otherwise is
    flattened out."""
    verify_max = max(block_max, verify_max or block_max)
    vocab = target.vocab_size
    tokens = mx.array([(7 + 31 * i) % vocab for i in range(context_tokens + verify_max)], mx.uint32)
    cache, plain_cache = target.make_cache(), target.make_cache()
    with target.capture() as tap:
        _, context = tap.prefill(tokens[:context_tokens], cache)
        tap.prefill(tokens[:context_tokens], plain_cache)
        mx.eval(context, [c.state for c in plain_cache])

        def verify(n):
            fed = tokens[context_tokens : context_tokens + n]
            if n == 1:  # a plain step stays (rotating caches cannot undo a 1-token update past their window): it
                # runs on a cache of its own, so the verify passes timed between plain steps are undone exactly
                mx.eval(tap.forward(fed, plain_cache))
                return
            verified = tap.verify(fed, cache)
            mx.eval(verified.logits, verified.features)
            tap.rollback(cache, verified, 0)

        def draft(B):
            block = drafter.input_block(tokens[context_tokens], B)
            mx.eval(drafter.propose(block, context[None], drafter.make_cache(), SamplingParams()).tokens)

        points = verify_points(block_max, verify_max)
        draft_sizes = sorted({2, block_max})  # the drafter's pass grows little with B: timed at the ends only
        seconds = _best_seconds([partial(verify, n) for n in points] + [partial(draft, B) for B in draft_sizes],
                                repeats)
    verify_s = _interpolate(points, list(itertools.accumulate(seconds[: len(points)], max)))
    draft_s = _interpolate(draft_sizes, list(itertools.accumulate(seconds[len(points) :], max)))
    return CostModel(verify_s, draft_s)


def _cache_file() -> Path:
    """Where measured costs are kept: $DFLASH2_COSTS, else costs.json in the package's cache folder."""
    return Path(os.environ.get("DFLASH2_COSTS") or cache_dir() / "costs.json")


def cost_key(target, drafter, block_max: int, verify_max: int | None = None) -> str:
    """What the costs depend on: the target and its dtype, the drafter's size and dtype, the machine."""

    cfg = drafter.config
    weight = target.embed_tokens.weight
    parts = [
        target.fingerprint(), str(weight.dtype), target.model_type, str(target.num_layers),
        f"drafter {cfg.num_hidden_layers}x{cfg.hidden_size} {drafter.norm.weight.dtype} "
        f"{drafter.kind}",
        f"B<={block_max}" + (f" verify<={verify_max}" if verify_max and verify_max > block_max else ""),
        platform.machine(), platform.processor() or "", str(os.cpu_count()),
        "metal" if mx.metal.is_available() else "cpu", blas(), backend_name(drafter.metal_kernels), mx.__version__,
    ]
    return " | ".join(parts)


def _read_costs(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _write_costs(path: Path, known: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, path)


def load_or_measure_costs(target, drafter, block_max: int, verify_max: int | None = None) -> CostModel:
    """The cached cost model of this target, drafter and machine (blocks up to block_max, the verify curve
    up to verify_max tokens), measured (and cached) if missing."""
    key, path = cost_key(target, drafter, block_max, verify_max), _cache_file()
    known = _read_costs(path)
    if key in known:
        return CostModel(**known[key])
    logger.info("measuring this machine's cycle costs for %s (once; cached in %s)", target.model_type, path)
    costs = measure_costs(target, drafter, block_max, verify_max=verify_max)
    _write_costs(path, {**known, key: asdict(costs)})
    return costs


def forget_costs(target, drafter, block_max: int) -> None:
    """Drop the cached costs of this target, drafter and machine: the next `load_or_measure_costs` (the next
    generation, or a server's next start) measures them again."""
    key, path = cost_key(target, drafter, block_max), _cache_file()
    known = _read_costs(path)
    if known.pop(key, None) is not None:
        logger.info("the cached cycle costs of %s no longer match this machine; they will be measured again "
                    "where they are next loaded", target.model_type)
        _write_costs(path, known)


# A drafter's confidences start as if calibrated, worth this many verified drafts per position.
CALIBRATION_PRIOR = 2.0

# A timing run's plain steps (see AdaptiveBlocks): the first waits for the cycle before it, the two after it are
# timed. Each step of it, where drafting pays, is a step not drafted: on the kept chat answers a run of 8 cost 1-4%
# of the mean (`runs/README.md`), a run of 3 half of that.
TIMING_STEPS = 3

# While running plain steps, a cycle's cost above a plain step counts at this share of it (see AdaptiveBlocks): on the
# 24 kept answers replayed on four cost curves (`runs/README.md`), 0.85 lowered no curve's mean by more than 0.2% and
# raised that of the one dearest at two tokens (1.26 plain steps) by 1.7% (long) and 1.9% (chat), where the averaged
# estimates put drafting just under plain steps; 0.75-0.9 read alike.
ENTRY_DISCOUNT = 0.85

# Timed plain steps (or cycles, relative to them) this many times off the measured costs mean the
# measurement no longer describes the machine (made while it was busy, or before an upgrade).
STALE_RATIO = 2.0


class FixedBlocks:
    """`--verify-mode dflash`: every cycle at the runtime block size (smaller only where max_tokens ends)."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def next_block(self, left: int | None) -> int:
        return self.block_size if left is None else max(2, min(self.block_size, left))

    def drafted_block(self, B: int) -> int:
        """The block the drafter proposes for a cycle verifying B: B itself (oMLX's runtime block size)."""
        return B

    def verified_block(self, B: int, confidence: mx.array | None, left: int | None) -> int:
        """The block a cycle verifies once its drafts are drawn: B, always."""
        return B

    def plain_run(self, left: int | None) -> int:
        raise AssertionError("fixed blocks never choose plain steps")

    def observe_cycle(self, B: int, accepted: int, seconds: float) -> None:
        pass

    def observe_plain(self, steps: int, seconds: float, probes: int = 0) -> None:
        pass


class AdaptiveBlocks:
    """Per cycle, the block size (1 = plain steps) with the most expected committed tokens per second.

    The acceptance estimates: per draft position, P(draft i accepted | drafts 1..i-1 accepted), from
    exponentially decayed counts (`decay` per observation) of what cycles accepted and of what shadow probes
    would have accepted, each shrunk toward the previous position's estimate (the first toward 1/2) by
    `shrink` observations' worth. `prior` (the drafter card's held-out acceptance by position) seeds the
    counts with `prior_weight` observations; without one they start empty (neutral). The same counts decayed
    by `recent_decay` say what the last observation or two say, so that a turn in the text (a passage copied
    from the prompt begins or ends, a repetition loop) is followed within a cycle or two while a steady text
    is judged on the longer memory. The two errors are not alike: a plain run where drafting would pay loses
    most of what drafting wins over it, a cycle that accepts little loses only its price over a plain step. So
    while running plain steps the recent memory starts drafting wherever it says so; while drafting the long
    memory decides, and is replaced by the recent one at a turn: cycles in a row that accepted less than the
    long memory gave them a `turn_p` chance of (a drafter right half the time often misses twice in a row, one
    right every time does not). Where a cycle's drafts were unsure (their calibrated confidences, see
    `verified_block`, expected less than the long memory), its chance is taken on them: a miss the drafter
    saw coming is no sign of a turn.

    The estimates average over cycles; a cycle is worth more than that average says, since it verifies only as
    many drafts as its own confidences pay for, none where even the first is not worth it (`verified_block`). So
    while drafting, drafting also goes on as long as the expected gains over plain steps (committed tokens beyond
    what plain steps commit in the same time, at the best choice on the calibrated confidences) of the cycles and
    of the shadow probes' blocks average above zero (`gain`, decayed by `gain_decay` per drafter pass, forgotten
    at a turn): a drafter right now and then, and sure of it when it is, drafts on where the averaged estimates
    would run plain steps, each unsure cycle costing a drafter pass. The probes' blocks count so that the gains
    sample plain stretches too, not only the cycles the estimates chose to draft. For the same reason the way
    in is priced lower than the estimates price a cycle: while running plain steps, a cycle's cost above a plain
    step (its drafter pass and the verify's extra tokens) counts at `entry_discount` of it, so drafting is tried
    where the averaged estimates put it a little under plain steps. Trying costs little: the cycle's own
    confidences decide how much it verifies, and its gains whether drafting goes on.

    A position a cycle verified counts its outcome blended with its calibrated confidence, up to
    `confidence_weight` of the latter: a 0 or 1 says little about a probability, the drafter's own
    confidence much more (the bundled drafter's first draft is accepted 7% of the time where its row's top
    probability is under 0.2, 88% where it is over 0.8), so a few unlucky cycles of a drafter sure of itself
    no longer turn it off, nor do a few lucky ones of an unsure one keep it on. The blend trusts the
    calibration only as far as it is measured (weight x measured / (measured + CALIBRATION_PRIOR) verified
    drafts at that position); the recent memory counts outcomes alone (it is what notices a turn), and at a
    turn the calibration keeps only what the cycles that fell short say: a drafter still sure of itself past
    a turn is wrong, and its confidences count for nothing until they are right again.

    Plain steps come in runs of `shadow_run` (default block_max), each started by a shadow probe (see
    `decode.dflash_steps`): one drafter pass proposing the next block, scored once the run has committed its
    tokens (`sampling.draft_acceptance`). A probe costs a drafter pass, not a verify, so plain stretches keep
    gathering evidence and are never longer than one run without a decision. Where a run follows a run
    (drafting still behind), the run doubles, up to `shadow_max` (default 3 x shadow_run); a cycle brings it
    back to `shadow_run`. Where drafting does not pay, the probes are all it costs: a probe per 8 plain steps
    is 2-3% of the time on a CPU, one per 24 under 1%, while a stretch where it pays (a passage copied from the
    prompt) is still found within a run or two. Positions past a probe's first
    rejection count with weight `past_rejection` (a cycle never sees them). `timing_steps`: a plain run of
    that many steps (default TIMING_STEPS; 0: none) after `timing_after` cycles (default 2 x block_max)
    where no plain step has been timed yet: it times plain steps on this generation's clock, so that the cost
    curve's shape (cycles against plain steps) is corrected online even where drafting wins from the start
    and no plain step would otherwise be timed. Taken after the cycles, not before them, it costs a short
    answer nothing; most generations time plain runs of their own before it is due."""

    def __init__(self, costs: CostModel, block_max: int, prior: Sequence[float] | None = None,
                 prior_weight: float = 3.0, decay: float = 0.8, recent_decay: float = 0.3, shrink: float = 1.0,
                 past_rejection: float = 0.25, shadow_run: int | None = None, timing_steps: int | None = None,
                 shadow_max: int | None = None, turn_p: float = 0.03, timing_after: int | None = None,
                 calibration_decay: float = 0.95, confidence_weight: float = 0.5, gain_decay: float = 0.95,
                 entry_discount: float = ENTRY_DISCOUNT):
        if block_max > costs.block_max:
            raise ValueError(f"the cost model covers blocks up to {costs.block_max}, not {block_max}")
        self.costs, self.block_max, self.decay, self.shrink = costs, block_max, decay, shrink
        self.past_rejection, self.shadow_run = past_rejection, shadow_run or block_max
        self.timing_steps = TIMING_STEPS if timing_steps is None else timing_steps
        self.timing_after = 2 * block_max if timing_after is None else timing_after
        self.turn_p, self.shortfall, self.reference = turn_p, 1.0, None  # see observe_cycle
        self.cycles = 0  # cycles so far (the timing run is due after timing_after of them)
        self.shadow_max = shadow_max or 3 * self.shadow_run
        self.run = self.shadow_run  # the next plain run's length
        n = block_max - 1
        prior = [] if prior is None else list(prior)[:n]
        # decayed counts per draft position: accepted (or expected to be) ...
        self.hits = [prior_weight * float(a) for a in prior] + [0.0] * (n - len(prior))
        self.seen = [prior_weight] * len(prior) + [0.0] * (n - len(prior))  # ... and reached
        self.recent_hits, self.recent_seen, self.recent_decay = list(self.hits), list(self.seen), recent_decay
        self.drafting = False  # the last choice: drafting (True) or plain steps
        # the drafter passes' expected gains over plain steps (committed tokens, `_best`; cycles' and probes'): their
        # sum and their count, each decayed by `gain_decay` per pass (`gain`: their mean); none counted after a turn
        self.gain_sum, self.gain_n, self.gain_decay = 0.0, 0.0, gain_decay
        self.entry_discount = entry_discount  # while running plain steps: a cycle's cost above a plain step
        # observed / measured seconds (the loop's own work, a longer context, a busy machine); None until seen
        self.scale_draft: float | None = None
        self.scale_plain: float | None = None
        # A cycle right after plain steps (or the prefill) also feeds the drafter all their rows at once, and
        # the first cycle at a block size traces it: one-off costs the cycles after it do not pay.
        self.after_plain, self.traced = True, set()
        # per draft position, decayed by `calibration_decay` over verified drafts (a drafter's calibration
        # changes less with the text than its acceptance does): accepted, the confidence they were verified on
        # (CALIBRATION_PRIOR observations of a calibrated drafter to start) and how many were measured; the
        # same sums over the cycles that fell short in a row (see `observe_cycle`); the last cycle's confidences
        self.calibration_decay, self.confidence_weight, self.confidence = calibration_decay, confidence_weight, None
        self.confident_hits, self.confident_sum = [CALIBRATION_PRIOR] * n, [CALIBRATION_PRIOR] * n
        self.calibrated_n, self.shortfall_calibration = [0.0] * n, {}

    def acceptance(self, recent: bool = False) -> list[float]:
        """Estimated P(draft i accepted | drafts before it accepted), i = 1..block_max-1 (`recent`: from the
        counts with the short memory)."""
        # the shrinkage weighs as much against each memory's own full count (1 / (1 - decay) observations)
        shrink = self.shrink * ((1 - self.decay) / (1 - self.recent_decay) if recent else 1.0)
        estimates, previous = [], 0.5
        for h, s in zip(*((self.recent_hits, self.recent_seen) if recent else (self.hits, self.seen))):
            previous = (h + shrink * previous) / (s + shrink)
            estimates.append(previous)
        return estimates

    @property
    def gain(self) -> float | None:
        """The mean expected gain over plain steps of a cycle drafting where the last cycles and probes drafted, in
        committed tokens per cycle (decayed; None: none counted since the start or the last turn)."""
        return self.gain_sum / self.gain_n if self.gain_n else None

    def decisive(self) -> list[float]:
        """The estimates a choice is made on: drafting, the long memory's (which a turn resets, see
        `observe_cycle`); running plain steps, per position the higher of the two memories'."""
        if self.drafting:
            return self.acceptance()
        return [max(a, b) for a, b in zip(self.acceptance(), self.acceptance(recent=True))]

    def expected_tokens(self, B: int, acceptance: Sequence[float] | None = None) -> float:
        """Committed tokens a cycle at B is expected to give: the bonus plus each accepted draft (by
        `acceptance`, default the long memory's estimates)."""
        total, run = 1.0, 1.0
        for a in (self.acceptance() if acceptance is None else acceptance)[: B - 1]:
            run *= a
            total += run
        return total

    def seconds(self, B: int, entering: bool = False) -> float:
        """Expected seconds of a cycle at B (B = 1: a plain step with its share of a shadow probe): the
        measured passes, scaled as observed (by the other kind's scale until one of this kind is seen, so the
        two stay comparable). `entering` (deciding while running plain steps): a cycle's cost above a plain step
        counts at `entry_discount` of it."""
        if B == 1:
            return (self.costs.passes_s(1) + self.probe_s / self.run) * self._scale(self.scale_plain, self.scale_draft)
        cycle = self.cycle_seconds(B)
        if not entering:
            return cycle
        plain = self.costs.passes_s(1) * self._scale(self.scale_draft, self.scale_plain)  # on the cycles' clock
        return plain + self.entry_discount * (cycle - plain)

    def cycle_seconds(self, B: int) -> float:
        """Expected seconds of a drafting cycle verifying B tokens: the anchor and B - 1 drafts (B = 1: none, a
        plain step after the drafter pass)."""
        return self.costs.passes_s(B, self.drafted_block(B)) * self._scale(self.scale_draft, self.scale_plain)

    @staticmethod
    def _scale(own: float | None, other: float | None) -> float:
        return own if own is not None else other if other is not None else 1.0

    def rates(self, top: int, entering: bool = False) -> dict[int, float]:
        """Expected committed tokens per second at each block size 1..top, on the decisive estimates (`entering`:
        a cycle priced as while running plain steps, see `seconds`)."""
        acceptance = self.decisive()
        return {B: self.expected_tokens(B, acceptance) / self.seconds(B, entering) for B in range(1, top + 1)}

    @staticmethod
    def drafting_vs_plain(rates: dict[int, float]) -> float:
        """The best drafting rate (blocks 2 and up) of `rates` (from `rates()`) over plain steps' rate."""
        return max(rates[b] for b in rates if b > 1) / rates[1]

    def _top(self, left: int | None) -> int:
        """The largest block a cycle may take with `left` tokens to go (1: plain steps only)."""
        return self.block_max if left is None else max(1, min(self.block_max, left))

    def next_block(self, left: int | None) -> int:
        top = self._top(left)
        if top == 1 or self._timing_due():
            return 1
        rates = self.rates(top, entering=not self.drafting)
        B = max(rates, key=rates.get)
        if B == 1 and self.drafting and (self.gain or 0.0) > 0:  # the cycles gain: draft on
            B = max((b for b in rates if b > 1), key=rates.get)
        self.run = min(2 * self.run, self.shadow_max) if B == 1 and not self.drafting else self.shadow_run
        self.drafting = B > 1
        return B

    def _timing_due(self) -> bool:
        """Whether the next plain run is the timing run: no plain step timed yet, after `timing_after` cycles."""
        return bool(self.timing_steps) and self.cycles >= self.timing_after

    @property
    def probe_s(self) -> float:
        """A shadow probe's measured cost: one drafter pass over a block of block_max."""
        return self.costs.draft_s[self.block_max - 2]

    def drafted_block(self, B: int) -> int:
        """The block the drafter proposes for a cycle verifying B: always block_max, the first B - 1 drafts
        verified. A block's rows attend to one another, so a drafter's drafts depend on the size of the block
        they are proposed in: the estimates describe blocks of block_max (every probe proposes one), and a
        drafter trained at that size drafts best there (`runs/README.md`: the bundled drafter's first draft is
        accepted more often from a block of 8 than of 2 on seven of the eight long prompts). The larger pass
        costs a little more, which `seconds` counts."""
        return self.block_max

    def verified_block(self, B: int, confidence: mx.array | None, left: int | None) -> int:
        """The block a drafting cycle verifies, chosen once its drafts are drawn (B: the block `next_block`
        chose): the one, up to the largest `left` allows, whose expected committed tokens exceed most what
        plain steps would commit in the same time, each draft expected accepted with its row's confidence
        (`Proposal.confidence`, read here: the cycle's second host read) as calibrated by the cycles so far.
        The estimates say whether to draft; the drafter's own confidence says how far this block is worth
        verifying, which varies from cycle to cycle far more than any average does (the bundled drafter's
        first drafts along the 24 answers `dflash2 bench --replay` keeps: accepted 7% of the time where its
        row's top probability is under 0.2, 88% where it is over 0.8). Where even the first draft is not worth
        what it adds to the verify, none is (1): the cycle is a plain step from its anchor, the drafter pass
        spent, and the token it commits scores the first draft (`observe_unverified`), so the first position's
        estimate stays unbiased by the choice. Choosing on the rows' distributions, never on what was drawn from
        them, keeps the acceptance rule exact at any temperature."""
        if confidence is None:
            return B
        top = max(2, self._top(left))
        rows = confidence[: top - 1].tolist()
        if not all(math.isfinite(c) for c in rows):  # non-finite drafts accept nothing: verify the fewest
            return 2
        self.confidence = rows
        best, gain = self._best(rows)
        self._count_gain(gain)
        return best

    def _best(self, rows: Sequence[float]) -> tuple[int, float]:
        """(the block to verify, its expected gain over plain steps in committed tokens) for drafts whose rows have
        these confidences (`verified_block`)."""
        plain_rate = 1.0 / self.seconds(1)
        best, best_gain, expected, reach = 1, 1.0 - plain_rate * self.cycle_seconds(1), 1.0, 1.0
        for n, p in enumerate(self.calibrated(rows), start=1):
            reach *= p
            expected += reach
            gain = expected - plain_rate * self.cycle_seconds(n + 1)
            if gain > best_gain:
                best, best_gain = n + 1, gain
        return best, best_gain

    def _count_gain(self, gain: float) -> None:
        """Count a drafter pass's expected gain (`_best`) among the cycles' (see `gain`): once a first draft has
        measured the calibration it rests on, so that a drafter sure of wrong drafts from the start is not taken at
        its word for long."""
        if self.calibrated_n[0] >= 1.0:
            self.gain_sum = self.gain_decay * self.gain_sum + gain
            self.gain_n = self.gain_decay * self.gain_n + 1.0

    def calibrated(self, confidence: Sequence[float]) -> list[float]:
        """Per draft position, P(accepted | the drafts before it accepted) that a row's confidence says, scaled by
        how often the confidences verified at that position so far came true (`confident_hits / confident_sum`)."""
        return [min(1.0, c * h / s) for c, h, s in zip(confidence, self.confident_hits, self.confident_sum)]

    def drafting_wins(self, left: int | None) -> bool:
        """Whether a cycle now beats plain steps on the estimates a choice is made on: a plain run whose probe
        says so (its score is read once the probe's drafts are matched) ends there."""
        top = self._top(left)
        return top > 1 and self.drafting_vs_plain(self.rates(top, entering=True)) > 1

    def plain_run(self, left: int | None) -> int:
        """Plain steps to take (the first of them after a shadow probe) before the next choice."""
        run = self.timing_steps if self._timing_due() else self.run
        self.after_plain, self.shortfall, self.reference = True, 1.0, None
        return run if left is None else max(1, min(run, left))

    def observe_cycle(self, B: int, accepted: int, seconds: float) -> None:
        """Its acceptance always counts; its time only for a steady cycle (see `after_plain`): a cycle's
        one-off costs would otherwise make every block look dearer than it is, and keep the drafter off."""
        reached = min(accepted + 1, B - 1)  # positions reached: the accepted ones and the first rejection
        calibrated = None if self.confidence is None else self.calibrated(self.confidence)
        # the chance of accepting no more than this cycle did, on the long memory as it stood before the first
        # of the cycles in a row that fell short (below the median): those cycles' joint chance is `shortfall`
        # (or on this cycle's calibrated confidences, where they expected less: a miss it saw coming is no surprise)
        reference = self.reference or self.acceptance()
        expected = reference if calibrated is None else [min(a, p) for a, p in zip(reference, calibrated)]
        at_most = 1.0 - math.prod(expected[:reached]) if accepted < B - 1 else 1.0
        self.shortfall, self.reference = (self.shortfall * at_most, reference) if at_most < 0.5 else (1.0, None)
        outcomes = [float(i < accepted) for i in range(reached)]
        for i, hit in enumerate(outcomes):
            self._count(i, 1.0, hit if calibrated is None else self._blend(i, hit, calibrated[i]), recent_hits=hit)
        if self.confidence is not None:
            self._calibrate(outcomes)
        if self.shortfall < self.turn_p:  # a turn: the older evidence describes another text
            self.hits, self.seen = list(self.recent_hits), list(self.recent_seen)
            self.shortfall, self.reference, self.gain_sum, self.gain_n = 1.0, None, 0.0, 0.0
            for i, (hits, total) in self.shortfall_calibration.items():  # and the confidences as far as they held
                self.confident_hits[i], self.confident_sum[i], self.calibrated_n[i] = hits, total, 0.0
        self._time_cycle(B, seconds)

    def observe_unverified(self, first: float, seconds: float) -> None:
        """A cycle that verified none of its drafts (`verified_block` chose 1: a plain step after the drafter
        pass), its first draft scored against the token it committed (`first`, `sampling.draft_acceptance`: at
        T = 0 whether they match): the first position counts as if it had been verified, so leaving unsure drafts
        unverified biases no estimate. No sign of a turn: the drafter saw the miss coming."""
        self._count(0, 1.0, self._blend(0, first, self.calibrated(self.confidence)[0]), recent_hits=first)
        self._calibrate([first])
        self._time_cycle(1, seconds)

    def _time_cycle(self, B: int, seconds: float) -> None:
        """Count a cycle that verified B tokens, and its time if it was steady (see `observe_cycle`)."""
        self.cycles += 1
        if not self.after_plain and B in self.traced:
            self.scale_draft = self._mix(self.scale_draft, seconds / self.costs.passes_s(B, self.drafted_block(B)))
        self.after_plain = False
        self.traced.add(B)

    def _blend(self, i: int, hit: float, calibrated: float) -> float:
        """Position i's count for a cycle: its outcome `hit`, blended with its `calibrated` confidence by up to
        `confidence_weight`, as far as the calibration at i is measured rather than assumed."""
        weight = self.confidence_weight * self.calibrated_n[i] / (self.calibrated_n[i] + CALIBRATION_PRIOR)
        return (1 - weight) * hit + weight * calibrated

    def _calibrate(self, outcomes: Sequence[float]) -> None:
        """Calibrate the confidences the last cycle drafted on at the positions it reached, each accepted or not
        (`outcomes`, 1 or 0; an unverified draft's score); while cycles fall short in a row (`shortfall` < 1)
        their own sums are kept apart too, for a turn."""
        if self.shortfall == 1.0:
            self.shortfall_calibration = {}
        for i, hit in enumerate(outcomes):
            confidence = self.confidence[i]
            self.confident_hits[i] = self.calibration_decay * self.confident_hits[i] + hit
            self.confident_sum[i] = self.calibration_decay * self.confident_sum[i] + confidence
            self.calibrated_n[i] = self.calibration_decay * self.calibrated_n[i] + 1.0
            if self.shortfall < 1.0:
                hits, total = self.shortfall_calibration.get(i, (0.0, 0.0))
                self.shortfall_calibration[i] = (hits + hit, total + confidence)
        self.confidence = None

    def observe_shadow(self, chain: Sequence[float], single: Sequence[float],
                       confidence: Sequence[float] | None = None) -> None:
        """A shadow probe's score (`sampling.draft_acceptance`): chain[i] = P(drafts 1..i+1 accepted),
        single[i] = position i+1's acceptance on its own. Position i is reached with P(chain[i-1]), where it
        counts in full; past a rejection it counts with weight `past_rejection`. `confidence`: its rows'
        (`Proposal.confidence`): what a cycle drafting there expected to gain counts among the cycles' gains, so
        the gains sample plain stretches too, not only the cycles that the estimates chose to draft."""
        if confidence is not None and all(math.isfinite(c) for c in confidence):
            self._count_gain(self._best(confidence)[1])
        reach = 1.0
        for i, (c, a) in enumerate(zip(chain, single)):
            beyond = self.past_rejection * (1 - reach)
            self._count(i, reach + beyond, c + beyond * a)
            reach = c

    def _count(self, i: int, seen: float, hits: float, recent_hits: float | None = None) -> None:
        """One observation at position i: `seen` reached it, `hits` of them accepted (`recent_hits` in the recent
        memory, if it counts otherwise)."""
        self.seen[i] = self.decay * self.seen[i] + seen
        self.hits[i] = self.decay * self.hits[i] + hits
        self.recent_seen[i] = self.recent_decay * self.recent_seen[i] + seen
        self.recent_hits[i] = self.recent_decay * self.recent_hits[i] + (hits if recent_hits is None else recent_hits)

    def observe_plain(self, steps: int, seconds: float, probes: int = 0) -> None:
        """`seconds` of `steps` plain steps and `probes` shadow probes (a drafter pass each) among them."""
        expected = steps * self.costs.passes_s(1) + probes * self.probe_s
        self.scale_plain = self._mix(self.scale_plain, seconds / expected)
        self.timing_steps = 0  # plain steps timed: no timing run needed

    def stale(self) -> bool:
        """Whether this generation's timings say the measured costs are off by more than STALE_RATIO: plain
        steps against their measured time, and cycles against plain steps (the curve's shape), or against
        their own measured time when no plain step was timed."""
        if self.scale_plain is None:
            ratios = [self.scale_draft] if self.scale_draft is not None else []
        else:
            ratios = [self.scale_plain] + ([self.scale_draft / self.scale_plain] if self.scale_draft else [])
        return any(not 1 / STALE_RATIO <= r <= STALE_RATIO for r in ratios)

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new


class ShadowBlocks(AdaptiveBlocks):
    """Plain steps only, every run after a shadow probe: what the drafter would accept, measured without
    drafting (`dflash2 bench` checks these estimates against fixed-block cycles)."""

    def next_block(self, left: int | None) -> int:
        return 1

    def drafting_wins(self, left: int | None) -> bool:
        """Never: probes at a fixed spacing. Runs cut short after good probes would probe the stretches where the
        drafter is right more often than the text has them, and the estimate would read high."""
        return False
