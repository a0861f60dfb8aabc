"""A drafter folder's card (card.json, written by `dflash2 train`): how it was trained and how well it drafts.
Read here for what inference takes from it: the held-out acceptance by position, adaptive mode's prior."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

CARD_FILE = "card.json"
# P(draft i accepted | drafts 1..i-1 accepted), i = 1..B-1, on the held-out samples (teacher-forced, T = 0)
ACCEPTANCE_FIELD = "heldout_acceptance_by_position"


def read_acceptance(folder: str | Path) -> np.ndarray | None:
    """The folder card's held-out acceptance by position, or None (no card, no such field, or not a list of
    probabilities)."""
    try:
        card = json.loads((Path(folder) / CARD_FILE).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    acceptance = card.get(ACCEPTANCE_FIELD) if isinstance(card, dict) else None
    if not isinstance(acceptance, list) or not acceptance:
        return None
    if not all(isinstance(a, (int, float)) and 0 <= a <= 1 for a in acceptance):
        return None
    return np.array(acceptance, dtype=np.float64)
