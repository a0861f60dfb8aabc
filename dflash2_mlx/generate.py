"""The public generation API, shaped like mlx-lm's: `stream_generate` yields one `GenerationResponse` per token,
with mlx-lm's fields (text, token, logprobs, from_draft, ...) and the fields of the cycle that committed it;
`stream_cycles` yields one `CycleResponse` per decode step (a DFlash cycle commits several tokens at once), what
the bench, the JSON output and the server read; `generate` runs it to the end and `summarize`s it.

`dflash2_mlx.lm` wraps these in mlx-lm's own signatures and return types (a drop-in for `mlx_lm`)."""

from __future__ import annotations

import time
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import generation_stream, wired_limit
from mlx_lm.tokenizer_utils import TokenizerWrapper

from .adaptive import AdaptiveBlocks, AdaptiveConfig, FixedBlocks
from .costs import CostModel, forget_costs, load_or_measure_costs
from .decode import dflash_steps, plain_steps, tree_steps
from .drafter import DFlashDraftModel
from .loading import bind_drafter
from .lookup import COPYSPEC_MODES, LookupConfig, copyspec_config
from .prompt_cache import PromptCache
from .sampling import LogitsProcessor, Sampler, SamplingParams, sampler_params
from .target import Target
from .tree import TREE_BUDGET_MAX, default_budget

VERIFY_MODES = ("adaptive", "dflash", "ddtree", "off")


@dataclass
class CycleResponse:
    """What `stream_cycles` yields per decode step: a DFlash cycle, the prefill token, or a plain step."""

    text: str  # text decoded from this step's tokens (EOS is never rendered); "" with detokenize=False
    tokens: list[int]  # tokens committed by this step, EOS included when it stopped generation
    accepted: int | None  # drafts accepted in this cycle; None for the prefill token and plain decoding
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int  # tokens generated so far
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop" (EOS), "length" (max_tokens) or None
    verify_mode: str = "adaptive"  # what actually ran: "off" also when the prompt exceeded max_context
    draft_failed: bool = False  # non-finite draft logits: this cycle committed one plain-decoding token
    block_size: int | None = None  # this cycle's block size; 1 for a plain step chosen by adaptive mode
    tree_budget: int | None = None  # ddtree: draft nodes per tree (given, or chosen from the measured costs)
    # adaptive mode, the step of a plain run that completes its shadow probe's score: P(drafts 1..i accepted)
    # for the probe's drafts, scored by the run's own tokens (at T > 0 an estimate; see `sampling.draft_acceptance`)
    shadow: list[float] | None = None
    # [len(tokens), V]: the log-probabilities each token was chosen from (the target's processed row,
    # log-softmaxed: mlx-lm's `logprobs`), a lazy MLX array: computed only when read
    logprobs: mx.array | None = None
    # where the cycle verified a lookup's continuation (`--copyspec-mode`): the branch its accepted drafts came
    # from, "lookup" or "drafter"; None where it verified the drafter's path alone (or was no cycle)
    branch: str | None = None


@dataclass
class GenerationResponse:
    """What `stream_generate` yields per token: mlx-lm's `GenerationResponse` fields, in its order and meaning,
    then those of the cycle that committed the token (`CycleResponse`), repeated on each of its tokens."""

    text: str  # the next segment of decoded text (may be empty)
    token: int
    logprobs: mx.array  # [V], the log-probabilities `token` was chosen from (lazy until read)
    from_draft: bool  # an accepted draft (False: the cycle's bonus token, the prefill token, a plain step)
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int  # tokens generated so far, this one included
    generation_tps: float
    peak_memory: float  # GB
    finish_reason: str | None = None  # "stop" (EOS: `token` is the EOS token), "length" or None
    accepted: int | None = None  # drafts its cycle accepted; None for the prefill token and plain decoding
    block_size: int | None = None
    verify_mode: str = "adaptive"
    draft_failed: bool = False
    tree_budget: int | None = None
    shadow: list[float] | None = None
    branch: str | None = None  # the cycle's winning branch where it verified a lookup (`CycleResponse.branch`)
    cycle: int = 0  # which step of the generation committed it (0: the prefill token)


