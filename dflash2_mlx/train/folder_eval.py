"""The held-out evaluation of a drafter folder that `dflash2 train` wrote, with its card's settings."""

from __future__ import annotations

import json
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..formats.card import CARD_FILE
from .evaluate import Evaluation
from .settings import TrainSettings
from .trainer import Trainer


@contextmanager
def folder_trainer(model, data: str | Path, folder: str | Path, eval_samples: int | None = None):
    """A trainer that evaluates a drafter folder trained by `dflash2 train` with its card's settings (the same
    draft vocabulary, anchors and held-out samples; `eval_samples` of them if given), in a temporary folder."""
    st = json.loads((Path(folder) / CARD_FILE).read_text())["settings"]
    keep = (
        "draft_vocab",
        "reduced_vocabulary",
        "anchors_per_sequence",
        "seed",
        "eval_samples",
        "selector_factorized",
        "selector_rank",
        "selector_top_k",
    )
    fields = {k: st[k] for k in keep if k in st} | ({} if eval_samples is None else {"eval_samples": eval_samples})
    settings = TrainSettings(data=str(data), init_from=str(folder), cache_features=False, ema=0.0, **fields)
    with tempfile.TemporaryDirectory() as out:
        yield Trainer(model, out, settings)


def evaluate_folder(
    model, data: str | Path, folder: str | Path, eval_samples: int | None = None, loop_free: bool = False
) -> Evaluation:
    """The held-out evaluation of a drafter folder (`folder_trainer`). E.g. the acceptance by position for the card
    of a drafter trained before cards had it:
    `card[ACCEPTANCE_FIELD] = list(evaluate_folder(target, data, folder).by_position)`."""
    with folder_trainer(model, data, folder, eval_samples) as trainer:
        return trainer.evaluate(loop_free=loop_free)
