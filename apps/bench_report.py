"""The report of `dflash2 bench`: rich tables and bars on the terminal, the same as markdown, and JSON."""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict

from rich.console import Console
from rich.table import Table

from dflash2_mlx.sparkline import sparkline


def _bar(value: float, scale: float, width: int = 30) -> str:
    n = max(0, min(width, round(value / scale * width))) if scale else 0
    return "█" * n + "·" * (width - n)


def report_console():
    """A console as wide as the terminal, or wide enough for the tables when the output is a file."""
    return Console(width=None if sys.stdout.isatty() else 150)


def render(report: dict, console=None) -> str:
    """Rich tables and bars on the console; returns the same report as markdown to paste into an issue."""
    console = console or report_console()
    ctx = report["context"]
    head = (f"{ctx['target']} | {ctx['runtime']['backend']} ({ctx['runtime']['machine']}), MLX {ctx['runtime']['mlx']}, "
            f"BLAS {ctx['runtime']['blas']}, kernels {ctx['runtime']['kernels']}, {ctx['dtype']} | "
            f"{ctx['prompts']} prompts ({ctx['suites']}) x {ctx['trials']} trials, {ctx['max_tokens']} max tokens")
    console.print(f"[bold]dflash2 bench[/] {head}")
    columns = ["method", "T", "tok/s", "min-max", "speedup", "tau", "plain %", "prompt tok/s", "TTFT s", "peak GB",
               "draft %", "ms/cycle (rest)", "lossless", "accepted by position"]
    table = Table(*columns)
    table.columns[12].no_wrap = True
    md = [f"**dflash2 bench** {head}", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    notes = {}  # note -> the methods it is about
    for r in report["results"]:
        if r.get("note"):
            notes.setdefault(r["note"], []).append(r["method"])
        if r["generation_tps_median"] is None:  # a peer that cannot run: the note says why
            row = [r["method"], f"{r['temperature']:g}"] + ["-"] * 10 + ["cannot run (see note)", ""]
        else:
            row = [
                r["method"], f"{r['temperature']:g}", f"{r['generation_tps_median']:.1f}",
                f"{r['generation_tps_min']:.1f}-{r['generation_tps_max']:.1f}",
                f"{r['speedup']:.2f}x" if r["speedup"] else "-",
                f"{r['tau']:.2f}" if r["tau"] else "-",
                f"{r['plain_share']:.0%}" if r.get("plain_share") is not None else "-",
                f"{r['prompt_tps_median']:.0f}", f"{r['ttft_s_median']:.2f}", f"{r['peak_memory_gb']:.2f}",
                f"{r['draft_share']:.0%}" if r["draft_share"] is not None else "-",
                f"{r['cycle_ms']:.1f} ({r['overhead_ms']:.1f})" if r.get("overhead_ms") is not None else "-",
                {True: "yes", False: "NO (mismatch)", None: "n/a (T>0)"}[r["lossless"]],
                sparkline(r["acceptance_by_position"], 0.0, 1.0),
            ]
        md.append("| " + " | ".join(row) + " |")
        style = {"yes": "green", "NO (mismatch)": "bold red"}.get(row[12])
        table.add_row(*row[:12], f"[{style}]{row[12]}[/]" if style else row[12], row[13])
    console.print(table)
    split = [f"{r['method']} T={r['temperature']:g}: {r['cycle_ms']:.1f} = {r['draft_ms']:.1f} + "
             f"{r['verify_ms']:.1f} + {r['overhead_ms']:.1f}" for r in report["results"] if r.get("overhead_ms") is not None]
    if split:
        lines = ["ms per cycle = drafter pass + verify pass + the rest (the loop's own overhead; the passes timed "
                 "alone in steady state, right after each trial's runs):", *split]
        console.print("\n  ".join(lines), markup=False, highlight=False)
        md.append("\n" + "\n".join(f"- {x}" if i else x for i, x in enumerate(lines)))
    for note, methods in notes.items():
        line = f"{', '.join(dict.fromkeys(methods))}: {note}"
        console.print(line, markup=False, highlight=False)
        md.append(f"\n{line}")
    md += render_per_prompt(report.get("per_prompt", []), console, ctx["max_tokens"])
    for c in report.get("shadow_calibration", []):
        line = (f"shadow calibration {c['drafter']} T={c['temperature']:g} B={c['block_size']}: tau expected from "
                f"{c['probes']} shadow probes{_probe_block(c)} {c['expected_tau']:.3f}, measured by fixed-block cycles "
                f"{c['measured_tau']:.3f} ({c['relative']:+.1%})" if c["expected_tau"] else
                f"shadow calibration {c['drafter']} T={c['temperature']:g} B={c['block_size']}: no shadow probe")
        console.print(line, markup=False, highlight=False)
        md.append(f"\n{line}")
    top = max((r["speedup"] or 0) for r in report["results"]) or 1
    console.print("[bold]speedup over mlx-lm[/] (same run)")
    width = max(len(r["method"]) for r in report["results"])
    for r in report["results"]:
        if r["speedup"]:
            console.print(f"  {r['method']:{width}s} T={r['temperature']:<4g}{_bar(r['speedup'], top)} {r['speedup']:.2f}x")
    for r in report["results"]:
        if r["acceptance_by_position"]:
            profile = ", ".join(f"{p:.2f}" for p in r["acceptance_by_position"])
            md.append(f"\n{r['method']} T={r['temperature']:g} accepted by position 1..{len(r['acceptance_by_position'])}: "
                      f"{profile}")
    for c in report.get("costs", []):
        line = (f"cost curve with {c['drafter']} (target forward over n tokens / one plain step, n = 1..): "
                + " ".join(f"{x:.2f}" for x in c["verify_steps"])
                + f"; drafter pass {c['draft_steps'][0]:.2f}-{c['draft_steps'][-1]:.2f} steps; plain step "
                f"{1000 * c['step_s']:.0f} ms"
                + (f"; default tree budget at B={c['block_size']}: {c['tree_budget']} nodes"
                   if c.get("tree_budget") else ""))
        console.print(line, markup=False, highlight=False)
        md.append(f"\n{line}")
    sample = report.get("sample_output")
    if sample:
        text = " ".join(sample["text"].split())
        text = text[:200] + (" ..." if len(text) > 200 else "")
        line = f"{report['results'][0]['method']} output of prompt 1 (T={sample['temperature']:g}): {text}"
        console.print(line, markup=False, highlight=False)
        md.append(f"\n{line}")
    for e in report["errors"]:
        console.print(f"[bold red]error:[/] {e}")
        md.append(f"\n**error:** {e}")
    return "\n".join(md) + "\n"


def render_per_prompt(rows: list[dict], console, max_tokens: int | None = None) -> list[str]:
    """The per-prompt table (adaptive vs plain vs the best fixed block), its markdown lines. Each ratio carries
    its range over trials, and where mlx-lm ran, its ratio to plain decoding (the same work) says how far noise
    alone moves a ratio on this run. The prompts whose answers ended before `max_tokens` are named: a ratio over
    fewer tokens weighs the generation's start (prefill, first cycles) more, and is noisier."""
    if not rows:
        return []
    same = any(r.get("same_work_vs_plain") for r in rows)
    columns = ["T", "prompt", "tokens", "drafter", "plain tok/s", "best fixed", "tok/s", "adaptive tok/s", "plain %",
               "vs plain", "vs best"] + (["mlx-lm vs plain"] if same else [])
    table = Table(*columns, title="adaptive mode per prompt (tok/s over all trials)")
    md = ["", "adaptive mode per prompt (tok/s over all trials; vs best = against the faster of plain and the "
          "best fixed block on that prompt; in brackets the lowest and highest of the ratio trial by trial"
          + ("; mlx-lm vs plain: the same forwards through two loops, i.e. how far noise alone moves a ratio"
             if same else "") + "):", "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        row = [f"{r['temperature']:g}", str(r["prompt"]), _tokens(r.get("tokens")), r["drafter"],
               f"{r['plain_tps']:.1f}", r["best_fixed"] or "-",
               f"{r['best_fixed_tps']:.1f}" if r["best_fixed_tps"] else "-", f"{r['adaptive_tps']:.1f}",
               f"{r['plain_share']:.0%}",
               _ratio(r["vs_plain"], r.get("vs_plain_trials")), _ratio(r["vs_best"], r.get("vs_best_trials"))]
        row += [_ratio(r.get("same_work_vs_plain"), None)] if same else []
        table.add_row(*row)
        md.append("| " + " | ".join(row) + " |")
    console.print(table)
    worst = min((r["vs_best"] for r in rows if r["vs_best"]), default=None)
    if worst is not None:
        line = (f"adaptive vs the best of plain and fixed blocks per prompt: worst {worst:.2f}x, median "
                f"{statistics.median(r['vs_best'] for r in rows if r['vs_best']):.2f}x; vs plain: worst "
                f"{min(r['vs_plain'] for r in rows if r['vs_plain']):.2f}x")
        noise = [r["same_work_vs_plain"] for r in rows if r.get("same_work_vs_plain")]
        if noise:
            line += (f"; mlx-lm vs plain (the same work) per prompt {min(noise):.2f}-{max(noise):.2f}x: "
                     "differences inside that band are this run's noise")
        console.print(line, markup=False, highlight=False)
        md.append(f"\n{line}")
    short = [r for r in rows if max_tokens and r.get("tokens") is not None and r["tokens"] < max_tokens]
    if short:
        temps = len({r["temperature"] for r in rows}) > 1
        line = f"answers shorter than --max-tokens {max_tokens} (they ended at EOS): " + ", ".join(
            f"prompt {r['prompt']}" + (f" T={r['temperature']:g}" if temps else "") + f" {_tokens(r['tokens'])} tokens"
            for r in short)
        console.print(line, markup=False, highlight=False)
        md.append(f"\n{line}")
    return md


def _tokens(n: float | None) -> str:
    """New tokens per run: whole at T = 0 (every trial's answer is the same), to one decimal where they vary."""
    return "-" if n is None else f"{n:.0f}" if n == int(n) else f"{n:.1f}"


def _ratio(value: float | None, trials: list[float] | None) -> str:
    """'0.96x', with the range over trials when known: '0.96x (0.90-1.02)'."""
    if not value:
        return "-"
    return f"{value:.2f}x" + (f" ({trials[0]:.2f}-{trials[1]:.2f})" if trials else "")


def report_json(report: dict) -> str:
    return json.dumps(report, indent=2, default=lambda o: asdict(o) if hasattr(o, "__dataclass_fields__") else str(o))


def _probe_block(calibration: dict) -> str:
    """' (blocks of N)' where the probes proposed larger blocks than the fixed-block cycles they are compared with
    (reports made before the field existed say nothing)."""
    n = calibration.get("probe_block")
    return f" (blocks of {n})" if n and n != calibration["block_size"] else ""
