"""`dflash2 bench --compare FILE`: results of CUDA engine runs of the same drafter, side by side with ours.

Our schema ("dflash2-compare/1"): {"schema": ..., "results": [{"engine", "hardware", "target", "drafter",
"suite", "temperature", "block_size", "tau", "speedup"}, ...]} (any field may be missing). Importers read:
- the z-lab/dflash benchmark's printed summary ("Decoding speedup: ...", "Average Acceptance length: ..."),
  one block per dataset, each preceded by a line naming it ("dataset: NAME" / "--dataset NAME");
- SGLang responses (JSONL of /generate outputs): meta_info.completion_tokens / meta_info.spec_verify_ct
  (or spec_accept_length) give tau;
- `published`: the numbers the DFlash papers report, shipped with this package.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path


def load_comparison(spec: str) -> list[dict]:
    if spec == "published":
        text = resources.files("dflash2_mlx").joinpath("assets", "published.json").read_text()
        return json.loads(text)["results"]
    path = Path(spec)
    if not path.is_file():
        raise FileNotFoundError(f"--compare {spec!r}: no such file (or use 'published')")
    text = path.read_text()
    try:
        data = json.loads(text)
        if isinstance(data, dict) and str(data.get("schema", "")).startswith("dflash2-compare/"):
            return data["results"]
    except json.JSONDecodeError:
        pass
    if "meta_info" in text:
        return _from_sglang(text, path)
    if "Average Acceptance length" in text or "Decoding speedup" in text:
        return _from_zlab(text, path)
    raise ValueError(f"{path}: not a dflash2-compare/1 JSON, a z-lab benchmark log or SGLang responses")


def _from_zlab(text: str, path: Path) -> list[dict]:
    results, suite, current = [], None, {}
    for line in text.splitlines():
        if m := re.search(r"(?:dataset[:=]\s*|--dataset\s+)([\w.\-]+)", line, re.I):
            suite = m.group(1)
        if m := re.search(r"Decoding speedup:\s*([\d.]+)", line):
            current["speedup"] = float(m.group(1))
        if m := re.search(r"Average Acceptance length:\s*([\d.]+)", line):
            current["tau"] = float(m.group(1))
            results.append({"engine": "z-lab/dflash benchmark", "suite": suite or path.stem, **current})
            current = {}
    return results


def _from_sglang(text: str, path: Path) -> list[dict]:
    tokens = cycles = 0
    taus = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            meta = json.loads(line).get("meta_info") or {}
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n}: not a JSON line") from None
        tokens += int(meta.get("completion_tokens", 0))
        cycles += int(meta.get("spec_verify_ct", 0))
        if "spec_accept_length" in meta:
            taus.append(float(meta["spec_accept_length"]))
    tau = tokens / cycles if cycles else (sum(taus) / len(taus) if taus else None)
    return [{"engine": "SGLang", "suite": path.stem, "tau": tau}]


def render_comparison(rows: list[dict], ours: list[dict], console) -> str:
    """The CUDA-side rows, then ours, in one table (tau and speedup side by side)."""
    from rich.table import Table

    cols = ["source", "target / drafter", "suite", "T", "block", "tau", "speedup"]
    table = Table(*cols, title="compared with CUDA runs")
    md = ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]

    def fmt(v, f):
        return "-" if v is None else f.format(v)

    lines = [
        [
            f"{r.get('engine', '?')} ({r.get('hardware', '?')})",
            f"{r.get('target', '?')} / {r.get('drafter', '?')}",
            str(r.get("suite", "-")),
            fmt(r.get("temperature"), "{:g}"),
            fmt(r.get("block_size"), "{}"),
            fmt(r.get("tau"), "{:.2f}"),
            fmt(r.get("speedup"), "{:.2f}x"),
        ]
        for r in rows
    ]
    lines += [
        [
            "this run",
            r["method"],
            "this run",
            f"{r['temperature']:g}",
            fmt(r["block_size"], "{}"),
            fmt(r["tau"], "{:.2f}"),
            fmt(r["speedup"], "{:.2f}x"),
        ]
        for r in ours
        if r["kind"] == "dflash"
    ]
    for line in lines:
        table.add_row(*line)
        md.append("| " + " | ".join(line) + " |")
    console.print(table)
    return "\n".join(md) + "\n"
