"""The timing runs of `dflash2 bench`: every method on every prompt, trial by trial in the ABBA order (`bench`;
why that order, `bench.py`), one generation of a method (`run_method`), a cycle's drafter and verify passes timed
alone (`cycle_parts`), the cost curves adaptive mode and ddtree budgets run on (`cost_curves`), and at T > 0 the
tau adaptive mode's shadow probes expect against the measured one (`shadow_calibration`)."""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
from mlx_lm import stream_generate as mlx_stream
from mlx_lm.sample_utils import make_sampler
from rich.progress import Progress

from dflash2_apps.bench_methods import Method, Run
from dflash2_apps.bench_stats import adaptive_summary, add_cycle_parts, method_row, per_prompt_rows, unavailable_row
from dflash2_apps.peer_engines import PeerError
from dflash2_mlx import stream_cycles
from dflash2_mlx.adaptive import AdaptiveConfig, ShadowBlocks
from dflash2_mlx.costs import load_or_measure_costs
from dflash2_mlx.decode import dflash_steps
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.tree import TREE_BUDGET_MAX, default_budget


def bench(
    model,
    tokenizer,
    prompts: list[list[int]],
    methods: list[Method],
    max_tokens: int,
    trials: int,
    temps: list[float],
    classic_draft=None,
    progress: bool = True,
) -> dict:
    """Every method on every prompt, per temperature: a warm-up, then `trials` trials in the ABBA order.

    Args:
        model: the target (an mlx-lm model).
        tokenizer: its tokenizer.
        prompts: the prompts' token ids.
        methods: the rows to run (`bench_methods.methods_for`); the first is the baseline the others' speedup
            and token hash are compared with.
        max_tokens: each generation's length limit.
        trials: runs of every prompt per method and temperature.
        temps: the temperatures.
        classic_draft: the draft model of mlx-lm's classic speculative decoding rows.
        progress: show a progress bar.

    Returns:
        The report's numbers: "results" (a row per method and temperature), "per_prompt", "adaptive_summary",
        "shadow_calibration", "sample_output", "costs" and "errors" (T = 0 rows whose tokens differ from the
        baseline's).
    """

    def attempt(m: Method, run, *args):
        """run(m, *args), except that a peer failing makes its method a row that says why."""
        if m.kind == "peer" and m.peer is None:
            return None
        try:
            return run(m, *args)
        except PeerError as e:
            m.peer, m.note = None, str(e)
            return None

    results, sample, per_prompt, summary, calibration = [], None, [], [], []
    parts = {m.name: [] for m in methods}  # (drafter pass, verify pass) per trial of the first temperature
    with Progress(disable=not progress, transient=True) as bar:
        total = len(temps) * (trials * len(prompts) + 1) * len(methods)
        task = bar.add_task("bench", total=total)
        for temp in temps:
            runs = {m.name: [] for m in methods}
            for m in methods:  # warm-up (compilation, allocator), not counted: a short run of the first prompt
                attempt(m, run_method, model, tokenizer, prompts[0], min(max_tokens, 16), temp, classic_draft)
                bar.advance(task)
            for trial in range(1, trials + 1):
                for m in methods:
                    runs[m.name].append([None] * len(prompts))
                for i, p in enumerate(prompts):
                    for m in methods if (trial + i) % 2 else methods[::-1]:  # ABBA: see the module's docstring
                        mx.random.seed(trial)
                        runs[m.name][-1][i] = attempt(
                            m, run_method, model, tokenizer, p, max_tokens, temp, classic_draft
                        )
                        bar.advance(task)
                if temp == temps[0]:  # greedy timings of each method's passes, right after the trial's runs
                    for m in methods:
                        parts[m.name].append(attempt(m, cycle_parts, model, prompts[0]))
            baseline = method_row(methods[0], runs[methods[0].name], None)
            if sample is None:  # every method agreeing proves nothing if the target itself babbles
                sample = {"temperature": temp, "text": tokenizer.decode(runs[methods[0].name][0][0].tokens)}
            for m in methods:
                if m.kind == "peer" and m.peer is None:
                    row = unavailable_row(m)
                    row["temperature"] = temp
                    results.append(row)
                    continue
                row = method_row(m, runs[m.name], baseline["generation_tps_median"])
                row["temperature"] = temp
                add_cycle_parts(row, [p for p in parts[m.name] if p is not None])
                if temp == 0:
                    row["lossless"] = row["token_sha256"] == baseline["token_sha256"]
                else:
                    row["lossless"] = None  # sampled outputs are checked by the test suite's distribution tests
                results.append(row)
            rows = per_prompt_rows(methods, runs, temp)
            per_prompt += rows
            summary += adaptive_summary(methods, runs, rows)
            if temp > 0:
                calibration += shadow_calibration(model, tokenizer, prompts, methods, results, max_tokens, temp)
    errors = [
        f"{r['method']} at T=0 produced different tokens than {methods[0].name}"
        for r in results
        if r["lossless"] is False
    ]
    return {
        "results": results,
        "per_prompt": per_prompt,
        "adaptive_summary": summary,
        "shadow_calibration": calibration,
        "sample_output": sample,
        "costs": cost_curves(model, methods),
        "errors": errors,
    }


