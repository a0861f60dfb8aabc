"""Training a DFlash v1 or DFlash 2 drafter for a target (the paper's recipe; the authors never released theirs).

Each step takes a few training sequences (prompt + the target's own response), computes the target's
features once for the whole sequences, and drafts from many random anchors in the responses at once
(`batches`), with the loss of `loss`. The target's embedding and LM head are lent, never trained. AdamW,
warmup + cosine, clipping, a compiled step. The batch of step t depends only on (seed, t), so a resumed run
is bit-identical. By default an exponential moving average of the weights (`ema`) is what gets evaluated
(`evaluate`) and exported (`export`). A run stops at its steps, its time budget or Ctrl-C, with a checkpoint.

Data parallel (`peers`: the ranks `mlx.launch` started): every rank makes the same batch of step t, takes one
in N of its sequences (`batches.share`) and divides its weighted loss by the whole batch's weight; the ranks
sum their gradients and losses, so every rank applies the gradient one process would have on the whole batch.
Rank 0's weights and optimizer state are given to the others at the start (and on resume: only rank 0 reads
and writes checkpoints, curves and exports). Each rank computes the feature cache of one in N of the data's
shards; the ranks then take turns (heartbeats) until every shard is done.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..drafter import DFlashDraftModel, TrainingBlocks
from ..formats.config import DraftConfig
from ..formats.shards import read_shards
from ..loading import bind_drafter, load_drafter
from ..loops import in_a_loop
from ..process_group import ProcessGroup
from ..target import Target
from . import torch_engine
from .batches import Batch, loss_vocabulary, make_batch, share
from .data import Sample, distinct_prompts, pick_engine
from .evaluate import Evaluation, accepted_blocks, summary
from .export import CURVE_FILE, write_curve, write_drafter
from .features import TEACHER_TOP_K, FeatureCache
from .init_weights import identity_layer, identity_selector, layers_from_target
from .interrupt import interrupt_requested
from .loss import NO_SOFT, Soft, draft_weights, gold_predecessors, loss_fn, loss_weight
from .settings import TrainSettings, check_world_size, settle

logger = logging.getLogger(__name__)

AVERAGE_FILE = "average.safetensors"
SCALE_FILE = "feature_scale.safetensors"
HEARTBEAT = 10.0  # seconds of feature-cache work between the ranks' check-ins (data parallel)


class Trainer:
    def __init__(self, model, out: str | Path, settings: TrainSettings, peers: ProcessGroup | None = None):
        """`peers`: the ranks of a data-parallel run (`peers.join()` under `mlx.launch`), this process one of
        them; only rank 0 writes to `out`."""
        self.peers = peers if peers is not None and peers.size > 1 else None
        self.writes = self.peers is None or self.peers.main
        if self.peers:
            check_world_size(settings, self.peers.size)
            r, n = self.peers.rank, self.peers.size
            logger.info(
                "data parallel: rank %d of %d, sequences %d, %d, ... of each step's %d%s",
                r,
                n,
                r + 1,
                r + n + 1,
                settings.sequences_per_step,
                " (writes the checkpoints, curve and drafter)" if r == 0 else "",
            )
        self.out = Path(out)
        self._read_data(settings)
        self.settings, config = settle(settings, model)
        self._make_drafter(model, config)
        if self.peers:
            self._check_same_run()
        self._make_optimizer()
        self.step = 0
        self.log: list[dict] = []
        self.average: dict[str, mx.array] | None = None  # the weights' moving average (settings.ema)
        self.averaged_steps = 0
        self._make_features()
        if self.settings.init_from_target:
            layers_from_target(self.drafter, self.target)
        if self.settings.init_from:
            self._warm_start(self.settings.init_from)

    def _read_data(self, settings: TrainSettings) -> None:
        """The training samples, the first `eval_samples` held-out ones, and `probe`: as many training samples
        (`eval_samples` where the data holds none out), spread over the data, evaluated like the held-out ones (the
        gap between the two is what the drafter memorized rather than learned; their features give the scale)."""
        heldout = read_shards(settings.data, heldout=True)
        self.heldout = heldout[: settings.eval_samples]
        self.train_samples = distinct_prompts(read_shards(settings.data, heldout=False), heldout)
        n = len(self.heldout) or settings.eval_samples  # as many as the held-out ones evaluated
        self.probe = self.train_samples[:: max(1, len(self.train_samples) // n)][:n]
        if len(self.train_samples) < settings.sequences_per_step:
            raise ValueError(
                f"{settings.data} has {len(self.train_samples)} training samples; need at least "
                f"{settings.sequences_per_step} (run `dflash2 data` first)"
            )

    def _make_drafter(self, model, config: DraftConfig) -> None:
        """The target (its feature layers the drafter's), and a new drafter bound to it, drafting over the
        vocabulary it is trained over (its draft vocabulary): a token the loss never pushed down could
        otherwise win a draft. `vocab`: those token ids, `vocab_index`: token id -> index into them (-1:
        none), `head_rows`: their LM-head rows."""
        settings = self.settings
        self.target = Target(model, config.target_layer_ids)
        mx.random.seed(settings.seed)
        self.drafter = DFlashDraftModel.from_config(config)
        if config.is_dflash2:
            identity_selector(self.drafter)
        ids = loss_vocabulary(self.train_samples, settings, config.vocab_size)
        self.drafter.draft_vocab = ids if settings.reduced_vocabulary or settings.draft_vocab else None
        bind_drafter(self.drafter, model)
        index = np.full(config.vocab_size, -1, np.int32)
        index[ids] = np.arange(len(ids))
        self.vocab, self.vocab_index, self._index = mx.array(ids, mx.int32), mx.array(index), index
        self.head_rows = mx.stop_gradient(self.target.head_rows(self.vocab).astype(mx.float32))

    def _make_optimizer(self) -> None:
        """AdamW with warmup + cosine decay, and the compiled training step."""
        settings = self.settings
        self.weights = draft_weights(settings.block_size, settings.loss_gamma())
        warm = max(1, int(settings.warmup * settings.steps))
        schedule = optim.join_schedules(
            [
                optim.linear_schedule(0.0, settings.learning_rate, warm),
                optim.cosine_decay(settings.learning_rate, max(1, settings.steps - warm), settings.learning_rate * 0.1),
            ],
            [warm],
        )
        self.optimizer = optim.AdamW(learning_rate=schedule, weight_decay=settings.weight_decay)
        self.optimizer.init(self.drafter.trainable_parameters())
        state = [self.drafter.state, self.optimizer.state]
        value_and_grad = nn.value_and_grad(self.drafter, loss_fn)

        @partial(mx.compile, inputs=state, outputs=state)
        def train_step(blocks, context, anchors, labels, prev_gold, soft_idx, soft_p):
            loss, grads = value_and_grad(
                self.drafter,
                blocks,
                context,
                TrainingBlocks(anchors),
                labels,
                self.weights,
                prev_gold,
                self.vocab,
                self.head_rows,
                Soft(soft_idx, soft_p, settings.distill),
                chain=settings.chain_loss,
            )
            grads, norm = optim.clip_grad_norm(grads, settings.grad_clip)
            self.optimizer.update(self.drafter, grads)
            return loss, norm

        self._train_step = train_step
        if self.peers:  # the ranks' gradients are summed between the two halves of the step

            @partial(mx.compile, inputs=[self.drafter.state], outputs=[self.drafter.state])  # (value_and_grad sets it)
            def gradients(blocks, context, anchors, labels, prev_gold, soft_idx, soft_p, denominator):
                return value_and_grad(
                    self.drafter,
                    blocks,
                    context,
                    TrainingBlocks(anchors),
                    labels,
                    self.weights,
                    prev_gold,
                    self.vocab,
                    self.head_rows,
                    Soft(soft_idx, soft_p, settings.distill),
                    denominator,
                    settings.chain_loss,
                )

            @partial(mx.compile, inputs=state, outputs=state)
            def apply(grads):
                grads, norm = optim.clip_grad_norm(grads, settings.grad_clip)
                self.optimizer.update(self.drafter, grads)
                return norm

            self._gradients, self._apply = gradients, apply

    def _make_features(self) -> None:
        """The feature caches (`cache_features`: the target's features computed once, kept in the data
        folder) and the features' channel scale (see `_feature_scale`)."""
        settings = self.settings
        self.caches, self._torch = {}, None
        self.feature_engine = pick_engine(settings.feature_engine, 0.0, self.target.model)
        if not settings.cache_features and self.feature_engine == "torch":
            self._torch = torch_engine.TorchTarget(self.target.model, slots=0, max_len=0)
        # the held-out and probe samples' features are cached in any case: every evaluation reads them, and they are few
        splits = {"heldout": (self.heldout, False)}
        if settings.cache_features:
            splits["train"] = (self.train_samples, bool(settings.distill))
        splits["probe"] = (self.probe, False)  # training samples: after "train", which leaves it nothing to compute
        if self.peers:
            self._fill_together(splits)
        self.caches = {
            name: FeatureCache(settings.data, samples, self.target, teacher=teacher, engine=self.feature_engine)
            for name, (samples, teacher) in splits.items()
        }
        self.feature_scale = mx.array(self._feature_scale())

    def _fill_together(self, splits: dict) -> None:
        """The feature cache of a data-parallel run: each rank computes the features of one in N of the data's
        shards (rank r: shards r, r + N, ...), then whatever its data folder still lacks (the other ranks'
        shards, where the folder is not on a disk they share). The ranks check in every `HEARTBEAT` seconds of
        work, so a lost rank is noticed then, and they all leave together."""
        peers, data = self.peers, self.settings.data
        shards = sorted({s.shard for samples, _ in splits.values() for s in samples})
        mine = set(shards[peers.rank :: peers.size])

        def work(part: str, keep):
            for name, (samples, teacher) in splits.items():  # one after the other: they share the shards' marks
                cache = FeatureCache(
                    data,
                    [s for s in samples if keep(s)],
                    self.target,
                    teacher=teacher,
                    fill=False,
                    engine=self.feature_engine,
                )
                todo = cache.missing()
                if todo:
                    logger.info(
                        "rank %d: the features of %d %s samples (%s: %s)",
                        peers.rank,
                        len(todo),
                        name,
                        part,
                        ", ".join(sorted({s.shard for s in todo})),
                    )
                yield from cache.filling(self.target)

        for part, keep in (("its shards", lambda s: s.shard in mine), ("the other ranks' shards", lambda s: True)):
            steps = work(part, keep)
            busy = True
            while True:
                until = time.monotonic() + min(HEARTBEAT, peers.timeout / 4)
                while busy and time.monotonic() < until:
                    busy = next(steps, StopIteration) is not StopIteration
                if not peers.any(busy, f"the feature cache ({part})"):
                    break

    def _check_same_run(self) -> None:
        """Every rank must train with the same settings, target and data (wherever its folder is): else their
        gradients would not add up to one process's."""
        settings = {k: v for k, v in asdict(self.settings).items() if k != "data"}
        h = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
        h.update(self.target.fingerprint().encode())
        for samples in (self.train_samples, self.heldout):
            h.update(np.array([len(samples), sum(int(s.tokens.sum()) for s in samples)], np.int64).tobytes())
        if not self.peers.same(np.frombuffer(h.digest(), np.uint8), "the check of the ranks' settings and data"):
            raise ValueError(
                f"rank {self.peers.rank}: the ranks were given different settings, targets or data (or "
                "another version of dflash2); launch the same command, with the same target and data "
                "folder, on every rank"
            )

    def _warm_start(self, folder: str) -> None:
        """Start from a drafter folder's weights: fine-tune a published drafter on your target's own
        outputs, or continue training a bundled one."""
        start = load_drafter(folder, dtype="float32")
        weights = dict(tree_flatten(start.parameters()))
        weights["fc.weight"] = weights["fc.weight"] / self.feature_scale  # folders take raw features
        # a v1 folder warm-starting a DFlash 2 drafter lacks the DFlash 2 modules, which keep their identity init
        upgrading = self.drafter.config.is_dflash2 and not any(k.startswith("candidate_selector.") for k in weights)
        added = self.drafter.layers[len(start.layers) :]  # `--layers` above the folder's: on top, as the identity
        self.drafter.load_weights(list(weights.items()), strict=not (upgrading or added))
        for layer in added:
            identity_layer(layer)
        mx.eval(self.drafter.parameters())

    def _feature_scale(self) -> np.ndarray:
        """1 / RMS of each feature channel. Targets have "massive activation" channels (SmolLM2: three of
        them hold 93-99% of the energy of its deeper layers), which drown every other channel in
        fc + hidden_norm and made the drafter learn almost nothing from its context. Training sees
        features with unit-RMS channels; `export` folds the scale into fc, so a drafter folder takes the
        target's raw features like any other."""
        rows = self.caches.get("train", self.caches["probe"]).row_sample(20000)
        return (1 / np.maximum(np.sqrt(np.mean(rows**2, axis=0)), 1e-3)).astype(np.float32)

    def teacher(
        self, tokens: mx.array, top_k: int = 0, lengths: list[int] | None = None
    ) -> tuple[mx.array, mx.array, mx.array]:
        """`Target.teacher` of whole sequences, computed by the feature engine (without a feature cache). With
        `lengths` (each row's tokens before its padding), each row is computed at its own length and its padding
        rows are zeros, as the cache's: a step's sequences differ in length by 2-4x, and the padding of a batch is
        a third of its tokens and more (a drafter's block never sees the rows past its anchor)."""
        if lengths is not None:
            rows = [self.teacher(tokens[i : i + 1, :n], top_k) for i, n in enumerate(lengths)]
            width = tokens.shape[1]
            return tuple(
                mx.concatenate([mx.pad(r[j], [(0, 0), (0, width - r[j].shape[1]), (0, 0)]) for r in rows])
                for j in range(3)
            )
        if self._torch is None:
            return self.target.teacher(tokens, top_k)
        outputs = self._torch.sequences(np.array(tokens), list(self.target.layer_ids), top_k)
        return tuple(mx.array(x) for x in outputs)

    def samples(self, split: str) -> list[Sample]:
        """The samples of a split: "train", "heldout" or "probe"."""
        return {"train": self.train_samples, "heldout": self.heldout, "probe": self.probe}[split]

    def _lengths(self, batch: Batch, split: str) -> list[int]:
        """The tokens of each of a batch's sequences (its `picked` index `split`'s samples)."""
        return [len(self.samples(split)[i].tokens) for i in batch.picked]

    def context(self, batch: Batch, split: str) -> mx.array:
        """The target's features of the batch's sequences (from the cache when there is one), scaled
        channel by channel (see `_feature_scale`)."""
        if split in self.caches:
            features = self.caches[split].context(batch.picked, batch.tokens.shape[1])
        else:
            features = self.teacher(batch.tokens, lengths=self._lengths(batch, split))[0]
        return features.astype(mx.float32) * self.feature_scale

    # -- checkpoints -----------------------------------------------------------------------------------
    @property
    def checkpoint(self) -> Path:
        return self.out / "checkpoint"

    def save_checkpoint(self) -> None:
        tmp = self.out / "checkpoint.tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(tmp / "drafter.safetensors"), dict(tree_flatten(self.drafter.parameters())))
        mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
        if self.average is not None:
            mx.save_safetensors(str(tmp / AVERAGE_FILE), self.average)
        mx.save_safetensors(str(tmp / SCALE_FILE), {"feature_scale": self.feature_scale})
        (tmp / "state.json").write_text(
            json.dumps(
                {
                    "step": self.step,
                    "settings": asdict(self.settings),
                    "averaged_steps": self.averaged_steps,
                    "log": self.log,
                },
                indent=2,
            )
        )
        if self.checkpoint.exists():
            shutil.rmtree(self.checkpoint)
        tmp.rename(self.checkpoint)

    def _set_optimizer_state(self, items) -> None:
        """In place: the compiled step holds this very tree as one of its inputs."""
        for name, value in items:
            *path, last = name.split(".")
            node = self.optimizer.state
            for part in path:
                node = node[int(part)] if isinstance(node, list) else node[part]
            node[int(last) if isinstance(node, list) else last] = value

    def _share_state(self) -> None:
        """Every rank takes rank 0's weights, optimizer state, moving average, step and feature scale (read from
        its checkpoint, or its fresh ones): the other ranks need no checkpoint of their own, and any difference
        the ranks' own initialisation or feature cache would make is gone."""
        peers = self.peers
        what = "the handover of rank 0's weights"
        head = np.array([self.step, self.averaged_steps, self.average is not None], np.int64)
        step, averaged_steps, has_average = (int(v) for v in peers.from_main(mx.array(head.astype(np.int32)), what))
        self.step, self.averaged_steps = step, averaged_steps
        self.drafter.load_weights(list(peers.from_main(dict(tree_flatten(self.drafter.parameters())), what).items()))
        self._set_optimizer_state(tree_flatten(peers.from_main(self.optimizer.state, what)))
        if has_average:
            mine = self.average or {k: mx.zeros_like(v) for k, v in tree_flatten(self.drafter.parameters())}
            self.average = peers.from_main(mine, what)
        self.feature_scale = peers.from_main(self.feature_scale, what)
        mx.eval(self.drafter.parameters(), self.optimizer.state, self.average, self.feature_scale)

    def resume(self) -> bool:
        if not (self.checkpoint / "state.json").exists():
            return False
        state = json.loads((self.checkpoint / "state.json").read_text())
        differ = self.settings.changes_from(state["settings"])
        if differ:
            raise ValueError(
                f"{self.checkpoint} was made with other settings ("
                + ", ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in differ.items())
                + "); use the same settings to continue it, or another --out"
            )
        self.drafter.load_weights(list(mx.load(str(self.checkpoint / "drafter.safetensors")).items()))
        self._set_optimizer_state(mx.load(str(self.checkpoint / "optimizer.safetensors")).items())
        self.step, self.log = state["step"], state["log"]
        if self.settings.ema and (self.checkpoint / AVERAGE_FILE).exists():
            self.average, self.averaged_steps = mx.load(str(self.checkpoint / AVERAGE_FILE)), state["averaged_steps"]
        # the weights were trained on features at the checkpoint's scale (data grown since would change it)
        if (self.checkpoint / SCALE_FILE).exists():
            self.feature_scale = mx.load(str(self.checkpoint / SCALE_FILE))["feature_scale"]
        else:
            logger.warning("%s predates saved feature scales: the data's is computed again", self.checkpoint)
        mx.eval(self.drafter.parameters(), self.optimizer.state, self.average, self.feature_scale)
        return True

    # -- training ------------------------------------------------------------------------------------------
    def soft_targets(self, batch: Batch, split: str, teacher=None) -> tuple[mx.array, mx.array]:
        """The target's top-k next tokens at every draft row of `batch` ([N, B-1, k] training-vocabulary
        indices, -1 outside it, and their probabilities renormalized over the kept ones), from the feature
        cache or from `teacher` (ids, log-probabilities [S, L, k] of the batch's sequences)."""
        anchors = np.array(batch.where.anchors)  # [S, A]
        S, A = anchors.shape
        rows = anchors[:, :, None] + np.arange(self.settings.block_size - 1)  # the row before each draft's token
        ids, logprobs = [], []
        for s, (sample, n) in enumerate(zip(batch.picked, self._lengths(batch, split))):
            r = np.minimum(rows[s], n - 1)  # past the end: any row (its label is -1, its weight 0)
            if teacher is None:
                i, lp = self.caches[split].teacher_rows(sample, r)
            else:
                i, lp = np.array(teacher[0][s])[r], np.array(teacher[1][s])[r]
            ids.append(i)
            logprobs.append(lp)
        index = self._index[np.concatenate(ids)]  # [N, B-1, k]
        probs = np.where(index >= 0, np.exp(np.concatenate(logprobs)), 0)
        probs /= np.maximum(probs.sum(-1, keepdims=True), 1e-9)
        return mx.array(index), mx.array(probs.astype(np.float32))

    def train_step(self) -> float:
        batch = make_batch(self.train_samples, self.step, self.settings, self.drafter.config.mask_token_id)
        if self.peers:  # the whole batch's loss weight, over every rank's share
            denominator = loss_weight(self._loss_labels(batch.labels), self.weights)
            batch = share(batch, self.peers.rank, self.peers.size)
        if self.settings.distill and "train" not in self.caches:
            features, *teacher = self.teacher(batch.tokens, TEACHER_TOP_K, self._lengths(batch, "train"))
            context = features.astype(mx.float32) * self.feature_scale
            soft = self.soft_targets(batch, "train", teacher)
        else:
            context = self.context(batch, "train")
            soft = self.soft_targets(batch, "train") if self.settings.distill else NO_SOFT
        labels = self._loss_labels(batch.labels)
        if self.peers:
            loss, grads = self._gradients(
                batch.blocks, context, batch.where.anchors, labels, gold_predecessors(batch), *soft, denominator
            )
            mx.eval(loss, grads)  # this rank's part, before it waits on the others'
            summed = self.peers.sum({"grads": grads, "loss": loss}, f"step {self.step + 1}'s gradient sum")
            loss = summed["loss"]
            self._apply(summed["grads"])
        else:
            loss, _ = self._train_step(
                batch.blocks, context, batch.where.anchors, labels, gold_predecessors(batch), *soft
            )
        if self.settings.ema:
            self._update_average()
        mx.eval(loss, self.drafter.state, self.optimizer.state, self.average)
        self.step += 1
        return loss.item()

    def _loss_labels(self, labels: mx.array) -> mx.array:
        """Token labels as indices into the loss's vocabulary (-1: past a sequence's end, or a token outside it)."""
        return mx.where(labels >= 0, self.vocab_index[mx.maximum(labels, 0)], -1)

    def _update_average(self) -> None:
        """average <- d * average + (1 - d) * weights, with d = min(ema, (1 + n) / (10 + n)) after n averaged
        steps: the first steps' weights, far from trained, fade out fast whatever the decay."""
        weights = dict(tree_flatten(self.drafter.parameters()))
        if self.average is None:
            self.average, self.averaged_steps = weights, 0
        d = min(self.settings.ema, (1 + self.averaged_steps) / (10 + self.averaged_steps))
        self.average = {k: d * a + (1 - d) * weights[k] for k, a in self.average.items()}
        self.averaged_steps += 1

    @contextmanager
    def averaged(self):
        """The drafter holds the averaged weights inside the block (the raw ones again after it); without an
        average (`ema` 0, or no step yet) it keeps its own."""
        if self.average is None:
            yield self.drafter
            return
        raw = tree_flatten(self.drafter.parameters())
        self.drafter.load_weights(list(self.average.items()))
        try:
            yield self.drafter
        finally:
            self.drafter.load_weights(raw)

    def accepted_blocks(self, split: str = "heldout") -> np.ndarray:
        """`evaluate.accepted_blocks` of all of `split`'s samples ("heldout", or "probe": training samples the
        drafter has learned from)."""
        samples = self.samples(split)
        return accepted_blocks(
            self.drafter, samples, range(len(samples)), self.settings, lambda b: self.context(b, split), self.peers
        )

    def loop_free_rows(self, split: str = "heldout") -> np.ndarray:
        """Which of `split`'s samples have a response that is not in a loop (`loops.in_a_loop`)."""
        return np.array([not in_a_loop(s.tokens[s.prompt_len :].tolist()) for s in self.samples(split)], bool)

    def evaluate(self, split: str = "heldout", loop_free: bool = False) -> Evaluation:
        """Acceptance on `split`'s samples (`accepted_blocks`); `loop_free`: on those of its blocks whose sample's
        response is not in a loop."""
        blocks = self.accepted_blocks(split)
        return summary(blocks[self.loop_free_rows(split)] if loop_free else blocks, self.settings.block_size)

    def run(self, progress: bool = True, until: int | None = None) -> dict:
        """Train (from the last checkpoint, if any) to `settings.steps`, or stop early with a checkpoint: at
        step `until`, at the time budget, or at the end of the step during which Ctrl-C was pressed.
        A longer --steps on resume stretches the cosine schedule's tail."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        resumed = self.resume() if self.writes else False
        if self.peers:
            resumed = self.peers.any(resumed, "the start")
            self._share_state()
            self._note_checkpoint(resumed)
        s = self.settings
        stop = min(until or s.steps, s.steps)
        tic = time.perf_counter()
        budget = None if s.time_budget is None else tic + 60 * s.time_budget
        with (
            Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total}"),
                TextColumn("loss {task.fields[loss]:.3f}  tau {task.fields[tau]}"),
                TimeRemainingColumn(),
                disable=not progress or not self.writes,
            ) as bar,
            interrupt_requested() as interrupted,
        ):
            task = bar.add_task(
                "train",
                total=s.steps,
                completed=self.step,
                loss=float("nan"),
                tau=self.log[-1].get("tau", "-") if self.log else "-",
            )
            while self.step < stop:
                loss = self.train_step()
                entry = {"step": self.step, "loss": loss, "seconds": time.perf_counter() - tic}
                stopping = interrupted.is_set() or (budget is not None and time.perf_counter() > budget)
                if self.peers:  # every rank stops at the same step
                    stopping = self.peers.any(stopping, "the ranks' agreement to go on")
                last = stopping or self.step == stop
                # every run ends on an evaluation, so the card's tau is that of the weights it describes
                if self.step % s.eval_every == 0 or last:
                    if self.average is not None:  # the raw weights' numbers beside the average's
                        tau, first, _ = self.evaluate()
                        entry.update(raw_tau=round(tau, 4), raw_first_draft=round(first, 4))
                    with self.averaged():
                        blocks = self.accepted_blocks()  # drafted once; the loop-free tau is of some of its rows
                        tau, first, by_position = summary(blocks, s.block_size)
                        free_tau = summary(blocks[self.loop_free_rows()], s.block_size).tau
                        seen_tau = self.evaluate("probe").tau
                    entry.update(
                        tau=round(tau, 4),
                        first_draft=round(first, 4),
                        train_tau=round(seen_tau, 4),
                        loop_free_tau=round(free_tau, 4),
                        by_position=list(by_position),
                    )
                    if self.writes:
                        write_curve(self.out / CURVE_FILE, self.log + [entry])
                self.log.append(entry)
                bar.update(task, completed=self.step, loss=loss, tau=entry.get("tau", bar.tasks[0].fields["tau"]))
                if self.step % s.checkpoint_every == 0 or last:
                    if self.writes:
                        self.save_checkpoint()
                    if self.peers:
                        self._note_checkpoint(True)
                if stopping:
                    break
        return {"resumed": resumed, "step": self.step, "log": self.log}

    def _note_checkpoint(self, saved: bool) -> None:
        """What a lost rank's error says about going on (`ProcessGroup.note`)."""
        self.peers.note = (
            f"rerun the same command to continue from rank 0's {self.checkpoint} (step {self.step})"
            if saved
            else "no checkpoint yet: rerunning the same command starts over"
        )

    def export(self, folder: str | Path) -> Path:
        """The trained drafter (its moving average, if any) as a drafter folder (Hugging Face layout) that
        `load` reads."""
        with self.averaged():
            weights = dict(tree_flatten(self.drafter.parameters()))
        return write_drafter(
            folder, self.drafter.config, weights, self.feature_scale, self.drafter.draft_vocab, self.train_samples
        )