@dataclass
class GenerationResult:
    text: str
    tokens: list[int]
    accepted: list[int]  # per cycle
    prompt_tokens: int
    generation_tokens: int
    prompt_tps: float
    generation_tps: float
    peak_memory_gb: float
    finish_reason: str | None
    verify_mode: str
    block_size: int | None  # dflash: the block size; adaptive: the largest it may choose; ddtree: 1 + the tree depth
    tree_budget: int | None = None  # ddtree: draft nodes per tree
    draft_failures: int = 0  # cycles whose draft logits were non-finite (each fell back to a plain step)
    block_sizes: dict[int, int] = field(default_factory=dict)  # drafting cycles per block size
    plain_tokens: int = 0  # tokens from plain steps that adaptive mode chose over drafting
    # adaptive mode's shadow probes (one per plain run): how many, and their mean P(drafts 1..i accepted)
    shadow_probes: int = 0
    shadow_acceptance: list[float] | None = None
    # drafts accepted from lookups' continuations (`--copyspec-mode`), and the cycles a lookup's branch won
    lookup_tokens: int = 0
    lookup_cycles: int = 0
    cycles: int = field(init=False)
    tau: float | None = field(init=False)  # mean tokens committed per cycle, bonus included

    def __post_init__(self):
        self.cycles = len(self.accepted)
        self.tau = (sum(self.accepted) + self.cycles) / self.cycles if self.cycles else None

    def to_dict(self) -> dict:
        return asdict(self)


def _encode(tokenizer, prompt: str | Sequence[int] | mx.array) -> mx.array:
    if isinstance(prompt, str):
        prompt = encode_text(tokenizer, prompt)
    return mx.array(prompt, dtype=mx.uint32).reshape(-1)


def encode_text(tokenizer, text: str) -> list[int]:
    """The token ids `stream_generate` feeds for a text prompt (special tokens added unless it starts with BOS)."""
    bos = getattr(tokenizer, "bos_token", None)
    return tokenizer.encode(text, add_special_tokens=bos is None or not text.startswith(bos))


def resolve_block_size(drafter: DFlashDraftModel, block_size: int | None, verify_mode: str = "dflash") -> int:
    """oMLX's "Runtime Block Size": at most the checkpoint's, at least 2 (anchor + one draft). Left
    unset, DFlash 2 drafters run at min(5, trained) as oMLX's MLX engine does, v1 at the trained size, and
    adaptive mode may go up to the trained size."""
    trained = drafter.config.block_size
    if block_size is None:
        cap = drafter.default_block_cap
        return trained if verify_mode in ("adaptive", "ddtree") or cap is None else min(cap, trained)
    if not 2 <= block_size <= trained:
        raise ValueError(
            f"block size {block_size} is outside 2..{trained}: a runtime block size can only lower "
            f"the drafter's trained block size ({trained})"
        )
    return block_size


def block_policy(
    target: Target, drafter: DFlashDraftModel, block_size: int, verify_mode: str, costs: CostModel | None = None
):
    """What picks each cycle's block size: the fixed size (dflash) or the cost model (adaptive: `costs`, else
    this machine's cached one, measured now if missing), starting from the drafter card's held-out acceptance
    by position."""
    if verify_mode == "dflash":
        return FixedBlocks(block_size)
    if costs is None:
        costs = load_or_measure_costs(target, drafter, block_size)
    return AdaptiveBlocks(costs, AdaptiveConfig(block_size, prior=drafter.acceptance_prior))


