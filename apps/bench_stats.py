"""The numbers of `dflash2 bench`, from its runs: a method's row (tokens per second over trials, tau, acceptance
by position, the token hash of the lossless check, the parts of a cycle) and the per-prompt statistics (adaptive
mode against plain decoding and the best fixed block, how repetitive each answer is)."""

from __future__ import annotations

import hashlib
import json
import statistics

from dflash2_apps.bench_methods import Method, Run
from dflash2_mlx.loops import LOOP_SHARE, repetition_share


def token_hash(runs: list[Run]) -> str:
    return hashlib.sha256(json.dumps([r.tokens for r in runs]).encode()).hexdigest()


def acceptance_by_position(accepted: list[int], block_size: int) -> list[float]:
    """Share of cycles whose draft at position j (1..B-1) was accepted: the suffix-decay profile."""
    if not accepted:
        return []
    return [sum(a >= j for a in accepted) / len(accepted) for j in range(1, block_size)]


def method_row(method: Method, trials: list[list[Run]], baseline_tps: float | None) -> dict:
    """trials[t][p]: the run of prompt p in trial t."""
    per_trial_tps = []
    for runs in trials:
        tokens = sum(len(r.tokens) for r in runs)
        seconds = sum(len(r.tokens) / r.generation_tps for r in runs if r.generation_tps > 0)
        per_trial_tps.append(tokens / seconds if seconds else 0.0)
    accepted = [a for runs in trials for r in runs for a in r.accepted]
    cycles = len(accepted)
    median = statistics.median(per_trial_tps)
    return {
        "method": method.name,
        "label": method.label,
        "kind": method.kind,
        "drafter": method.drafter_label,
        "block_size": method.block_size,
        "walk": method.walk if method.kind in ("dflash", "adaptive", "peer") else None,
        "generation_tps_median": median,
        "generation_tps_min": min(per_trial_tps),
        "generation_tps_max": max(per_trial_tps),
        "speedup": median / baseline_tps if baseline_tps else None,
        "tau": (sum(accepted) + cycles) / cycles if cycles else None,
        "cycles": cycles,
        # accepted drafts by where they came from: lookups' continuations (--copyspec-mode) and the drafter
        "lookup_tokens": sum(r.lookup_tokens for runs in trials for r in runs),
        "drafter_tokens": sum(accepted) - sum(r.lookup_tokens for runs in trials for r in runs),
        "copyspec": method.copyspec if method.drafter is not None else None,
        "plain_share": (
            sum(r.plain_tokens for runs in trials for r in runs)
            / max(1, sum(len(r.tokens) for runs in trials for r in runs))
        )
        if method.kind == "adaptive"
        else None,
        "acceptance_by_position": acceptance_by_position(accepted, method.block_size) if cycles else [],
        "prompt_tps_median": statistics.median(r.prompt_tps for runs in trials for r in runs),
        "ttft_s_median": statistics.median(r.ttft_s for runs in trials for r in runs),
        "peak_memory_gb": max(r.peak_memory_gb for runs in trials for r in runs),
        "token_sha256": token_hash(trials[0]),
        # the median cycle: a cycle stalled by another process on a shared machine does not move it
        "cycle_ms": 1000 * statistics.median(t for runs in trials for r in runs for t in r.cycle_s)
        if cycles and method.kind in ("dflash", "peer")
        else None,
        "note": method.note,
    }


def unavailable_row(method: Method) -> dict:
    """The row of a peer that cannot run: its reason, no numbers."""
    keys = (
        "generation_tps_median",
        "generation_tps_min",
        "generation_tps_max",
        "speedup",
        "tau",
        "plain_share",
        "prompt_tps_median",
        "ttft_s_median",
        "peak_memory_gb",
        "token_sha256",
        "cycle_ms",
        "lossless",
    )
    return {
        "method": method.name,
        "label": method.label,
        "kind": method.kind,
        "drafter": method.drafter_label,
        "block_size": method.block_size,
        "walk": method.walk,
        "cycles": 0,
        "acceptance_by_position": [],
        "note": method.note,
        **dict.fromkeys(keys),
    }


def add_cycle_parts(row: dict, parts: list[tuple[float, float]]) -> None:
    """draft_share (the drafter's part of draft + verify) and, with the row's measured cycle time, the
    per-cycle overhead: cycle time minus the drafter and verify passes (`parts`: those of each trial)."""
    draft_s, verify_s = (statistics.median(p[i] for p in parts) for i in (0, 1)) if parts else (None, None)
    row["draft_share"] = draft_s / (draft_s + verify_s) if parts else None
    row["draft_ms"] = 1000 * draft_s if parts else None
    row["verify_ms"] = 1000 * verify_s if parts else None
    row["overhead_ms"] = row["cycle_ms"] - row["draft_ms"] - row["verify_ms"] if parts and row["cycle_ms"] else None


# -- per prompt: adaptive mode against plain decoding and the best fixed block ----------------------------


def prompt_tps(trials: list[list[Run]], p: int | list[int]) -> float:
    """Tokens per second of prompt p (or of the prompts in a list) over all trials (their tokens over their
    seconds: over an ABBA pair of trials a linear drift weighs on every method alike)."""
    runs = [
        runs[i]
        for runs in trials
        for i in ([p] if isinstance(p, int) else p)
        if runs[i] is not None and runs[i].generation_tps > 0
    ]
    seconds = sum(len(r.tokens) / r.generation_tps for r in runs)
    return sum(len(r.tokens) for r in runs) / seconds if seconds else 0.0


