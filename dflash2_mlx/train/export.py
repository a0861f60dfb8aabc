"""What a training run leaves behind: the drafter folder (Hugging Face layout, what `load` reads), its
training card, and the learning curve."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from ..formats.card import ACCEPTANCE_FIELD, CARD_FILE
from ..formats.config import DraftConfig
from ..formats.shards import Sample, read_shards
from ..formats.vocab import COUNTS_FILE, response_counts, write_draft_vocab
from ..formats.weights import hf_names, write_weights
from ..sparkline import sparkline

CURVE_FILE = "curve.csv"


def write_drafter(
    folder: str | Path,
    config: DraftConfig,
    weights: dict[str, mx.array],
    feature_scale: mx.array,
    draft_vocab: np.ndarray | None,
    train_samples: list[Sample],
) -> Path:
    """A drafter folder from trained `weights` (training's names), which took features scaled channel by
    channel by `feature_scale`: the scale is folded into fc, so the folder takes the target's raw features
    like any other. Beside the weights: the draft vocabulary, if any, and the training responses' token
    counts (what `--draft-vocab` picks from)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    hf_config = config.to_hf_dict()
    hf_config["dtype"] = "float32"
    (folder / "config.json").write_text(json.dumps(hf_config, indent=2))
    weights = {**weights, "fc.weight": weights["fc.weight"] * feature_scale}
    write_weights(folder, hf_names(weights, config))
    if draft_vocab is not None:
        write_draft_vocab(folder, draft_vocab)
    np.save(folder / COUNTS_FILE, response_counts(train_samples, config.vocab_size))
    return folder


def write_curve(path: Path, log: list[dict]) -> None:
    """The learning curve as CSV: per evaluation, the step, the mean training loss since the previous
    evaluation, held-out tau and first-draft accuracy, and the training wall time so far; with a moving
    average of the weights, tau and first-draft accuracy are the average's, and two more columns give the
    raw weights'; then the same tau on training samples (`train_tau`), and on the held-out samples whose response is
    not in a loop (`heldout_tau_loop_free`). Columns a row's run did not measure are empty."""
    raw = any("raw_tau" in e for e in log)
    header = "step,train_loss,heldout_tau,heldout_first_draft,train_seconds"
    lines, losses = [header + (",raw_tau,raw_first_draft" if raw else "") + ",train_tau,heldout_tau_loop_free"], []
    elapsed, last = 0.0, 0.0
    for entry in log:
        if entry["seconds"] < last:  # a resumed run's clock starts again
            elapsed += last
        last = entry["seconds"]
        losses.append(entry["loss"])
        if "tau" in entry:
            lines.append(
                f"{entry['step']},{np.mean(losses):.4f},{entry['tau']},{entry.get('first_draft', '')},"
                f"{elapsed + last:.1f}"
                + (f",{entry.get('raw_tau', '')},{entry.get('raw_first_draft', '')}" if raw else "")
                + f",{entry.get('train_tau', '')},{entry.get('loop_free_tau', '')}"
            )
            losses = []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def run_seconds(log: list[dict]) -> list[float]:
    """Wall time of each run of a resumed training, read off the step log (each run's clock starts at 0)."""
    runs = [0.0]
    for entry in log:
        if entry["seconds"] < runs[-1]:
            runs.append(0.0)
        runs[-1] = entry["seconds"]
    return runs


def _draft_vocab_words(trainer, size: int | None) -> str:
    if size is None:
        return "the whole vocabulary"
    if trainer.settings.draft_vocab:
        return f"{size} tokens, the most frequent of the training responses"
    return f"{size} tokens, every token of the training data"


def write_card(folder: str | Path, trainer, target_name: str) -> None:
    """A short training card next to the drafter: data, steps, time, held-out acceptance (`trainer`: the
    `Trainer` that trained it)."""
    folder = Path(folder)
    evals = [e for e in trainer.log if "tau" in e]
    runs = run_seconds(trainer.log)
    data = read_shards(trainer.settings.data)
    card = {
        "target": target_name,
        "architecture": trainer.drafter.config.architecture,
        "settings": asdict(trainer.settings),
        "data": {
            "train_samples": len(trainer.train_samples),
            "heldout_samples": sum(s.heldout for s in data),
            "response_tokens": int(sum(len(s.tokens) - s.prompt_len for s in data)),
        },
        "steps": trainer.step,
        "processes": trainer.peers.size if getattr(trainer, "peers", None) else 1,  # data-parallel ranks
        "runs": len(runs),
        "train_seconds": round(sum(runs), 1),
        "heldout_tau": evals[-1]["tau"] if evals else None,
        "heldout_tau_raw_weights": evals[-1].get("raw_tau") if evals else None,  # with a moving average (ema)
        "train_tau": evals[-1].get("train_tau") if evals else None,  # the same on training samples
        "heldout_tau_loop_free": evals[-1].get("loop_free_tau") if evals else None,  # responses not in a loop
        ACCEPTANCE_FIELD: evals[-1].get("by_position") if evals else None,  # adaptive mode's prior
        "heldout_tau_history": [(e["step"], e["tau"]) for e in evals],
        "heldout_first_draft_history": [(e["step"], e["first_draft"]) for e in evals if "first_draft" in e],
        "parameters": int(sum(v.size for _, v in tree_flatten(trainer.drafter.parameters()))),
        "draft_vocab": None if trainer.drafter.draft_vocab is None else len(trainer.drafter.draft_vocab),
    }
    (folder / CARD_FILE).write_text(json.dumps(card, indent=2))
    lines = [
        f"# {card['architecture']} drafter for {target_name}",
        "",
        f"- data: {card['data']['train_samples']} training / {card['data']['heldout_samples']} held-out samples "
        f"({card['data']['response_tokens']} response tokens regenerated by the target) from {trainer.settings.data}",
        f"- {trainer.step} steps of {trainer.settings.sequences_per_step} sequences x "
        f"{trainer.settings.anchors_per_sequence} anchors, block {trainer.settings.block_size}, "
        f"{trainer.settings.layers} layer(s), {card['parameters']:,} parameters"
        + (f", data parallel over {card['processes']} processes" if card["processes"] > 1 else ""),
        f"- draft vocabulary: {_draft_vocab_words(trainer, card['draft_vocab'])}",
        f"- held-out acceptance length tau (teacher-forced, T = 0): {card['heldout_tau']}"
        + (
            f" (the weights are a moving average, decay {trainer.settings.ema}; the last step's own weights: "
            f"{card['heldout_tau_raw_weights']})"
            if card["heldout_tau_raw_weights"] is not None
            else ""
        ),
        *(
            [
                f"- the same on {len(trainer.probe)} training samples: {card['train_tau']} "
                "(above the held-out tau "
                "by what the drafter memorized rather than learned)"
            ]
            if card["train_tau"] is not None
            else []
        ),
        *(
            [
                f"- the same on the held-out samples whose response is not in a loop: "
                f"{card['heldout_tau_loop_free']} (a loop is easy to draft)"
            ]
            if card["heldout_tau_loop_free"] is not None
            else []
        ),
        f"- held-out tau over training (steps {evals[0]['step']}..{evals[-1]['step']}, {len(evals)} evaluations, "
        f"{min(e['tau'] for e in evals)}..{max(e['tau'] for e in evals)}): {sparkline([e['tau'] for e in evals])}"
        if evals
        else "- no evaluation yet",
        f"- training time: {card['train_seconds']} s of wall time over {card['runs']} run(s)",
    ]
    (folder / "README.md").write_text("\n".join(lines) + "\n")