def check_generation_arguments(
    drafter: DFlashDraftModel | None,
    *,
    verify_mode: str = "adaptive",
    walk: str = "greedy",
    tree_budget: int | None = None,
    max_tokens: int = 256,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    sampler: Sampler | None = None,
    sampling: tuple[float, float, int, float] = (0.0, 1.0, 0, 0.0),
    copyspec_mode: str | LookupConfig = "auto",
) -> list[LogitsProcessor]:
    """Check `stream_cycles`' arguments before anything is loaded or run.

    Args:
        drafter, verify_mode, walk, tree_budget, max_tokens, logits_processors, sampler: as `stream_cycles`
            takes them.
        sampling: `stream_cycles`' (temp, top_p, top_k, min_p); with a sampler, they must be left at these
            defaults. Their ranges are `SamplingParams`' to check.
        copyspec_mode: as `stream_cycles` takes it.

    Returns:
        The logits processors as a list (empty for None).

    Raises:
        ValueError: the first argument that cannot run, naming it and what to give instead.
    """
    if verify_mode not in VERIFY_MODES:
        raise ValueError(f"verify mode must be one of {VERIFY_MODES}, got {verify_mode!r}")
    if not isinstance(copyspec_mode, LookupConfig) and copyspec_mode not in COPYSPEC_MODES:
        raise ValueError(f"copyspec mode must be one of {COPYSPEC_MODES}, got {copyspec_mode!r}")
    if verify_mode != "off" and drafter is None:
        raise ValueError(f"verify mode {verify_mode!r} needs a drafter (--draft-model); use 'off' for plain decoding")
    if tree_budget is not None and verify_mode != "ddtree":
        raise ValueError(f"tree_budget (--tree-budget) applies to verify mode 'ddtree', not {verify_mode!r}")
    if verify_mode == "ddtree":
        if tree_budget is not None and (not isinstance(tree_budget, int) or tree_budget < 1):
            raise ValueError(f"tree_budget must be an integer >= 1 (draft nodes per tree), got {tree_budget!r}")
        if walk != "greedy":
            raise ValueError(
                f"the {walk!r} walk picks one path; verify mode 'ddtree' builds a tree best-first "
                "instead: leave the walk (--path) at greedy"
            )
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    logits_processors = list(logits_processors or [])
    if not all(callable(p) for p in logits_processors):
        raise ValueError(
            "logits_processors must be a list of callables proc(tokens, logits) -> logits "
            "(e.g. mlx_lm.sample_utils.make_logits_processors(...))"
        )
    if sampler is not None:
        if not callable(sampler):
            raise ValueError(
                f"sampler must be a callable logprobs -> token (e.g. make_sampler(temp=0.7)), got "
                f"{type(sampler).__name__}"
            )
        if sampling != (0.0, 1.0, 0, 0.0):
            raise ValueError(
                "give either a sampler or temp/top_p/top_k/min_p, not both: make_sampler(temp=..., "
                "top_p=..., ...) takes them all"
            )
    return logits_processors


def _sampling(
    sampler: Sampler | None, temp: float, top_p: float, top_k: int, min_p: float, verify_mode: str
) -> tuple[SamplingParams, Sampler | None, str]:
    """(the distribution tokens are drawn from, the sampler to call instead when that distribution is unknown,
    the verify mode that runs: "off" for such a sampler, with one warning saying why)."""
    if sampler is None:
        return SamplingParams(temperature=temp, top_p=top_p, top_k=top_k, min_p=min_p), None, verify_mode
    params = sampler_params(sampler)
    if params is not None:
        return params, None, verify_mode
    if verify_mode != "off":
        why = getattr(sampler, "why", "") or "this sampler is a callable whose distribution is not known"
        warnings.warn(
            f"plain decoding instead of {verify_mode!r} speculation: {why}, and accepting drafts exactly "
            "(rejection sampling) needs that distribution. The output is still exactly this sampler's; "
            "to speculate, make the sampler with dflash2_mlx.lm.make_sampler (mlx-lm's arguments)",
            UserWarning,
            stacklevel=3,
        )  # points at the code iterating `stream_cycles`
    return SamplingParams(), sampler, "off"


