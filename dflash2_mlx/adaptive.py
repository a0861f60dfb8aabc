"""Choosing the block size of each cycle: `--verify-mode dflash` (`FixedBlocks`) and `adaptive` (`AdaptiveBlocks`).

A policy only decides how many drafts a cycle verifies (or that plain steps run instead): every committed token is
still the target's, so any choice is lossless. How adaptive mode decides, and the measurements behind its
settings, are in docs/adaptive.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import mlx.core as mx

from .costs import CostModel, load_or_measure_costs  # noqa: F401  (the server imports load_or_measure_costs from here)

# Timed plain steps (or cycles, relative to them) this many times off the measured costs mean the measurement no
# longer describes the machine.
STALE_RATIO = 2.0


class BlockPolicy(Protocol):
    """What the decode loop (`decode.dflash_steps`) and the replay (`replay.replay`) ask a block-size policy."""

    block_max: int

    def next_block(self, left: int | None) -> int:
        """The block the next cycle drafts for (1: plain steps), with `left` tokens to go (None: no limit)."""

    def drafted_block(self, B: int) -> int:
        """The block the drafter proposes for a cycle verifying B."""

    def verified_block(self, B: int, confidence: mx.array | None, left: int | None) -> int:
        """The block a cycle verifies once its drafts (and their rows' `confidence`) are drawn (1: none)."""

    def plain_run(self, left: int | None) -> int:
        """Plain steps to take, the first after a shadow probe, before the next choice."""

    def drafting_wins(self, left: int | None) -> bool:
        """Whether a plain run ends now that its probe is scored."""

    def observe_cycle(self, B: int, accepted: int, seconds: float) -> None:
        """A cycle that verified B tokens and accepted `accepted` drafts in `seconds`."""

    def observe_unverified(self, first: float, seconds: float) -> None:
        """A cycle that verified no draft, its first draft scored `first` against the token committed."""

    def observe_shadow(
        self, chain: Sequence[float], single: Sequence[float], confidence: Sequence[float] | None = None
    ) -> None:
        """A shadow probe's score."""

    def observe_plain(self, steps: int, seconds: float, probes: int = 0) -> None:
        """`steps` plain steps and `probes` shadow probes timed together at `seconds`."""

    def lookup_drafts(self, acceptance: Sequence[float], available: int) -> int:
        """How many of a lookup's `available` drafts (`lookup.py`), accepted as `acceptance` says by position, a
        cycle verifies (0: none)."""


class FixedBlocks:
    """`--verify-mode dflash`: every cycle at the runtime block size (smaller only where max_tokens ends).

    Args:
        block_size: the block every cycle drafts and verifies.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size

    @property
    def block_max(self) -> int:
        return self.block_size

    def next_block(self, left: int | None) -> int:
        return self.block_size if left is None else max(2, min(self.block_size, left))

    def drafted_block(self, B: int) -> int:
        return B

    def verified_block(self, B: int, confidence: mx.array | None, left: int | None) -> int:
        return B

    def plain_run(self, left: int | None) -> int:
        raise AssertionError("fixed blocks never choose plain steps")

    def drafting_wins(self, left: int | None) -> bool:
        return True

    def observe_cycle(self, B: int, accepted: int, seconds: float) -> None:
        pass

    def observe_unverified(self, first: float, seconds: float) -> None:
        pass

    def observe_shadow(self, chain, single, confidence=None) -> None:
        pass

    def observe_plain(self, steps: int, seconds: float, probes: int = 0) -> None:
        pass

    def lookup_drafts(self, acceptance: Sequence[float], available: int) -> int:
        """Every one: a fixed block verifies whatever the lookup found."""
        return available


@dataclass
class AdaptiveConfig:
    """Adaptive mode's settings (docs/adaptive.md: what each is worth, replayed).

    Args:
        block_max: the largest block a cycle verifies; every drafter pass proposes a block of this size.
        prior: the drafter card's held-out acceptance by draft position (None: neutral estimates).
        prior_weight: how many observations the prior counts as.
        decay: the acceptance counts' (and the clock scales') decay per observation.
        shrink: observations' worth by which each position's estimate is shrunk toward the previous one's.
        calibration_prior: verified drafts' worth of a perfectly calibrated drafter the calibration starts from.
        calibration_decay: the calibration's decay per verified draft.
        gain_decay: the drafting gains' decay per drafter pass.
        entry_discount: running plain steps, the share of a cycle's cost above a plain step that counts.
        turn_p: cycles in a row that accepted less than the estimates gave them this chance of mark a turn.
        recent_decay: the decay of the counts that replace the estimates at a turn.
        plain_run: plain steps per run after a probe (default block_max).
        plain_run_max: the longest run, reached by doubling while plain steps win (default 3 x plain_run).
    """

    block_max: int
    prior: Sequence[float] | None = None
    prior_weight: float = 3.0
    decay: float = 0.8
    shrink: float = 1.0
    calibration_prior: float = 2.0
    calibration_decay: float = 0.95
    gain_decay: float = 0.95
    entry_discount: float = 0.85
    turn_p: float = 0.03
    recent_decay: float = 0.3
    plain_run: int | None = None
    plain_run_max: int | None = None

    def __post_init__(self):
        if self.block_max < 2:
            raise ValueError(f"adaptive mode needs blocks of 2 or more (an anchor and a draft), got {self.block_max}")
        for name in ("decay", "calibration_decay", "gain_decay", "entry_discount", "turn_p", "recent_decay"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"AdaptiveConfig.{name} is a share in [0, 1], got {getattr(self, name)}")
        self.plain_run = self.plain_run or self.block_max
        self.plain_run_max = max(self.plain_run, self.plain_run_max or 3 * self.plain_run)


class AcceptanceEstimates:
    """Per draft position, P(draft accepted | the drafts before it accepted), from exponentially decayed counts.

    Args:
        positions: draft positions (block_max - 1).
        prior: the acceptance the counts start from (None: no counts).
        prior_weight: the observations `prior` counts as.
        decay: each count's decay per observation at its position.
        shrink: observations' worth of shrinkage toward the previous position's estimate (the first's: 1/2).
    """

    def __init__(
        self,
        positions: int,
        prior: Sequence[float] | None = None,
        prior_weight: float = 3.0,
        decay: float = 0.8,
        shrink: float = 1.0,
    ):
        prior = [] if prior is None else [float(a) for a in prior][:positions]
        self.hits = [prior_weight * a for a in prior] + [0.0] * (positions - len(prior))
        self.seen = [prior_weight] * len(prior) + [0.0] * (positions - len(prior))
        self.decay, self.shrink = decay, shrink

    def count(self, i: int, seen: float, hits: float) -> None:
        """One observation at position i: `seen` reached it, `hits` of them accepted."""
        self.seen[i] = self.decay * self.seen[i] + seen
        self.hits[i] = self.decay * self.hits[i] + hits

    def observe_block(self, matched: int, drafts: int) -> None:
        """Count a cycle's drafts: the first `matched` of `drafts` accepted, the next one (if any) rejected."""
        for i in range(min(drafts, len(self.seen), matched + 1)):
            self.count(i, 1.0, 1.0 if i < matched else 0.0)

    def estimates(self) -> list[float]:
        """P(draft i accepted | drafts before it accepted), i = 1..positions."""
        estimates, previous = [], 0.5
        for h, s in zip(self.hits, self.seen):
            previous = (h + self.shrink * previous) / (s + self.shrink)
            estimates.append(previous)
        return estimates


def expected_tokens(acceptance: Sequence[float], B: int) -> float:
    """Committed tokens a cycle verifying B tokens is expected to give: the bonus plus each accepted draft.

    Args:
        acceptance: P(draft i accepted | drafts before it accepted), by position.
        B: tokens verified (the anchor and B - 1 drafts).
    """
    total, reach = 1.0, 1.0
    for a in acceptance[: B - 1]:
        reach *= a
        total += reach
    return total


class Calibration:
    """How far a drafter's row confidences (`Proposal.confidence`) come true, per draft position.

    Args:
        positions: draft positions.
        prior: verified drafts' worth of a perfectly calibrated drafter to start from.
        decay: the sums' decay per verified draft at a position.
    """

    def __init__(self, positions: int, prior: float = 2.0, decay: float = 0.95):
        self.hits, self.sums = [prior] * positions, [prior] * positions
        self.measured = [0.0] * positions  # verified drafts counted, decayed
        self.decay = decay

    def update(self, confidence: Sequence[float], outcomes: Sequence[float]) -> None:
        """Count the drafts of one cycle: at each position reached, its row's confidence and its outcome (1 or 0)."""
        for i, hit in enumerate(outcomes):
            self.hits[i] = self.decay * self.hits[i] + hit
            self.sums[i] = self.decay * self.sums[i] + confidence[i]
            self.measured[i] = self.decay * self.measured[i] + 1.0

    def calibrated(self, confidence: Sequence[float]) -> list[float]:
        """Per position, the acceptance a row's confidence says, scaled by how often confidences came true there."""
        return [min(1.0, c * h / s) for c, h, s in zip(confidence, self.hits, self.sums)]


class Gains:
    """The decayed mean of drafter passes' expected gains over plain steps, in committed tokens.

    Args:
        decay: each gain's decay per drafter pass.
    """

    def __init__(self, decay: float = 0.95):
        self.total, self.count, self.decay = 0.0, 0.0, decay

    def add(self, gain: float) -> None:
        self.total = self.decay * self.total + gain
        self.count = self.decay * self.count + 1.0

    @property
    def mean(self) -> float | None:
        """The mean gain (None: none counted)."""
        return self.total / self.count if self.count else None


class TurnDetector:
    """Whether the text has turned (a copied passage ends, a repetition loop breaks): cycles in a row that accepted
    less than the estimates (or their own calibrated confidences, where those expected less) gave them a `turn_p`
    chance of. At a turn the estimates are replaced by `recent`, counts with a short memory.

    Args:
        estimates: the estimates watched; `recent` starts as a copy of their counts.
        turn_p: the joint chance under which a run of short cycles is a turn.
        recent_decay: `recent`'s decay per observation.
    """

    def __init__(self, estimates: AcceptanceEstimates, turn_p: float = 0.03, recent_decay: float = 0.3):
        self.recent = AcceptanceEstimates(len(estimates.hits), decay=recent_decay, shrink=estimates.shrink)
        self.recent.hits, self.recent.seen = list(estimates.hits), list(estimates.seen)
        self.turn_p = turn_p
        self.shortfall = 1.0  # the joint chance of the cycles in a row that fell short (below the median)
        self.reference: list[float] | None = None  # the estimates before the first of them
        self.calibration: dict[int, tuple[float, float]] = {}  # their drafts' (accepted, confidence) sums

    def reset(self) -> None:
        """Forget the run of short cycles (plain steps broke it, or it was a turn)."""
        self.shortfall, self.reference = 1.0, None

    def observe_cycle(
        self, B: int, accepted: int, acceptance: Sequence[float], calibrated: Sequence[float] | None
    ) -> None:
        """A cycle verifying B tokens accepted `accepted` drafts, where the estimates said `acceptance` and the rows'
        calibrated confidences `calibrated` (None: none)."""
        reference = self.reference or list(acceptance)
        expected = reference if calibrated is None else [min(a, p) for a, p in zip(reference, calibrated)]
        reached = min(accepted + 1, B - 1)
        at_most = 1.0 - math.prod(expected[:reached]) if accepted < B - 1 else 1.0
        if at_most < 0.5:
            self.shortfall, self.reference = self.shortfall * at_most, reference
        else:
            self.reset()

    def count_calibration(self, confidence: Sequence[float], outcomes: Sequence[float]) -> None:
        """Keep the calibration sums of the cycles that fell short in a row apart (what holds after a turn)."""
        if self.shortfall == 1.0:
            self.calibration = {}
            return
        for i, hit in enumerate(outcomes):
            hits, total = self.calibration.get(i, (0.0, 0.0))
            self.calibration[i] = (hits + hit, total + confidence[i])

    @property
    def turned(self) -> bool:
        return self.shortfall < self.turn_p


class ClockScales:
    """Observed over measured seconds, for cycles and for plain steps: the cost model corrected online.

    A cycle right after plain steps feeds the drafter their rows at once, and the first cycle at a block size
    traces it: their times are one-off and do not count.

    Args:
        decay: the weight of the scale so far against each new observation.
    """

    def __init__(self, decay: float = 0.8):
        self.draft: float | None = None
        self.plain: float | None = None
        self.decay, self.after_plain, self.traced = decay, True, set()

    def _mix(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def observe_cycle(self, B: int, ratio: float) -> None:
        """A cycle verifying B tokens took `ratio` times its measured seconds."""
        if not self.after_plain and B in self.traced:
            self.draft = self._mix(self.draft, ratio)
        self.after_plain = False
        self.traced.add(B)

    def observe_plain(self, ratio: float) -> None:
        """Plain steps took `ratio` times their measured seconds."""
        self.plain = self._mix(self.plain, ratio)

    @property
    def cycle_scale(self) -> float:
        """The cycles' scale (the plain steps' until a cycle is timed; 1 before anything is)."""
        return self.draft if self.draft is not None else self.plain if self.plain is not None else 1.0

    @property
    def plain_scale(self) -> float:
        """The plain steps' scale (the cycles' until a plain step is timed; 1 before anything is)."""
        return self.plain if self.plain is not None else self.draft if self.draft is not None else 1.0

    def stale(self, ratio: float = STALE_RATIO) -> bool:
        """Whether plain steps against their measured time, or cycles against plain steps (against their own
        measured time where no plain step was timed), are more than `ratio` times off."""
        if self.plain is None:
            ratios = [self.draft] if self.draft is not None else []
        else:
            ratios = [self.plain] + ([self.draft / self.plain] if self.draft else [])
        return any(not 1 / ratio <= r <= ratio for r in ratios)


class AdaptiveBlocks:
    """`--verify-mode adaptive`: per cycle, the block size (1 = plain steps) with the most committed tokens per second.

    Args:
        costs: the cost model, covering blocks up to `config.block_max`.
        config: the policy's settings.
    """

    def __init__(self, costs: CostModel, config: AdaptiveConfig):
        if config.block_max > costs.block_max:
            raise ValueError(
                f"the cost model covers blocks up to {costs.block_max}, not {config.block_max}: "
                "measure it for the larger block (`load_or_measure_costs`)"
            )
        n = config.block_max - 1
        self.costs, self.config, self.block_max = costs, config, config.block_max
        self.estimates = AcceptanceEstimates(n, config.prior, config.prior_weight, config.decay, config.shrink)
        self.calibration = Calibration(n, config.calibration_prior, config.calibration_decay)
        self.gains = Gains(config.gain_decay)
        self.turns = TurnDetector(self.estimates, config.turn_p, config.recent_decay)
        self.clock = ClockScales(config.decay)
        self.run = config.plain_run  # the next plain run's length
        self.drafting = False  # the last choice: drafting (True) or plain steps
        self.confidence: list[float] | None = None  # the drafting cycle's row confidences, until observed

    def acceptance(self) -> list[float]:
        """The estimated P(draft i accepted | drafts before it accepted), i = 1..block_max - 1."""
        return self.estimates.estimates()

    @property
    def gain(self) -> float | None:
        """The drafter passes' mean expected gain over plain steps (None: none counted)."""
        return self.gains.mean

    @property
    def probe_s(self) -> float:
        """A shadow probe's measured cost: one drafter pass over a block of block_max."""
        return self.costs.draft_s[self.block_max - 2]

    def cycle_seconds(self, B: int) -> float:
        """Expected seconds of a drafting cycle verifying B tokens (B = 1: a plain step after the drafter pass)."""
        return self.costs.passes_s(B, self.drafted_block(B)) * self.clock.cycle_scale

    def seconds(self, B: int, entering: bool = False) -> float:
        """Expected seconds of a cycle at B (B = 1: a plain step with its share of a shadow probe).

        Args:
            B: tokens verified.
            entering: deciding while running plain steps: a cycle's cost above a plain step counts at
                `config.entry_discount` of it.
        """
        if B == 1:
            return (self.costs.passes_s(1) + self.probe_s / self.run) * self.clock.plain_scale
        cycle = self.cycle_seconds(B)
        if not entering:
            return cycle
        plain = self.costs.passes_s(1) * self.clock.cycle_scale  # on the cycles' clock
        return plain + self.config.entry_discount * (cycle - plain)

    def rates(self, top: int, entering: bool = False) -> dict[int, float]:
        """Expected committed tokens per second at each block size 1..top (`entering`: see `seconds`)."""
        acceptance = self.acceptance()
        return {B: expected_tokens(acceptance, B) / self.seconds(B, entering) for B in range(1, top + 1)}

    @staticmethod
    def drafting_vs_plain(rates: dict[int, float]) -> float:
        """The best drafting rate (blocks 2 and up) of `rates` over plain steps' rate."""
        return max(rates[b] for b in rates if b > 1) / rates[1]

    def _top(self, left: int | None) -> int:
        """The largest block a cycle may take with `left` tokens to go (1: plain steps only)."""
        return self.block_max if left is None else max(1, min(self.block_max, left))

    def next_block(self, left: int | None) -> int:
        top = self._top(left)
        if top == 1:
            return 1
        rates = self.rates(top, entering=not self.drafting)
        B = max(rates, key=rates.get)
        if B == 1 and self.drafting and (self.gain or 0.0) > 0:  # the cycles gain: draft on
            B = max((b for b in rates if b > 1), key=rates.get)
        self.run = (
            min(2 * self.run, self.config.plain_run_max) if B == 1 and not self.drafting else self.config.plain_run
        )
        self.drafting = B > 1
        return B

    def drafted_block(self, B: int) -> int:
        """Always block_max: the estimates describe blocks of that size, and a drafter drafts best at its size."""
        return self.block_max

    def verified_block(self, B: int, confidence: mx.array | None, left: int | None) -> int:
        """The block whose expected committed tokens, on the rows' calibrated confidences, exceed most what plain
        steps commit in the same time (1: none of the drafts; a plain step from the anchor).

        Args:
            B: the block `next_block` chose.
            confidence: the drafted rows' confidences (`Proposal.confidence`; None: verify B).
            left: tokens to go (None: no limit).
        """
        if confidence is None:
            return B
        rows = confidence[: max(2, self._top(left)) - 1].tolist()
        if not all(math.isfinite(c) for c in rows):  # non-finite drafts accept nothing: verify the fewest
            return 2
        self.confidence = rows
        best, gain = self._best(rows)
        self._count_gain(gain)
        return best

    def _best(self, rows: Sequence[float]) -> tuple[int, float]:
        """(the block to verify, its expected gain over plain steps in committed tokens) for these rows."""
        plain_rate = 1.0 / self.seconds(1)
        best, best_gain, expected, reach = 1, 1.0 - plain_rate * self.cycle_seconds(1), 1.0, 1.0
        for n, p in enumerate(self.calibration.calibrated(rows), start=1):
            reach *= p
            expected += reach
            gain = expected - plain_rate * self.cycle_seconds(n + 1)
            if gain > best_gain:
                best, best_gain = n + 1, gain
        return best, best_gain

    def _count_gain(self, gain: float) -> None:
        """Count a drafter pass's expected gain once a first draft has measured the calibration it rests on."""
        if self.calibration.measured[0] >= 1.0:
            self.gains.add(gain)

    def drafting_wins(self, left: int | None) -> bool:
        """Whether a cycle now beats plain steps, priced as while running them."""
        top = self._top(left)
        return top > 1 and self.drafting_vs_plain(self.rates(top, entering=True)) > 1

    def plain_run(self, left: int | None) -> int:
        self.clock.after_plain = True
        self.turns.reset()
        return self.run if left is None else max(1, min(self.run, left))

    def observe_cycle(self, B: int, accepted: int, seconds: float) -> None:
        """Count the positions reached (the accepted drafts and the first rejection), watch for a turn, and count
        the time if the cycle was steady."""
        calibrated = None if self.confidence is None else self.calibration.calibrated(self.confidence)
        self.turns.observe_cycle(B, accepted, self.acceptance(), calibrated)
        outcomes = [float(i < accepted) for i in range(min(accepted + 1, B - 1))]
        for i, hit in enumerate(outcomes):
            self._count(i, 1.0, hit)
        if self.confidence is not None:
            self._calibrate(outcomes)
        if self.turns.turned:  # the older evidence describes another text: the recent counts replace it
            self.estimates.hits, self.estimates.seen = list(self.turns.recent.hits), list(self.turns.recent.seen)
            self.turns.reset()
            self.gains = Gains(self.config.gain_decay)
            for i, (hits, total) in self.turns.calibration.items():  # the confidences as far as they held
                self.calibration.hits[i], self.calibration.sums[i], self.calibration.measured[i] = hits, total, 0.0
        self.clock.observe_cycle(B, seconds / self.costs.passes_s(B, self.drafted_block(B)))

    def observe_unverified(self, first: float, seconds: float) -> None:
        """Count the first draft as if verified, scored `first` (`sampling.draft_acceptance`) by the token
        committed, so leaving unsure drafts unverified biases no estimate."""
        self._count(0, 1.0, first)
        self._calibrate([first])
        self.clock.observe_cycle(1, seconds / self.costs.passes_s(1, self.drafted_block(1)))

    def observe_shadow(
        self, chain: Sequence[float], single: Sequence[float], confidence: Sequence[float] | None = None
    ) -> None:
        """Count a shadow probe's score (`sampling.draft_acceptance`).

        Args:
            chain: chain[i] = P(drafts 1..i+1 accepted); position i counts as reached with P(chain[i - 1]).
            single: each position's acceptance on its own (not counted: a cycle never reaches past a rejection).
            confidence: the probe's rows (`Proposal.confidence`): the gain a cycle drafting there expected counts
                among the drafter passes' gains.
        """
        if confidence is not None and all(math.isfinite(c) for c in confidence):
            self._count_gain(self._best(confidence)[1])
        reach = 1.0
        for i, c in enumerate(chain):
            self._count(i, reach, c)
            reach = c

    def _count(self, i: int, seen: float, hits: float) -> None:
        self.estimates.count(i, seen, hits)
        self.turns.recent.count(i, seen, hits)

    def _calibrate(self, outcomes: Sequence[float]) -> None:
        self.calibration.update(self.confidence, outcomes)
        self.turns.count_calibration(self.confidence, outcomes)
        self.confidence = None

    def observe_plain(self, steps: int, seconds: float, probes: int = 0) -> None:
        expected = steps * self.costs.passes_s(1) + probes * self.probe_s
        self.clock.observe_plain(seconds / expected)

    def lookup_drafts(self, acceptance: Sequence[float], available: int) -> int:
        """The lookup drafts whose cycle commits the most tokens per second, if more than plain steps do (0: none):
        a lookup costs no drafter pass, only the target's pass over the anchor and the drafts (the verify curve,
        extended along its last slope past its end).

        Args:
            acceptance: P(lookup draft i accepted | the drafts before it accepted), by position (`lookup.CopySpec`).
            available: the drafts the lookup found.
        """
        verify = self.costs.verify_s
        slope = (verify[-1] - verify[0]) / max(len(verify) - 1, 1)
        best, best_rate = 0, 1.0 / (verify[0] * self.clock.plain_scale)
        total, reach = 1.0, 1.0
        for n, a in enumerate(acceptance[:available], start=1):
            reach *= a
            total += reach
            seconds = verify[n] if n < len(verify) else verify[-1] + slope * (n + 1 - len(verify))
            if total / (seconds * self.clock.cycle_scale) > best_rate:
                best, best_rate = n, total / (seconds * self.clock.cycle_scale)
        return best

    def stale(self) -> bool:
        """Whether this generation's timings say the measured costs are off by more than STALE_RATIO."""
        return self.clock.stale()


class ShadowBlocks(AdaptiveBlocks):
    """Plain steps only, every run after a shadow probe at a fixed spacing (`dflash2 bench` checks the probes'
    estimates against fixed-block cycles)."""

    def next_block(self, left: int | None) -> int:
        return 1

    def drafting_wins(self, left: int | None) -> bool:
        return False
