"""The rows of `dflash2 bench`: what a method is (`Method`: mlx-lm's generation, plain decoding, a drafter at a
block size and walk, a tree budget, a peer engine), what one generation of it gives (`Run`), and the methods a
command line asks for (`methods_for`, `with_copyspec_modes`, `peer_methods`)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dflash2_mlx.generate import resolve_block_size
from dflash2_mlx.lookup import COPYSPEC_MODES


@dataclass
class Method:
    name: str
    kind: str  # "mlx-lm" | "plain" | "mlx-lm-spec" | "dflash" | "adaptive" | "ddtree" | "peer"
    drafter: object = None
    block_size: int | None = None
    walk: str = "greedy"
    drafter_label: str | None = None
    tree_budget: int | None = None  # ddtree only
    peer: object = None  # kind "peer": its `peers.PeerWorker`, None when it cannot run
    note: str | None = None  # kind "peer": what differs from our rows, or why it cannot run
    label: str | None = None  # what the report calls it: "DFlash 2 · adaptive", "v1 · B=8" (default: its name)
    copyspec: str = "auto"  # our rows: --copyspec-mode (copy drafts looked up in the context)

    def __post_init__(self):
        self.label = self.label or self.name


@dataclass
class Run:
    tokens: list[int]
    generation_tps: float
    prompt_tps: float
    ttft_s: float
    peak_memory_gb: float
    accepted: list[int] = field(default_factory=list)
    plain_tokens: int = 0  # tokens from the plain steps adaptive mode chose
    cycle_s: list[float] = field(default_factory=list)  # wall time of each drafting cycle, yield to yield
    lookup_tokens: int = 0  # accepted drafts from lookups' continuations (the rest of `accepted`: the drafter's)


def methods_for(
    drafters: list[tuple[str, object]],
    block_sizes: list[int] | None,
    classic: bool,
    walks: tuple[str, ...] = ("greedy", "viterbi"),
    tree_budgets: tuple[int | None, ...] = (),
) -> list[Method]:
    """The bench's rows: mlx-lm, plain decoding, and per drafter adaptive mode, each fixed block (each walk of a
    DFlash 2 drafter) and each tree budget; mlx-lm's classic speculative decoding with a `classic` draft model.
    Each is named by its drafter's label (the JSON's "method") and labelled by its drafter's kind for the report
    ("DFlash 2 · B=5 greedy": `drafter_names`)."""
    names = drafter_names(drafters)
    methods = [Method("mlx-lm", "mlx-lm"), Method("plain", "plain")]
    for label, drafter in drafters:
        methods.append(
            Method(
                f"{label} adaptive",
                "adaptive",
                drafter,
                drafter.config.block_size,
                "greedy",
                label,
                label=f"{names[label]} · adaptive",
            )
        )
        for B in fixed_block_sizes(drafter, block_sizes):
            for walk in walks if len(drafter.walks) > 1 else drafter.walks:
                which = f"B={B}" + (f" {walk}" if len(drafter.walks) > 1 else "")
                methods.append(
                    Method(f"{label} {which}", "dflash", drafter, B, walk, label, label=f"{names[label]} · {which}")
                )
            for budget in tree_budgets:  # trees as deep as the linear rows' blocks, for a like-for-like tau
                methods.append(
                    Method(
                        f"{label} B={B} ddtree {budget or 'auto'}",
                        "ddtree",
                        drafter,
                        B,
                        "greedy",
                        label,
                        tree_budget=budget,
                        label=f"{names[label]} · B={B} tree {budget or 'auto'}",
                    )
                )
    if classic:
        for B in block_sizes or [4]:
            methods.append(
                Method(
                    f"mlx-lm speculative k={B - 1}",
                    "mlx-lm-spec",
                    block_size=B,
                    label=f"mlx-lm · speculative k={B - 1}",
                )
            )
    return methods


def with_copyspec_modes(methods: list[Method], modes: list[str]) -> list[Method]:
    """Each of our speculative rows once per --copyspec-modes mode (named "... copy MODE" when there are several,
    next to each other so the ABBA order runs them back to back)."""
    bad = [m for m in modes if m not in COPYSPEC_MODES]
    if bad:
        raise ValueError(f"--copyspec-modes takes modes from {COPYSPEC_MODES}, comma-separated; got {bad}")
    out = []
    for m in methods:
        if m.drafter is None or m.kind == "peer":
            out.append(m)
            continue
        for mode in modes:
            suffix = f" copy {mode}" if len(modes) > 1 else ""
            out.append(replace(m, name=m.name + suffix, label=m.label + suffix, copyspec=mode))
    return out


# What the report calls a drafter of each kind (`DFlashDraftModel.kind`).
DRAFTER_KINDS = {"v1": "v1", "dflash2": "DFlash 2"}


def drafter_names(drafters: list[tuple[str, object]]) -> dict[str, str]:
    """The name each drafter goes by on the report, by its label: its kind ("v1", "DFlash 2"), numbered where
    several share one ("DFlash 2 (1)", "DFlash 2 (2)"); the report's header gives each name's drafter once."""
    kinds = [DRAFTER_KINDS.get(drafter.kind, drafter.kind) for _, drafter in drafters]
    return {
        label: kind + (f" ({kinds[: i + 1].count(kind)})" if kinds.count(kind) > 1 else "")
        for i, ((label, _), kind) in enumerate(zip(drafters, kinds))
    }


def fixed_block_sizes(drafter, block_sizes: list[int] | None) -> list[int]:
    """The block sizes of a drafter's fixed-block rows: those asked for that it can run, else its default."""
    sizes = block_sizes or [None]
    return [resolve_block_size(drafter, B) for B in sizes if B is None or B <= drafter.config.block_size]


def peer_methods(peers: list, drafters: list[tuple[str, object]], block_sizes: list[int] | None) -> list[Method]:
    """A row per peer engine, drafter and block size of our fixed-block rows (the reference's greedy walk)."""
    methods, names = [], drafter_names(drafters)
    for peer in peers:
        drafter = dict(drafters)[peer.drafter_label]
        for B in fixed_block_sizes(drafter, block_sizes):
            methods.append(
                Method(
                    f"{peer.engine} {peer.drafter_label} B={B}",
                    "peer",
                    drafter,
                    B,
                    "greedy",
                    peer.drafter_label,
                    peer=peer.worker,
                    note=peer.note,
                    label=f"{peer.engine} · {names[peer.drafter_label]} · B={B}",
                )
            )
    return methods