def stream_cycles(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    drafter: DFlashDraftModel | None = None,
    *,
    max_tokens: int = 256,
    temp: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | None = None,
    block_size: int | None = None,
    verify_mode: str = "adaptive",
    walk: str = "greedy",
    tree_budget: int | None = None,
    max_context: int | None = None,
    prefill_step_size: int = 2048,
    eos_token_ids: Sequence[int] | None = None,
    prompt_cache: PromptCache | None = None,
    logits_processors: Sequence[LogitsProcessor] | None = None,
    costs: CostModel | None = None,
    sampler: Sampler | None = None,
    detokenize: bool = True,
    copyspec_mode: str | LookupConfig = "auto",
) -> Iterator[CycleResponse]:
    """One `CycleResponse` per decode step (`stream_generate` yields the same generation per token).

    Generate from `model` (an mlx-lm model, or a `Target` made from one with the drafter bound to it: a target
    sharded over several processes, `distributed.ShardedTarget`), speculatively with `drafter`, or by plain
    decoding of the same target when verify_mode is "off". "dflash" drafts every cycle at `block_size`;
    "adaptive" (oMLX's default) picks each cycle's block size, up to `block_size` (default: the drafter's
    trained size), from this machine's measured costs and the acceptance seen so far, plain steps included.

    temp, top_p, top_k, min_p: mlx-lm's sampler (`make_sampler`): top-p, min-p and top-k filter the
    untempered log-probabilities, then temperature applies; temp 0 is greedy. At T > 0 the tokens follow
    the distribution mlx-lm's own sampler draws from the target, speculative or not.

    walk: how a DFlash 2 drafter's path selector picks drafts at T = 0 ("greedy" or "viterbi").
    tree_budget: "ddtree" verifies a tree of up to this many draft nodes, at most block_size - 1 deep (default:
    the drafter's trained size), built best-first from the drafter's lattice (`tree.py`); left unset, the most
    nodes this machine verifies for at most 10% more than the linear block (`tree.default_budget`, from the
    measured and cached costs).
    max_context: prompts of at least this many tokens run plain decoding (oMLX's `dflash_max_ctx`);
    the records then say verify_mode "off".
    prompt_cache: a `PromptCache` passed to consecutive generations (a multi-turn chat): each reuses the
    caches for the prefix its prompt shares with the previous one's tokens (`prompt_cache.reused` says how many).
    logits_processors: mlx-lm's (`proc(tokens, logits) -> logits`, e.g. from
    `mlx_lm.sample_utils.make_logits_processors`), applied as mlx-lm's `generate_step` applies them (tokens: the
    whole prompt and the tokens generated before the row) to every row a token is chosen from, in every verify
    mode: inside a verify pass each row sees the drafts before it, so the output is still exactly what plain
    decoding with the same processors gives (`sampling.Processing`).
    costs: adaptive mode's cost model (`costs.CostModel`, covering blocks up to the block size); None: this
    machine's cached one, measured in this call when missing (a few dozen forwards before the first token).
    A server loads or measures it once at startup and passes it, so no request pays for it; a stale verdict
    (timings 2x off the curve) then drops only the cached copy, and the curve passed stays the caller's.
    sampler: an mlx-lm sampler callable (log-probabilities [1, V] -> token), instead of temp/top_p/top_k/min_p.
    Rejection sampling must know the distribution a sampler draws from, so speculation runs with samplers that
    say it: `sampling.make_sampler`'s (mlx-lm's arguments, its sampler with the parameters attached) and mlx-lm's
    greedy sampler. Any other callable runs plain decoding with that sampler, exactly as mlx-lm calls it (so the
    output is still exactly mlx-lm's), with one warning saying why; refusing it would break mlx-lm code that
    works, and guessing its law could make the output wrong.
    detokenize: False leaves every record's text empty (for a caller that decodes the tokens itself).
    copyspec_mode: copy drafts (`lookup.py`, docs/copy.md): "auto", "conservative" or "aggressive" look the
    continuation of the text's last tokens up in the context (prompt and answer so far) and verify it beside the
    drafter's block, in every verify mode but "off"; "off" looks nothing up; a `lookup.LookupConfig` sets the
    shortest match and the longest continuation itself. The output is the same.
    Each record's `logprobs` stays lazy: reading it costs a host transfer, keeping it keeps [tokens, V] alive.
    """
    logits_processors = check_generation_arguments(
        drafter,
        verify_mode=verify_mode,
        walk=walk,
        tree_budget=tree_budget,
        max_tokens=max_tokens,
        logits_processors=logits_processors,
        sampler=sampler,
        sampling=(temp, top_p, top_k, min_p),
        copyspec_mode=copyspec_mode,
    )
    copyspec = copyspec_config(copyspec_mode)
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    params, foreign, verify_mode = _sampling(sampler, temp, top_p, top_k, min_p, verify_mode)
    eos = set(tokenizer.eos_token_ids if eos_token_ids is None else eos_token_ids)
    prompt = _encode(tokenizer, prompt)
    if seed is not None:
        mx.random.seed(seed)
    if max_context is not None and prompt.size >= max_context:
        verify_mode = "off"

    if isinstance(model, Target):  # made and bound already (a target sharded over processes: `distributed.py`)
        target, model = model, model.model
    else:
        target = bind_drafter(drafter, model) if verify_mode != "off" else Target(model)
    if prompt.size and int(prompt.max()) >= target.vocab_size:
        raise ValueError(
            f"prompt token id {int(prompt.max())} is outside the target's vocabulary "
            f"({target.vocab_size}): was it encoded with another model's tokenizer?"
        )
    if verify_mode == "ddtree":
        B = resolve_block_size(drafter, block_size, verify_mode)
        if tree_budget is None:
            tree_budget = default_budget(load_or_measure_costs(target, drafter, B, TREE_BUDGET_MAX + 1), B)
        steps = tree_steps(
            target,
            drafter,
            prompt,
            params,
            B,
            tree_budget,
            max_tokens,
            prefill_step_size,
            prompt_cache,
            logits_processors,
            copyspec,
        )
    elif verify_mode != "off":
        drafter.check_walk(walk)
        blocks = block_policy(target, drafter, resolve_block_size(drafter, block_size, verify_mode), verify_mode, costs)
        steps = dflash_steps(
            target,
            drafter,
            prompt,
            params,
            blocks,
            max_tokens,
            prefill_step_size,
            walk,
            prompt_cache,
            logits_processors,
            copyspec,
        )
    else:
        steps = plain_steps(target, prompt, params, prefill_step_size, prompt_cache, logits_processors, foreign)

    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    n = 0
    tic = time.perf_counter()
    try:
        with wired_limit(model, [generation_stream]):
            for i, (tokens, accepted, draft_failed, step_block, shadow, logprobs, branch) in enumerate(steps):
                if i == 0:
                    prefilled = prompt.size - (prompt_cache.reused if prompt_cache is not None else 0)
                    prompt_tps = prefilled / (time.perf_counter() - tic)  # the tokens the cache did not hold
                    tic = time.perf_counter()
                tokens = tokens[: max_tokens - n]
                stop = next((j for j, t in enumerate(tokens) if t in eos), None)
                if stop is not None:
                    tokens = tokens[: stop + 1]
                if detokenize:
                    for t in tokens if stop is None else tokens[:-1]:
                        detokenizer.add_token(t)
                n += len(tokens)
                finish = "stop" if stop is not None else "length" if n >= max_tokens else None
                if finish and detokenize:
                    detokenizer.finalize()
                elapsed = time.perf_counter() - tic
                yield CycleResponse(
                    text=detokenizer.last_segment if detokenize else "",
                    tokens=tokens,
                    accepted=accepted,
                    prompt_tokens=prompt.size,
                    prompt_tps=prompt_tps,
                    generation_tokens=n,
                    generation_tps=n / elapsed if i > 0 else 0.0,  # the first token is prefill's
                    peak_memory=mx.get_peak_memory() / 1e9,
                    finish_reason=finish,
                    verify_mode=verify_mode,
                    draft_failed=draft_failed,
                    block_size=step_block,
                    tree_budget=tree_budget if verify_mode == "ddtree" else None,
                    shadow=shadow,
                    logprobs=None if logprobs is None else logprobs[: len(tokens)],
                    branch=branch,
                )
                if finish:
                    return
    finally:
        steps.close()  # leaves the target as it was (feature taps removed)
        if verify_mode == "adaptive" and blocks.stale():
            # measured again by the next generation that is not given a curve (a server's: at its next start)
            forget_costs(target, drafter, blocks.block_max)


