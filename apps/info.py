"""`dflash2 info`: a drafter's config and where its parameters are; the Metal kernels' self-check; the assets."""

from __future__ import annotations

import json

from rich.console import Console
from rich.table import Table

from dflash2_mlx import pins
from dflash2_mlx.info import drafter_info, format_self_check, self_check_info


def add_parser(sub) -> None:
    p = sub.add_parser(
        "info",
        help="a drafter's config and parameter counts per component; --self-check: the Metal kernels' check",
        description="Show a drafter's configuration and where its parameters are; with --self-check, how the "
        "Metal kernels fare on this machine (each against its pure-MLX op: what a bug report quotes).",
    )
    p.add_argument("path", nargs="?", help="drafter folder or hub id")
    p.add_argument(
        "--self-check",
        action="store_true",
        help="run the Metal kernels' self-check and print per kernel and dtype: passed or why not",
    )
    p.add_argument(
        "--assets",
        action="store_true",
        help="instead: the downloaded models and data, where each is "
        "installed and whether it matches its pinned sha256 (exit status 1 when one does not)",
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.assets:
        rows = pins.status()
        print(json.dumps(rows) if args.json else pins.format_status(rows))
        return 1 if any(r["state"] == "mismatch" for r in rows) else 0
    if args.self_check:
        check = self_check_info()
        print(json.dumps(check) if args.json else format_self_check(check))
    if args.path is None:
        if not args.self_check:
            raise ValueError("give a drafter folder or hub id (dflash2 info PATH), --self-check or --assets")
        return 0
    info = drafter_info(args.path)
    if args.json:
        print(json.dumps(info))
        return 0
    console = Console()
    cfg = info["config"]
    console.print(f"[bold]{info['path']}[/]  {cfg['architecture']}")
    for key in (
        "num_hidden_layers",
        "hidden_size",
        "block_size",
        "target_layer_ids",
        "mask_token_id",
        "conv_kernel_size",
        "conv_group_size",
        "selector_rank",
        "selector_top_k",
        "dtype",
        "quantization",
    ):
        if cfg.get(key) not in (None, 0):
            console.print(f"  {key}: {cfg[key]}")
    table = Table("component", "parameters", "share", title="parameters")
    for name, count in info["parameters"].items():
        if name != "total":
            table.add_row(name, f"{count:,}", f"{count / info['parameters']['total']:.1%}")
    table.add_row("[bold]total[/]", f"[bold]{info['parameters']['total']:,}[/]", "100.0%")
    console.print(table)
    return 0
