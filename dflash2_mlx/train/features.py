"""What the target says about every training sample, computed once and kept on disk: its features (float16)
and its top-k next tokens with their log-probabilities (for distillation).

A training step then runs the drafter only: on this CPU the target's forward pass over the sequences was
most of a step's time, and it is the same at every epoch. The cache sits in the data folder, one per
target and layer choice (`features-<fingerprint>/`), one set of files per data shard: a data folder that
grows (`dflash2 data` with more prompts) only adds shards, and only those are computed. Filled sample by
sample in batches of similar length; an interrupted fill resumes where it stopped.

`engine="torch"` computes them with PyTorch (`torch_engine`) in the machine's dtype: bfloat16 where the CPU
multiplies it in hardware (~10x MLX float32 with avx512_bf16), whose features differ from float32's by bfloat16
rounding and so keep a cache of their own (`features-<fingerprint>-torch/`); else float32 (1.8-3.4x MLX float32
on a 2-core AVX2 EPYC), MLX's features to float32 rounding, in MLX's cache.

The top-k part is filled only for a cache that asks for it (`teacher=True`: distillation): on this CPU the
full-vocabulary head, its log-sum-exp and top-k took a third of the fill's time, for rows most runs never read.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..target import Target
from . import torch_engine
from .data import Sample, padded_tokens

# The target's next-token candidates kept per row for distillation: 8 hold nearly all of a chat model's
# probability mass at a greedy continuation, at 48 bytes a token.
TEACHER_TOP_K = 8


class _ShardFiles:
    """The memory maps of one data shard's rows: features [rows, k*D] f16, top-k ids [rows, K] i32 and
    log-probabilities [rows, K] f16, and the samples (by start row) already computed."""

    def __init__(self, folder: Path, shard: str, rows: int, width: int):
        self.done_path = folder / f"{shard}.json"
        marks = json.loads(self.done_path.read_text()) if self.done_path.exists() else {"done": []}
        self.done = set(marks["done"])  # samples whose features are computed
        self.teacher_done = set(marks.get("teacher", marks["done"]))  # ... and their top-k (before: always both)
        self.maps = {}
        for name, dtype, cols in (
            ("features", np.float16, width),
            (f"top{TEACHER_TOP_K}-ids", np.int32, TEACHER_TOP_K),
            (f"top{TEACHER_TOP_K}-logprobs", np.float16, TEACHER_TOP_K),
        ):
            path = folder / f"{shard}.{name}"
            size = rows * cols * np.dtype(dtype).itemsize
            with open(path, "ab") as f:  # created, or grown when a later split of the shard reaches further
                if f.tell() < size:
                    f.truncate(size)
            have = path.stat().st_size // (cols * np.dtype(dtype).itemsize)
            self.maps[name] = np.memmap(path, dtype, "r+", shape=(have, cols))

    @property
    def features(self) -> np.memmap:
        return self.maps["features"]

    @property
    def top_ids(self) -> np.memmap:
        return self.maps[f"top{TEACHER_TOP_K}-ids"]

    @property
    def top_logprobs(self) -> np.memmap:
        return self.maps[f"top{TEACHER_TOP_K}-logprobs"]

    def mark_done(self, starts, teacher: bool) -> None:
        for m in self.maps.values():
            m.flush()
        self.done.update(starts)
        if teacher:
            self.teacher_done.update(starts)
        tmp = self.done_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"done": sorted(self.done), "teacher": sorted(self.teacher_done)}))
        tmp.replace(self.done_path)


class FeatureCache:
    """The target's features of `samples` (read with `read_shards`, which says where each sample sits in its
    shard) and, with `teacher`, its top-k next tokens at every row (`teacher_rows`).

    Args:
        folder: the data folder.
        samples: the samples, from `read_shards`.
        target: the target whose features they are.
        max_batch_tokens (int): padded tokens per forward while filling.
        teacher (bool): keep the target's top-k next tokens too (distillation).
        fill (bool): compute what is missing now (else the caller runs `filling`).
        engine (str): "mlx" or "torch" (see the module's notes).
    """

    def __init__(
        self,
        folder: str | Path,
        samples: list[Sample],
        target: Target,
        max_batch_tokens: int = 4096,
        teacher: bool = False,
        fill: bool = True,
        engine: str = "mlx",
    ):
        if any(not s.shard for s in samples):
            raise ValueError("the feature cache needs samples read from a data folder (read_shards)")
        if engine not in ("mlx", "torch"):
            raise ValueError(f"the feature cache's engine must be 'mlx' or 'torch', got {engine!r}")
        if engine == "torch" and (target.first_layer or not torch_engine.supported(target.model)):
            raise ValueError(
                "the torch feature engine runs whole llama or qwen2 targets with full attention: use the mlx engine"
            )
        self.samples, self.teacher, self.engine = samples, teacher, engine
        self.width = len(target.layer_ids) * target.hidden_size
        suffix = "-torch" if engine == "torch" and torch_engine.machine_dtype() == "bfloat16" else ""
        self.folder = Path(folder) / f"features-{target.fingerprint()}{suffix}"
        self.folder.mkdir(parents=True, exist_ok=True)
        rows = defaultdict(int)
        for s in samples:
            rows[s.shard] = max(rows[s.shard], s.start + len(s.tokens))
        self.shards = {shard: _ShardFiles(self.folder, shard, n, self.width) for shard, n in sorted(rows.items())}
        if fill:  # else the caller runs `filling` (data-parallel ranks take turns with their peers)
            for _ in self.filling(target, max_batch_tokens):
                pass

    def missing(self) -> list[Sample]:
        """The samples whose features (and top-k, for a teacher cache) are not computed yet."""

        def lacks(s: Sample) -> bool:
            files = self.shards[s.shard]
            return s.start not in files.done or (self.teacher and s.start not in files.teacher_done)

        return list(filter(lacks, self.samples))

    def filling(self, target: Target, max_batch_tokens: int = 4096) -> Iterator[None]:
        """Compute what is missing, shortest samples first, in batches of similar length; yields after each
        batch (written and marked done)."""
        todo = sorted(self.missing(), key=lambda s: len(s.tokens))
        if not todo:
            return
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        compute = self._torch_compute(target) if self.engine == "torch" else self._mlx_compute(target)

        with Progress(
            TextColumn("[bold]features"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total} samples"),
            TimeRemainingColumn(),
        ) as bar:
            task = bar.add_task("features", total=len(self.samples), completed=len(self.samples) - len(todo))
            while todo:
                length = len(todo[0].tokens)
                batch = todo[: max(1, max_batch_tokens // length)]
                batch = [s for s in batch if len(s.tokens) <= 2 * length] or batch[:1]
                todo = todo[len(batch) :]
                features, ids, logprobs = compute(padded_tokens(batch, range(len(batch))))
                if not np.isfinite(features).all() or np.abs(features).max() > 6e4:
                    raise ValueError("target features overflow float16; train without the feature cache")
                by_shard = defaultdict(list)
                for row, s in enumerate(batch):
                    n, files = len(s.tokens), self.shards[s.shard]
                    files.features[s.start : s.start + n] = features[row, :n]
                    if self.teacher:
                        files.top_ids[s.start : s.start + n] = ids[row, :n]
                        files.top_logprobs[s.start : s.start + n] = np.maximum(logprobs[row, :n], -6e4)
                    by_shard[s.shard].append(s.start)
                for shard, starts in by_shard.items():
                    self.shards[shard].mark_done(starts, self.teacher)
                bar.update(task, advance=len(batch))
                yield

    def _mlx_compute(self, target: Target):
        top_k = TEACHER_TOP_K if self.teacher else 0

        def compute(tokens: np.ndarray):
            features, ids, logprobs = target.teacher(mx.array(tokens), top_k)
            return np.array(features.astype(mx.float32)), np.array(ids), np.array(logprobs)

        return compute

    def _torch_compute(self, target: Target):
        engine = torch_engine.TorchTarget(target.model, slots=0, max_len=0)
        top_k = TEACHER_TOP_K if self.teacher else 0
        return lambda tokens: engine.sequences(tokens, list(target.layer_ids), top_k)

    def context(self, picked, length: int) -> mx.array:
        """Features of samples `picked`, right-padded with zeros to `length` rows: [S, length, k*D]."""
        out = np.zeros((len(picked), length, self.width), np.float16)
        for row, i in enumerate(picked):
            s = self.samples[i]
            out[row, : len(s.tokens)] = self.shards[s.shard].features[s.start : s.start + len(s.tokens)]
        return mx.array(out)

    def teacher_rows(self, sample: int, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The target's top-k next-token ids [..., K] and log-probabilities at rows `rows` of one sample."""
        s = self.samples[sample]
        files = self.shards[s.shard]
        if s.start not in files.teacher_done:
            raise ValueError(
                "this feature cache was filled without the target's top-k (FeatureCache(..., teacher=True))"
            )
        return files.top_ids[s.start + rows], files.top_logprobs[s.start + rows].astype(np.float32)

    def row_sample(self, n: int) -> np.ndarray:
        """About `n` feature rows spread over the samples (float32), for statistics."""
        every = max(1, sum(len(s.tokens) for s in self.samples) // n)
        parts, pos = [], 0  # every `every`-th row of the samples' rows laid end to end
        for s in self.samples:
            first = (-pos) % every
            parts.append(self.shards[s.shard].features[s.start + first : s.start + len(s.tokens) : every])
            pos += len(s.tokens)
        return np.concatenate(parts).astype(np.float32)