def generate(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    drafter: DFlashDraftModel | None = None,
    verbose: bool = False,
    **kwargs,
) -> GenerationResult:
    """Run `stream_cycles` to the end and `summarize` it; with `verbose`, stream the text to stdout as it comes.
    (`dflash2_mlx.lm.generate` is mlx-lm's `generate`: it returns the text.)"""
    records = []
    for last in stream_cycles(model, tokenizer, prompt, drafter, **kwargs):
        if last.draft_failed and not any(r.draft_failed for r in records):
            warnings.warn(
                "the drafter produced non-finite logits (NaN/inf); such cycles fall back to plain decoding. "
                "Run the drafter in bfloat16 or float32.",
                RuntimeWarning,
                stacklevel=2,
            )
        records.append(replace(last, logprobs=None))  # the rows are not needed: let them go
        if verbose:
            print(last.text, end="", flush=True)
    if verbose:
        print(flush=True)
    return summarize(records, drafter, kwargs.get("block_size"))


def stream_generate(
    model: nn.Module,
    tokenizer,
    prompt: str | Sequence[int] | mx.array,
    drafter: DFlashDraftModel | None = None,
    **kwargs,
) -> Iterator[GenerationResponse]:
    """The generation of `stream_cycles` (same arguments), one `GenerationResponse` per token as mlx-lm's
    `stream_generate` yields them: its text segment (the detokenizer fed token by token, finalized with the last),
    the token, its log-probabilities [V] (lazy), whether it was an accepted draft, and the counters; the last
    response carries the finish reason ("stop": its token is the EOS, which adds no text). Each response also
    carries its cycle's fields (accepted, block_size, verify_mode, ...) and index (`cycle`)."""
    if "detokenize" in kwargs:
        raise TypeError("stream_generate detokenizes token by token itself; `detokenize` is stream_cycles'")
    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)
    cycles = stream_cycles(model, tokenizer, prompt, drafter, detokenize=False, **kwargs)
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    n, tic = 0, None
    try:
        for c, record in enumerate(cycles):
            tic = tic or time.perf_counter()  # timed from the first token, as mlx-lm's
            for j, token in enumerate(record.tokens):
                n += 1
                last = record.finish_reason is not None and j == len(record.tokens) - 1
                if not (last and record.finish_reason == "stop"):  # EOS adds no text
                    detokenizer.add_token(token)
                if last:
                    detokenizer.finalize()
                yield GenerationResponse(
                    text=detokenizer.last_segment,
                    token=token,
                    logprobs=record.logprobs[j],
                    from_draft=record.accepted is not None and j < record.accepted,
                    prompt_tokens=record.prompt_tokens,
                    prompt_tps=record.prompt_tps,
                    generation_tokens=n,
                    generation_tps=n / max(time.perf_counter() - tic, 1e-9),
                    peak_memory=record.peak_memory,
                    finish_reason=record.finish_reason if last else None,
                    accepted=record.accepted,
                    block_size=record.block_size,
                    verify_mode=record.verify_mode,
                    draft_failed=record.draft_failed,
                    tree_budget=record.tree_budget,
                    shadow=record.shadow,
                    branch=record.branch,
                    cycle=c,
                )
    finally:
        cycles.close()


