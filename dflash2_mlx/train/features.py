"""The target's features of every training sample, computed once and kept on disk (float16).

A training step then runs the drafter only: on this CPU the target's forward pass over the sequences was
most of a step's time, and it is the same at every epoch. The cache sits in the data folder, one per
target and layer choice (`features-<fingerprint>/`), is filled in chunks and resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..target import Target
from .data import Sample, padded_tokens


def fingerprint(target: Target) -> str:
    """Names the target and its tapped layers: weights of the first embedding rows + the layer ids."""
    h = hashlib.sha256(np.array(target.embed_tokens.weight[:4]).tobytes())
    h.update(json.dumps([list(target.layer_ids), target.hidden_size, target.num_layers]).encode())
    return h.hexdigest()[:12]


class FeatureCache:
    """Features [tokens, k*D] of `samples` (in their order) in one float16 memory map."""

    def __init__(self, folder: str | Path, samples: list[Sample], target: Target, max_batch_tokens: int = 4096):
        self.samples = samples
        lengths = np.array([len(s.tokens) for s in samples], np.int64)
        self.offsets = np.concatenate([[0], np.cumsum(lengths)])
        self.width = len(target.layer_ids) * target.hidden_size
        ids = hashlib.sha256("\n".join(s.id for s in samples).encode()).hexdigest()[:12]
        self.folder = Path(folder) / f"features-{fingerprint(target)}"
        self.path = self.folder / f"{ids}.f16"
        self.progress = self.folder / f"{ids}.json"
        self._fill(target, max_batch_tokens)
        self.rows = np.memmap(self.path, np.float16, "r", shape=(int(self.offsets[-1]), self.width))

    def _fill(self, target: Target, max_batch_tokens: int) -> None:
        """Compute what is missing, shortest samples first, in batches of similar length."""
        self.folder.mkdir(parents=True, exist_ok=True)
        done = set(json.loads(self.progress.read_text())["done"]) if self.progress.exists() else set()
        if len(done) == len(self.samples):
            return
        shape = (int(self.offsets[-1]), self.width)
        rows = np.memmap(self.path, np.float16, "r+" if self.path.exists() else "w+", shape=shape)
        todo = sorted((i for i in range(len(self.samples)) if i not in done), key=lambda i: len(self.samples[i].tokens))
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        with Progress(TextColumn("[bold]features"), BarColumn(), TextColumn("{task.completed}/{task.total} samples"),
                      TimeRemainingColumn()) as bar:
            task = bar.add_task("features", total=len(self.samples), completed=len(done))
            while todo:
                length = len(self.samples[todo[0]].tokens)
                batch = todo[: max(1, max_batch_tokens // length)]
                batch = [i for i in batch if len(self.samples[i].tokens) <= 2 * length] or batch[:1]
                todo = todo[len(batch):]
                tokens = padded_tokens(self.samples, batch)
                feats = np.array(target.sequence_features(mx.array(tokens)).astype(mx.float32))
                if not np.isfinite(feats).all() or np.abs(feats).max() > 6e4:
                    raise ValueError("target features overflow float16; train without the feature cache")
                for row, i in enumerate(batch):
                    n = len(self.samples[i].tokens)
                    rows[self.offsets[i] : self.offsets[i] + n] = feats[row, :n]
                rows.flush()
                done.update(batch)
                self.progress.write_text(json.dumps({"done": sorted(done)}))
                bar.update(task, completed=len(done))
        del rows

    def context(self, picked, length: int) -> mx.array:
        """Features of samples `picked`, right-padded with zeros to `length` rows: [S, length, k*D]."""
        out = np.zeros((len(picked), length, self.width), np.float16)
        for row, i in enumerate(picked):
            n = len(self.samples[i].tokens)
            out[row, :n] = self.rows[self.offsets[i] : self.offsets[i] + n]
        return mx.array(out)
