"""The report of `dflash2 bench`: rich tables and bars on the terminal, the same as markdown, and JSON (the
statistics behind them are `bench_stats.py`); what a report records of the code that made it (the commit, the
version)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from dflash2_mlx import __version__
from dflash2_mlx.loops import LOOP_SHARE, NGRAM
from dflash2_mlx.sparkline import sparkline

# The results table's columns: all of them in the markdown (and with `--wide`), the first ones a reader looks at
# on the terminal by default (T only where the bench ran several temperatures; "lookup / drafter", the accepted
# drafts by where they came from, only where lookups gave some).
COLUMNS = (
    "method",
    "T",
    "tok/s",
    "min-max",
    "vs mlx-lm",
    "tau",
    "lookup / drafter",
    "plain %",
    "prompt tok/s",
    "TTFT s",
    "peak GB",
    "draft %",
    "ms/cycle (rest)",
    "lossless",
    "accepted by position",
)


FIRST_COLUMNS = ("method", "T", "tok/s", "vs mlx-lm", "tau", "lookup / drafter", "lossless")
LOOKUP_COLUMN_WIDTH = 100  # the terminal width from which the first table has room for "lookup / drafter"


def source_commit(folder: Path | None = None) -> str | None:
    """`git describe --always --dirty` of the checkout that holds `folder` (default: this package's), None outside
    one (an installed package, no git) or where the checkout ignores the folder (a venv inside it).

    Args:
        folder: the code whose commit to name.
    """
    here = (folder or Path(__file__).parent).resolve()
    try:
        if subprocess.run(["git", "check-ignore", "-q", str(here)], cwd=here, capture_output=True).returncode == 0:
            return None  # installed into an ignored folder of some checkout: not that checkout's code
        out = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=here, capture_output=True, text=True)
    except OSError:  # no git
        return None
    return (out.stdout.strip() or None) if out.returncode == 0 else None


def report_context() -> dict:
    """What every bench report records of the code that made it: the commit (None outside a git checkout) and
    the package version."""
    return {"commit": source_commit(), "version": __version__}


def report_console():
    """A console as wide as the terminal (or $COLUMNS), or wide enough for the tables when the output is a file."""
    return Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 150)


def _bar(value: float, scale: float, width: int = 30) -> str:
    n = max(0, min(width, round(value / scale * width))) if scale else 0
    return "█" * n + "·" * (width - n)


# -- the report -------------------------------------------------------------------------------------------


def header_lines(ctx: dict, temps: list[float]) -> list[str]:
    """What ran, on what, how long: the code and the target, the drafters (named once, by the names the rows
    use), the machine, the prompts."""
    rt, names = ctx["runtime"], ctx.get("drafter_names") or {}
    drafters = ", ".join(f"{short} = {label}" for label, short in names.items()) or ", ".join(ctx.get("drafters", []))
    code = ""
    if ctx.get("version"):  # reports made before the context recorded it say nothing
        code = f"{ctx['version']}" + (f" ({ctx['commit']})" if ctx.get("commit") else "") + " · "
    trials = f"{ctx['trials']} trial" + ("s" if ctx["trials"] != 1 else "")
    return [
        f"{code}{ctx['target']}",
        *([f"drafters: {drafters}"] if drafters else []),
        f"{rt['backend']} ({rt['machine']}), MLX {rt['mlx']}, BLAS {rt['blas']}, kernels {rt['kernels']}, "
        f"{ctx['dtype']}",
        f"{ctx['prompts']} prompts ({ctx['suites']}) x {trials}, {ctx['max_tokens']} max tokens, T = "
        + ", ".join(f"{t:g}" for t in temps),
    ]


def result_cells(r: dict) -> dict:
    """A results row as the report's cells, by column (`COLUMNS`)."""
    cells = {"method": r.get("label") or r["method"], "T": f"{r['temperature']:g}"}
    if r["generation_tps_median"] is None:  # a peer that cannot run: the note says why
        return {**dict.fromkeys(COLUMNS, "-"), **cells, "lossless": "cannot run (see note)", "accepted by position": ""}
    return {
        **cells,
        "tok/s": f"{r['generation_tps_median']:.1f}",
        "min-max": f"{r['generation_tps_min']:.1f}-{r['generation_tps_max']:.1f}",
        "vs mlx-lm": f"{r['speedup']:.2f}x" if r["speedup"] else "-",
        "tau": f"{r['tau']:.2f}" if r["tau"] else "-",
        "lookup / drafter": f"{r['lookup_tokens']} / {r['drafter_tokens']}"
        if r["cycles"] and "lookup_tokens" in r
        else "-",
        "plain %": f"{r['plain_share']:.0%}" if r.get("plain_share") is not None else "-",
        "prompt tok/s": f"{r['prompt_tps_median']:.0f}",
        "TTFT s": f"{r['ttft_s_median']:.2f}",
        "peak GB": f"{r['peak_memory_gb']:.2f}",
        "draft %": f"{r['draft_share']:.0%}" if r.get("draft_share") is not None else "-",
        "ms/cycle (rest)": f"{r['cycle_ms']:.1f} ({r['overhead_ms']:.1f})" if r.get("overhead_ms") is not None else "-",
        "lossless": {True: "yes", False: "NO (mismatch)", None: "n/a (T>0)"}[r["lossless"]],
        "accepted by position": sparkline(r["acceptance_by_position"], 0.0, 1.0),
    }


def render(report: dict, console=None, wide: bool = False) -> str:
    """Rich tables and bars on the console; returns the same report as markdown to paste into an issue.

    Args:
        report: what `bench` returned, with its "context".
        console: where the tables go (default: `report_console()`).
        wide: every column on the console, not only the first ones a reader looks at (`FIRST_COLUMNS`); the
            markdown has them all either way.
    """
    console = console or report_console()
    ctx, results = report["context"], report["results"]
    temps = sorted({r["temperature"] for r in results})
    names = ctx.get("drafter_names") or {}
    labels = {r["method"]: r.get("label") or r["method"] for r in results}
    head = header_lines(ctx, temps)
    console.print(Text.assemble(("dflash2 bench", "bold"), f" {head[0]}"))
    for line in head[1:]:
        console.print(line, markup=False, highlight=False)
    copied = any(r.get("lookup_tokens") for r in results)
    column = copied and console.width >= LOOKUP_COLUMN_WIDTH  # narrower: a line under the table says the same
    first = [c for c in FIRST_COLUMNS if (c != "T" or len(temps) > 1) and (c != "lookup / drafter" or column)]
    more = ["method", *(c for c in COLUMNS if c not in FIRST_COLUMNS or c == "T" and len(temps) > 1)]
    tables = [(Table(*first), first)] + ([(Table(*more, title="more per method"), more)] if wide else [])
    for table, _ in tables:
        _fit(table, table.title is not None)
    md = [
        f"**dflash2 bench** {head[0]}  ",
        *(f"{line}  " for line in head[1:-1]),
        head[-1],
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    notes = {}  # note -> the methods it is about
    for r in results:
        if r.get("note"):
            notes.setdefault(r["note"], []).append(labels[r["method"]])
        cells = result_cells(r)
        md.append("| " + " | ".join(cells[c] for c in COLUMNS) + " |")
        style = {"yes": "green", "NO (mismatch)": "bold red"}.get(cells["lossless"])
        if style:
            cells["lossless"] = f"[{style}]{cells['lossless']}[/]"
        for table, shown in tables:
            table.add_row(*(cells[c] for c in shown))
    for table, _ in tables:
        console.print(table)
    if copied and not column:
        counts = [f"{labels[r['method']]} {result_cells(r)['lookup / drafter']}" for r in results if r.get("cycles")]
        console.print("accepted drafts, lookup / drafter: " + ", ".join(counts), markup=False, highlight=False)
    split = [
        f"{labels[r['method']]} T={r['temperature']:g}: {r['cycle_ms']:.1f} = {r['draft_ms']:.1f} + "
        f"{r['verify_ms']:.1f} + {r['overhead_ms']:.1f}"
        for r in results
        if r.get("overhead_ms") is not None
    ]
    if split:
        lines = [
            "ms per cycle = drafter pass + verify pass + the rest (the loop's own overhead; the passes timed "
            "alone in steady state, right after each trial's runs):",
            *split,
        ]
        if wide:
            console.print("\n  ".join(lines), markup=False, highlight=False)
        md.append("\n" + "\n".join(f"- {x}" if i else x for i, x in enumerate(lines)))
    for note, methods in notes.items():
        line = f"{', '.join(dict.fromkeys(methods))}: {note}"
        console.print(line, markup=False, highlight=False)
        md.append(f"\n{line}")
    md += render_per_prompt(
        report.get("per_prompt", []),
        console,
        ctx["max_tokens"],
        labels,
        names,
        wide,
        report.get("adaptive_summary", []),
    )
    for c in report.get("shadow_calibration", []):
        who = f"{names.get(c['drafter'], c['drafter'])} T={c['temperature']:g} B={c['block_size']}"
        line = (
            f"shadow calibration {who}: tau expected from {c['probes']} shadow probes{_probe_block(c)} "
            f"{c['expected_tau']:.3f}, measured by fixed-block cycles {c['measured_tau']:.3f} "
            f"({c['relative']:+.1%})"
            if c["expected_tau"]
            else f"shadow calibration {who}: no shadow probe"
        )
        console.print(line, markup=False, highlight=False)
        md.append(f"\n{line}")
    top = max((r["speedup"] or 0) for r in results) or 1
    console.print("[bold]speedup over mlx-lm[/] (same run)")
    width = max(len(label) for label in labels.values())
    for r in results:
        if r["speedup"]:
            temp = f" T={r['temperature']:<4g}" if len(temps) > 1 else ""
            console.print(
                f"  {labels[r['method']]:{width}s}{temp} {_bar(r['speedup'], top)} {r['speedup']:.2f}x",
                markup=False,
                highlight=False,
            )
    for r in results:
        if r["acceptance_by_position"]:
            profile = ", ".join(f"{p:.2f}" for p in r["acceptance_by_position"])
            md.append(
                f"\n{labels[r['method']]} T={r['temperature']:g} accepted by position "
                f"1..{len(r['acceptance_by_position'])}: {profile}"
            )
    for c in ctx.get("costs", report.get("costs", [])):
        name = names.get(c["drafter"], c["drafter"])
        lines = [
            f"cost curve with {name} (target forward over n tokens / one plain step, n = 1..): "
            + " ".join(f"{x:.2f}" for x in c["verify_steps"])
            + f"; drafter pass {c['draft_steps'][0]:.2f}-{c['draft_steps'][-1]:.2f} steps; plain step "
            f"{1000 * c['step_s']:.0f} ms"
        ]
        if c.get("tree_budget"):  # a line of its own: the curve's line wraps on a narrow terminal
            lines.append(
                f"default tree budget at B={c['block_size']}: {c['tree_budget']} nodes (from the cost curve "
                f"with {name})"
            )
        for line in lines:
            console.print(line, markup=False, highlight=False)
            md.append(f"\n{line}")
    sample = report.get("sample_output")
    if sample:
        text = " ".join(sample["text"].split())
        text = text[:200] + (" ..." if len(text) > 200 else "")
        line = f"{labels[results[0]['method']]} output of prompt 1 (T={sample['temperature']:g}): {text}"
        console.print(line, markup=False, highlight=False)
        md.append(f"\n{line}")
    for e in report["errors"]:
        console.print(f"[bold red]error:[/] {e}")
        md.append(f"\n**error:** {e}")
    return "\n".join(md) + "\n"


def render_per_prompt(
    rows: list[dict],
    console,
    max_tokens: int | None = None,
    labels: dict | None = None,
    names: dict | None = None,
    wide: bool = False,
    summaries: Sequence[dict] = (),
) -> list[str]:
    """The per-prompt tables (adaptive vs plain vs the best fixed block), their markdown lines. Each ratio carries
    its range over trials, and where mlx-lm ran, its ratio to plain decoding (the same work) says how far noise
    alone moves a ratio on this run. `repeat` is the share of the answer's 8-grams that occurred earlier in it
    (`repetition_share`): the summary gives adaptive mode's speedup over every prompt and over the prompts whose
    answers are not in a loop (`LOOP_SHARE`), and names those left out. The prompts whose answers ended before
    `max_tokens` are named: a ratio over fewer tokens weighs the generation's start (prefill, first cycles) more,
    and is noisier.

    Args:
        rows: `per_prompt_rows` of every temperature.
        console: where the tables go: one per drafter and temperature.
        max_tokens: the answers' length limit (None: not compared).
        labels: the name each method's row goes by on the report (default: the method's own name).
        names: the name each drafter goes by on the report (default: its own).
        wide: every column on the console (the markdown has them all either way).
        summaries: `adaptive_summary` of every temperature.
    """
    if not rows:
        return []
    labels, names = labels or {}, names or {}
    same = any(r.get("same_work_vs_plain") for r in rows)
    temps = len({r["temperature"] for r in rows}) > 1
    columns = [
        "T",
        "prompt",
        "tokens",
        "repeat",
        "drafter",
        "plain tok/s",
        "best fixed",
        "tok/s",
        "adaptive tok/s",
        "plain %",
        "vs plain",
        "vs best",
    ] + (["mlx-lm vs plain"] if same else [])
    md = [
        "",
        "adaptive mode per prompt (tok/s over all trials; repeat = the share of the answer's "
        f"{NGRAM}-grams that occurred earlier in it, a loop from {LOOP_SHARE:.0%}; vs best = against the faster of "
        "plain and the best fixed block on that prompt; in brackets the lowest and highest of the ratio trial by "
        "trial"
        + (
            "; mlx-lm vs plain: the same forwards through two loops, i.e. how far noise alone moves a ratio"
            if same
            else ""
        )
        + "):",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    groups = {}  # (temperature, drafter) -> its rows
    for r in rows:
        groups.setdefault((r["temperature"], r["drafter"]), []).append(r)
        cells = _prompt_cells(r, labels, names)
        md.append("| " + " | ".join(cells[c] for c in columns) + " |")
    lines = []
    for (temp, drafter), mine in groups.items():
        who = f"{names.get(drafter, drafter)} · adaptive"
        shown = ["prompt", "tokens", "repeat", "plain", "best fixed", "adaptive", "vs plain", "vs best"] + (
            ["plain %"] + (["mlx-lm vs plain"] if same else []) if wide else []
        )
        table = Table(
            *shown, title=f"{who} per prompt" + (f", T={temp:g}" if temps else "") + " (tok/s over all trials)"
        )
        _fit(table, wide)
        for r in mine:
            cells = _prompt_cells(r, labels, names, ranges=wide)
            best = _fixed_label(r["best_fixed"], drafter, labels, names) if r["best_fixed"] else None
            cells.update(
                {
                    "plain": cells["plain tok/s"],
                    "best fixed": f"{cells['tok/s']} ({best})" if best else "-",
                    "adaptive": cells["adaptive tok/s"],
                }
            )
            table.add_row(*(cells[c] for c in shown))
        console.print(table)
        summary = next((s for s in summaries if (s["temperature"], s["drafter"]) == (temp, drafter)), None)
        group = [summary_line(who + (f" T={temp:g}" if temps else ""), summary)] if summary else []
        group += [_spread_line(who, mine)] if any(r["vs_best"] for r in mine) else []
        for line in group:
            console.print(line, markup=False, highlight=False)
        lines += group
    short = [r for r in rows if max_tokens and r.get("tokens") is not None and r["tokens"] < max_tokens]
    if short:
        lines.append(
            f"answers shorter than --max-tokens {max_tokens} (they ended at EOS): "
            + ", ".join(
                dict.fromkeys(
                    f"prompt {r['prompt']}"
                    + (f" T={r['temperature']:g}" if temps else "")
                    + f" {_tokens(r['tokens'])} tokens"
                    for r in short
                )
            )
        )
        console.print(lines[-1], markup=False, highlight=False)
    return md + [f"\n{line}" for line in lines]


def summary_line(who: str, s: dict) -> str:
    """Adaptive mode's speedup over plain decoding on every prompt and on the loop-free ones, side by side, e.g.
    'DFlash 2 · adaptive: 1.12x of plain (loop-free prompts: 1.04x, 6 of 8; left out, their answers in a loop:
    prompt 3 81% repeated, prompt 7 62%)'. The loop-free figure is the one to quote."""
    if not s["vs_plain"]:
        return f"{who}: no plain run to compare with"
    loop_free = (
        f"{s['loop_free_vs_plain']:.2f}x, {s['loop_free_prompts']} of {s['prompts']}"
        if s["loop_free_vs_plain"]
        else f"none of {s['prompts']}"
    )
    left = ", ".join(
        f"prompt {x['prompt']} {x['repeat']:.0%}" + (" repeated" if not i else "") for i, x in enumerate(s["in_loop"])
    )
    return f"{who}: {s['vs_plain']:.2f}x of plain (loop-free prompts: {loop_free}" + (
        f"; left out, their answers in a loop: {left}); quote the loop-free figure" if left else ")"
    )


def _spread_line(who: str, rows: list[dict]) -> str:
    """Adaptive mode's worst and median ratio per prompt, and the noise band of the run where mlx-lm ran."""
    best = [r["vs_best"] for r in rows if r["vs_best"]]
    line = (
        f"{who} vs the best of plain and fixed blocks per prompt: worst {min(best):.2f}x, median "
        f"{statistics.median(best):.2f}x; vs plain: worst {min(r['vs_plain'] for r in rows if r['vs_plain']):.2f}x"
    )
    noise = [r["same_work_vs_plain"] for r in rows if r.get("same_work_vs_plain")]
    if noise:
        line += (
            f"; mlx-lm vs plain (the same work) per prompt {min(noise):.2f}-{max(noise):.2f}x: "
            "differences inside that band are this run's noise"
        )
    return line


def _fit(table: Table, wrap: bool) -> None:
    """Each row on one line, or (`wrap`: the columns `--wide` adds) wrapped where the console is too narrow for
    them all; a cell is never cut short."""
    for column in table.columns:
        column.no_wrap, column.overflow = not wrap or column.header in ("method", "prompt"), "fold"


def _prompt_cells(r: dict, labels: dict, names: dict, ranges: bool = True) -> dict:
    """A per-prompt row as cells, by column (ratios with their range over trials where `ranges`)."""
    return {
        "T": f"{r['temperature']:g}",
        "prompt": str(r["prompt"]),
        "tokens": _tokens(r.get("tokens")),
        "repeat": f"{r['repeat']:.0%}" if r.get("repeat") is not None else "-",
        "drafter": names.get(r["drafter"], r["drafter"]),
        "plain tok/s": f"{r['plain_tps']:.1f}",
        "best fixed": labels.get(r["best_fixed"], r["best_fixed"]) if r["best_fixed"] else "-",
        "tok/s": f"{r['best_fixed_tps']:.1f}" if r["best_fixed_tps"] else "-",
        "adaptive tok/s": f"{r['adaptive_tps']:.1f}",
        "plain %": f"{r['plain_share']:.0%}",
        "vs plain": _ratio(r["vs_plain"], r.get("vs_plain_trials") if ranges else None),
        "vs best": _ratio(r["vs_best"], r.get("vs_best_trials") if ranges else None),
        "mlx-lm vs plain": _ratio(r.get("same_work_vs_plain"), None),
    }


def _fixed_label(name: str, drafter: str, labels: dict, names: dict) -> str:
    """A fixed-block row's label without its drafter's name (the table is that drafter's): 'B=5 greedy'."""
    label = labels.get(name, name)
    for prefix in (f"{names.get(drafter, drafter)} · ", f"{drafter} "):
        if label.startswith(prefix):
            return label[len(prefix) :]
    return label


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
