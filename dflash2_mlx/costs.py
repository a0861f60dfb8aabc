"""What a cycle costs on this machine: the target's forward over 1..n tokens and the drafter's pass, measured once
per target, drafter and machine (`measure_costs`), cached on disk (`load_or_measure_costs`) and held as a
`CostModel`."""

from __future__ import annotations

import itertools
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import mlx.core as mx
import numpy as np

from .assets import cache_dir
from .kernels import backend_name
from .machine import blas
from .sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class CostModel:
    """Seconds per cycle part on one machine.

    Args:
        verify_s: `verify_s[n - 1]` is a target forward over n tokens (n = 1: a plain decoding step); it may reach
            past the largest block (a token tree verifies more tokens than its depth).
        draft_s: `draft_s[B - 2]` is one drafter pass for a block of B.
    """

    verify_s: list[float]
    draft_s: list[float]

    @property
    def block_max(self) -> int:
        return len(self.draft_s) + 1

    def passes_s(self, B: int, drafted: int | None = None) -> float:
        """Seconds of a cycle's two passes.

        Args:
            B: tokens verified (1: a plain step).
            drafted: the block the drafter proposes (default B). With B = 1 a drafter pass counts only if given
                (a cycle that verified none of its drafts).
        """
        return self.verify_s[B - 1] + (self.draft_s[(drafted or B) - 2] if drafted or B > 1 else 0.0)

    def curve(self) -> list[tuple[int, float]]:
        """(n, target forward over n tokens / a plain step): the verify cost curve."""
        return [(n, s / self.verify_s[0]) for n, s in enumerate(self.verify_s, 1)]


def _best_seconds(fns: list, repeats: int) -> list[float]:
    """The fastest of `repeats` timed calls of each of `fns`, after a warm-up call of each.

    The calls go in rounds, every fn once per round, so that a machine that slows down during the measurement
    weighs on every size alike instead of bending the curve (docs/adaptive.md).
    """
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
    """The forward sizes timed for a verify curve: every n up to block_max, then every fourth and the last.

    Args:
        block_max: the largest block.
        verify_max: the largest forward timed (the curve is interpolated between the timed sizes).
    """
    return sorted({*range(1, block_max + 1), *range(block_max + 4, verify_max, 4), verify_max})


def _interpolate(points: list[int], seconds: list[float]) -> list[float]:
    """seconds at every n in points[0]..points[-1], linear between the timed points."""
    return [float(s) for s in np.interp(np.arange(points[0], points[-1] + 1), points, seconds)]


def measure_costs(
    target,
    drafter,
    block_max: int,
    context_tokens: int = MEASURE_CONTEXT_TOKENS,
    repeats: int = 5,
    verify_max: int | None = None,
) -> CostModel:
    """Time the target's forward over 1..verify_max tokens and the drafter's pass up to block_max.

    A forward over more tokens never costs less than one over fewer: timing noise that says otherwise is
    flattened out.

    Args:
        target: the bound target (`Target`).
        drafter: the drafter.
        block_max: the largest block a cycle drafts.
        context_tokens: the prefill before the timed forwards.
        repeats: each size's time is the best of this many.
        verify_max: the largest verify forward (default block_max).
    """
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
        seconds = _best_seconds(
            [partial(verify, n) for n in points] + [partial(draft, B) for B in draft_sizes], repeats
        )
    verify_s = _interpolate(points, list(itertools.accumulate(seconds[: len(points)], max)))
    draft_s = _interpolate(draft_sizes, list(itertools.accumulate(seconds[len(points) :], max)))
    return CostModel(verify_s, draft_s)


def cache_path() -> Path:
    """Where measured costs are kept: $DFLASH2_COSTS, else costs.json in the package's cache folder."""
    return Path(os.environ.get("DFLASH2_COSTS") or cache_dir() / "costs.json")


def cost_key(target, drafter, block_max: int, verify_max: int | None = None) -> str:
    """The cache key of a cost model: the target and its dtype, the drafter's size and dtype, the machine."""
    cfg = drafter.config
    weight = target.embed_tokens.weight
    parts = [
        target.fingerprint(),
        str(weight.dtype),
        target.model_type,
        str(target.num_layers),
        f"drafter {cfg.num_hidden_layers}x{cfg.hidden_size} {drafter.norm.weight.dtype} {drafter.kind}",
        f"B<={block_max}" + (f" verify<={verify_max}" if verify_max and verify_max > block_max else ""),
        platform.machine(),
        platform.processor() or "",
        str(os.cpu_count()),
        "metal" if mx.metal.is_available() else "cpu",
        blas(),
        backend_name(drafter.metal_kernels),
        mx.__version__,
    ]
    return " | ".join(parts)


def read_cache(path: Path) -> dict:
    """The measured curves kept at `path`, by cache key ({} when the file is missing or unreadable)."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def write_cache(path: Path, known: dict) -> None:
    """Replace the curves kept at `path` with `known`, atomically (another process may read it meanwhile)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(known, indent=1))
    os.replace(tmp, path)


def load_or_measure_costs(target, drafter, block_max: int, verify_max: int | None = None) -> CostModel:
    """The cached cost model of this target, drafter and machine, measured and cached if missing.

    Args:
        target: the bound target.
        drafter: the drafter.
        block_max: the largest block covered.
        verify_max: the verify curve's reach (default block_max).
    """
    key, path = cost_key(target, drafter, block_max, verify_max), cache_path()
    known = read_cache(path)
    if key in known:
        return CostModel(**known[key])
    logger.info("measuring this machine's cycle costs for %s (once; cached in %s)", target.model_type, path)
    costs = measure_costs(target, drafter, block_max, verify_max=verify_max)
    write_cache(path, {**known, key: asdict(costs)})
    return costs


def forget_costs(target, drafter, block_max: int) -> None:
    """Drop the cached costs of this target, drafter and machine: the next `load_or_measure_costs` measures."""
    key, path = cost_key(target, drafter, block_max), cache_path()
    known = read_cache(path)
    if known.pop(key, None) is not None:
        logger.info(
            "the cached cycle costs of %s no longer match this machine; they will be measured again "
            "where they are next loaded",
            target.model_type,
        )
        write_cache(path, known)