def tps_ratio(ours: list[list[Run]], theirs: list[list[Run]], prompts: list[int]) -> float | None:
    """`prompt_tps` of one method's trials over another's on the same prompts (None where the other's is 0)."""
    their_tps = prompt_tps(theirs, prompts)
    return prompt_tps(ours, prompts) / their_tps if their_tps else None


def per_prompt_rows(methods: list[Method], runs: dict, temp: float) -> list[dict]:
    """Per prompt and drafter: adaptive mode against plain decoding and the best fixed block of the same drafter
    (on that prompt), in tokens per second: where adaptive mode drafts, and whether it picks well.

    How much of a difference is the machine's: `vs_plain_trials` and `vs_best_trials` are the lowest and highest
    of the same ratios trial by trial (each of a trial's runs seconds apart, the ABBA order of `bench.py`), and
    `same_work_vs_plain` is mlx-lm's tokens per second over plain decoding's, when both ran: the same forwards
    through two loops, so its distance from 1.00x is what noise alone moves a ratio on this run.

    `repeat` is how far adaptive mode's answers go round in a loop: the share of their 8-grams that occurred
    earlier in the same answer (`repetition_share`), the mean over trials (at T = 0 every trial's answer is the
    same)."""
    plain = next((m for m in methods if m.kind == "plain"), None)
    same = next((m for m in methods if m.kind == "mlx-lm"), None)
    rows = []
    for m in methods:
        if m.kind != "adaptive" or plain is None:
            continue
        fixed = [f for f in methods if f.kind == "dflash" and f.drafter_label == m.drafter_label]
        for p in range(len(runs[m.name][0])):
            tps = {f.name: prompt_tps(runs[f.name], p) for f in fixed}
            best = max(tps, key=tps.get) if tps else None
            plain_tps, adaptive_tps = prompt_tps(runs[plain.name], p), prompt_tps(runs[m.name], p)
            adaptive_runs = [r[p] for r in runs[m.name]]
            tokens = sum(len(r.tokens) for r in adaptive_runs)
            rivals = [plain.name] + ([best] if best else [])
            rows.append(
                {
                    "temperature": temp,
                    "prompt": p + 1,
                    "drafter": m.drafter_label,
                    "plain_tps": plain_tps,
                    "adaptive_tps": adaptive_tps,
                    "best_fixed": best,
                    "best_fixed_tps": tps[best] if best else None,
                    "vs_plain": adaptive_tps / plain_tps if plain_tps else None,
                    "vs_best": adaptive_tps / max(plain_tps, tps[best] if best else 0.0) if plain_tps else None,
                    "vs_plain_trials": trial_range(runs, m.name, [plain.name], p),
                    "vs_best_trials": trial_range(runs, m.name, rivals, p),
                    "same_work_vs_plain": prompt_tps(runs[same.name], p) / plain_tps if same and plain_tps else None,
                    "plain_share": sum(r.plain_tokens for r in adaptive_runs) / max(1, tokens),
                    "tokens": tokens / len(adaptive_runs),  # new tokens per run: under max_tokens where it ended at EOS
                    "repeat": statistics.mean(repetition_share(r.tokens) for r in adaptive_runs),
                    "fixed_tps": tps,
                }
            )
    return rows


def adaptive_summary(methods: list[Method], runs: dict, rows: list[dict]) -> list[dict]:
    """Per drafter: adaptive mode's tokens per second over plain decoding's on every prompt (all their tokens over
    all their seconds, every trial), and on the prompts whose answers are not in a loop (`rows`' "repeat" under
    `LOOP_SHARE`: a loop is easy to draft, so it lifts the first figure above what answers that say something
    new get); `in_loop` names the prompts left out.

    Args:
        methods: the bench's methods.
        runs: each method's runs of one temperature, trial by trial (`runs[name][trial][prompt]`).
        rows: `per_prompt_rows` of the same runs.
    """
    plain = next((m for m in methods if m.kind == "plain"), None)
    out = []
    for m in methods:
        mine = [r for r in rows if r["drafter"] == m.drafter_label]
        if m.kind != "adaptive" or plain is None or not mine:
            continue
        loop_free = [r["prompt"] - 1 for r in mine if r["repeat"] < LOOP_SHARE]
        out.append(
            {
                "temperature": mine[0]["temperature"],
                "drafter": m.drafter_label,
                "prompts": len(mine),
                "vs_plain": tps_ratio(runs[m.name], runs[plain.name], [r["prompt"] - 1 for r in mine]),
                "loop_free_prompts": len(loop_free),
                "loop_free_vs_plain": tps_ratio(runs[m.name], runs[plain.name], loop_free),
                "loop_share": LOOP_SHARE,
                "in_loop": [{"prompt": r["prompt"], "repeat": r["repeat"]} for r in mine if r["repeat"] >= LOOP_SHARE],
            }
        )
    return out


def trial_range(runs: dict, name: str, rivals: list[str], p: int) -> list[float] | None:
    """[lowest, highest] over trials of method `name`'s tokens per second on prompt p over the fastest of
    `rivals`' in the same trial (None if a trial lacks a run)."""
    ratios = []
    for t, mine in enumerate(runs[name]):
        theirs = [runs[r][t][p] for r in rivals]
        if mine[p] is None or any(r is None or r.generation_tps <= 0 for r in theirs):
            return None
        ratios.append(mine[p].generation_tps / max(r.generation_tps for r in theirs))
    return [min(ratios), max(ratios)] if ratios else None