def run_method(
    method: Method, model, tokenizer, prompt: list[int], max_tokens: int, temp: float, classic_draft=None
) -> Run:
    """One generation; tokens exclude EOS so every method is compared on the same footing."""
    eos = set(tokenizer.eos_token_ids)
    if method.kind == "peer":
        seed = int(mx.random.randint(0, 1 << 30, ()).item())  # follows the trial's seed, as ours do
        r = method.peer.request(
            op="run", prompt=prompt, max_tokens=max_tokens, temp=temp, block_size=method.block_size, seed=seed
        )
        return Run(
            [t for t in r["tokens"] if t not in eos],
            r["generation_tps"],
            r["prompt_tps"],
            len(prompt) / r["prompt_tps"],
            r["peak_memory_gb"],
            r["accepted"],
            cycle_s=r["cycle_s"],
        )
    if method.kind in ("mlx-lm", "mlx-lm-spec"):
        spec = method.kind == "mlx-lm-spec"
        kwargs = {"draft_model": classic_draft, "num_draft_tokens": method.block_size - 1} if spec else {}
        tokens, from_draft, last = [], [], None
        for last in mlx_stream(model, tokenizer, prompt, max_tokens=max_tokens, sampler=make_sampler(temp), **kwargs):
            tokens.append(last.token)
            from_draft.append(last.from_draft)
        return Run(
            [t for t in tokens if t not in eos],
            last.generation_tps,
            last.prompt_tps,
            len(prompt) / last.prompt_tps,
            last.peak_memory,
            accepted_per_cycle(from_draft) if spec else [],
        )
    tokens, accepted, plain_tokens, cycle_s, lookup_tokens, last = [], [], 0, [], 0, None
    mode = "off" if method.kind == "plain" else method.kind
    tree = {"tree_budget": method.tree_budget} if mode == "ddtree" else {}
    tic = time.perf_counter()
    for last in stream_cycles(
        model,
        tokenizer,
        prompt,
        method.drafter,
        max_tokens=max_tokens,
        temp=temp,
        block_size=method.block_size,
        verify_mode=mode,
        walk=method.walk,
        copyspec_mode=method.copyspec,
        **tree,
    ):
        tokens += last.tokens
        lookup_tokens += last.accepted if last.branch == "lookup" else 0
        if last.accepted is not None:
            accepted.append(last.accepted)
            cycle_s.append(time.perf_counter() - tic)
        plain_tokens += len(last.tokens) if last.block_size == 1 else 0
        tic = time.perf_counter()
    return Run(
        [t for t in tokens if t not in eos],
        last.generation_tps,
        last.prompt_tps,
        len(prompt) / last.prompt_tps,
        last.peak_memory,
        accepted,
        plain_tokens,
        cycle_s,
        lookup_tokens,
    )


def accepted_per_cycle(from_draft: list[bool]) -> list[int]:
    """Accepted draft counts of mlx-lm's speculative cycles, read off its `from_draft` flags.

    Each cycle yields its accepted draft tokens (True) and then the target's own token (False); a run of
    True flags cut off by max_tokens or EOS has no target token and is not a whole cycle, so it is dropped.
    """
    counts, run = [], 0
    for flag in from_draft:
        if flag:
            run += 1
        else:
            counts.append(run)
            run = 0
    return counts