def summarize(
    records: Sequence[CycleResponse],
    drafter: DFlashDraftModel | None = None,
    block_size: int | None = None,
) -> GenerationResult:
    """The `GenerationResult` of a generation's `stream_cycles` records (all of them, or those read before it was
    stopped); `drafter` and `block_size` as given to `stream_cycles`."""
    text, tokens, accepted, failures, last = "", [], [], 0, records[-1]
    block_sizes, plain_tokens, shadows, lookup_tokens, lookup_cycles = Counter(), 0, [], 0, 0
    for r in records:
        text += r.text
        tokens += r.tokens
        if r.accepted is not None:
            accepted.append(r.accepted)
            block_sizes[r.block_size] += 1
        if r.block_size == 1:
            plain_tokens += len(r.tokens)
        failures += r.draft_failed
        if r.shadow is not None:
            shadows.append(r.shadow)
        if r.branch == "lookup":
            lookup_tokens += r.accepted
            lookup_cycles += 1
    speculative = last.verify_mode != "off"
    return GenerationResult(
        text=text,
        tokens=tokens,
        accepted=accepted,
        prompt_tokens=last.prompt_tokens,
        generation_tokens=last.generation_tokens,
        prompt_tps=last.prompt_tps,
        generation_tps=last.generation_tps,
        peak_memory_gb=last.peak_memory,
        finish_reason=last.finish_reason,
        verify_mode=last.verify_mode,
        block_size=resolve_block_size(drafter, block_size, last.verify_mode) if speculative else None,
        tree_budget=last.tree_budget,
        draft_failures=failures,
        block_sizes=dict(sorted(block_sizes.items())),
        plain_tokens=plain_tokens,
        shadow_probes=len(shadows),
        shadow_acceptance=_mean_by_position(shadows),
        lookup_tokens=lookup_tokens,
        lookup_cycles=lookup_cycles,
    )


def _mean_by_position(rows: list[list[float]]) -> list[float] | None:
    """The mean of each position over the rows that reach it (a run cut short by max_tokens scores fewer)."""
    if not rows:
        return None
    width = max(len(r) for r in rows)
    return [sum(r[i] for r in rows if len(r) > i) / sum(len(r) > i for r in rows) for i in range(width)]