def cycle_parts(method: Method, model, prompt: list[int], repeats: int = 10) -> tuple[float, float] | None:
    """(drafter pass, target verify pass) of one steady-state cycle in seconds (medians), each timed alone
    outside the loop (the loop itself never waits between its two passes): the prompt is in both caches,
    and the drafter takes one new context row, as a cycle that accepted nothing does. The rest of a
    cycle's time is the loop's own overhead. PeerEngines time theirs the same way (`peer_worker.py`)."""
    if method.kind == "peer":
        t = method.peer.request(op="timings", prompt=prompt, block_size=method.block_size, repeats=repeats)
        return t["draft_s"], t["verify_s"]
    if method.kind != "dflash":
        return None
    drafter, B = method.drafter, method.block_size
    target = bind_drafter(drafter, model)
    cache, draft_cache = target.make_cache(), drafter.make_cache()
    with target.capture() as tap:
        logits, context = tap.prefill(mx.array(prompt), cache)
        block = mx.array([[int(prompt[-1])] + [drafter.config.mask_token_id] * (B - 1)])
        mx.eval(drafter.propose(block, context[None], draft_cache, SamplingParams(), method.walk).tokens)
        draft_s, verify_s = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            proposal = drafter.propose(block, context[None, -1:], draft_cache, SamplingParams(), method.walk)
            mx.eval(proposal.tokens)
            t1 = time.perf_counter()
            verified = tap.verify(mx.concatenate([block[0, :1], proposal.tokens.astype(block.dtype)]), cache)
            mx.eval(verified.logits, verified.features)
            t2 = time.perf_counter()
            tap.rollback(cache, verified, 0)
            for c in draft_cache:
                c.trim(1)
            draft_s.append(t1 - t0)
            verify_s.append(t2 - t1)
    return statistics.median(draft_s), statistics.median(verify_s)


def cost_curves(model, methods: list[Method]) -> list[dict]:
    """The measured cost model behind each adaptive row (the physical limit of drafting on this machine) and
    behind each ddtree row left to the default budget (the verify curve to TREE_BUDGET_MAX + 1 tokens, and the
    budget it picks)."""
    curves, seen = [], set()
    for m in methods:
        tree = m.kind == "ddtree" and m.tree_budget is None
        if (m.kind != "adaptive" and not tree) or (m.drafter_label, m.block_size, tree) in seen:
            continue
        seen.add((m.drafter_label, m.block_size, tree))
        target = bind_drafter(m.drafter, model)
        costs = load_or_measure_costs(target, m.drafter, m.block_size, TREE_BUDGET_MAX + 1 if tree else None)
        step = costs.verify_s[0]
        curves.append(
            {
                "drafter": m.drafter_label,
                "step_s": step,
                "block_size": m.block_size,
                "verify_steps": [s / step for s in costs.verify_s],
                "draft_steps": [s / step for s in costs.draft_s],
                "tree_budget": default_budget(costs, m.block_size) if tree else None,
            }
        )
    return curves


def shadow_calibration(
    model, tokenizer, prompts: list[list[int]], methods: list[Method], results: list[dict], max_tokens: int, temp: float
) -> list[dict]:
    """At T > 0, per drafter: the tau that adaptive mode's shadow probes expect at each fixed block size
    (1 + the mean over probes of sum_i P(drafts 1..i accepted)), from plain decoding with a probe before every
    block_max steps on the same prompts, against the tau the fixed-block rows measured. The probes (like adaptive
    mode's cycles) propose blocks of block_max, a fixed block of B proposes a block of B: at B = block_max the two
    are the same drafter pass, below it the row also shows what the larger block's drafts are worth."""
    eos, rows = set(tokenizer.eos_token_ids), []
    for label, drafter in {m.drafter_label: m.drafter for m in methods if m.kind == "adaptive"}.items():
        measured = {
            r["block_size"]: r["tau"]
            for r in results
            if r["kind"] == "dflash"
            and r["drafter"] == label
            and r["temperature"] == temp
            and r["walk"] == "greedy"
            and r["tau"]
        }
        if not measured:
            continue
        target, block_max = bind_drafter(drafter, model), drafter.config.block_size
        costs = load_or_measure_costs(target, drafter, block_max)
        chains = []
        for seed, prompt in enumerate(prompts, 1):
            mx.random.seed(seed)
            steps = dflash_steps(
                target,
                drafter,
                mx.array(prompt, mx.uint32),
                SamplingParams(temperature=temp),
                ShadowBlocks(costs, AdaptiveConfig(block_max)),
                max_tokens,
            )
            produced = 0
            for step in steps:
                chains += [step.shadow] if step.shadow is not None else []
                produced += len(step.tokens)
                if produced >= max_tokens or eos.intersection(step.tokens):
                    break
            steps.close()
        for B, tau in sorted(measured.items()):
            whole = [c for c in chains if len(c) >= B - 1]
            expected = 1 + sum(sum(c[: B - 1]) for c in whole) / len(whole) if whole else None
            rows.append(
                {
                    "temperature": temp,
                    "drafter": label,
                    "block_size": B,
                    "probe_block": block_max,
                    "probes": len(whole),
                    "expected_tau": expected,
                    "measured_tau": tau,
                    "relative": expected / tau - 1 if expected else None,
                }
            )
    return rows
