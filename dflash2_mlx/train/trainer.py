"""Training a DFlash v1 or DFlash 2 drafter for a target (the paper's recipe; the authors never released theirs).

Each step takes a few training sequences (prompt + the target's own response), computes the target's
features once for the whole sequences, and drafts from many random anchors in the responses at once
(`batches`), with the loss of `loss`. The target's embedding and LM head are lent, never trained. AdamW,
warmup + cosine, clipping, a compiled step. The batch of step t depends only on (seed, t), so a resumed run
is bit-identical. By default an exponential moving average of the weights (`ema`) is what gets evaluated
(`evaluate`) and exported (`export`). A run stops at its steps, its time budget or Ctrl-C, with a checkpoint.
"""

from __future__ import annotations

import json
import logging
import shutil
import signal
import tempfile
import threading
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
from ..formats.card import CARD_FILE
from ..formats.config import DraftConfig
from ..formats.shards import read_shards
from ..loading import bind_drafter, load_drafter
from ..target import Target
from .batches import Batch, loss_vocabulary, make_batch
from .evaluate import Evaluation, evaluate
from .export import CURVE_FILE, write_curve, write_drafter
from .features import TEACHER_TOP_K, FeatureCache
from .loss import NO_SOFT, Soft, draft_weights, gold_predecessors, loss_fn
from .settings import TrainSettings, settle

logger = logging.getLogger(__name__)

AVERAGE_FILE = "average.safetensors"


def layers_from_target(drafter: DFlashDraftModel, target: Target) -> None:
    """Start the drafter's L layers as the target's last L layers, and its final norm as the target's: the
    drafter then begins where the target ends (its output already lives in the LM head's space). Weights are
    matched by name and shape (attention and MLP projections, norms); what the target lacks keeps its init."""
    L = len(drafter.layers)
    if L > target.num_layers:
        raise ValueError(f"--init-from-target: the drafter has {L} layers, the target only {target.num_layers}")
    pairs = [(f"layers.{i}.", target.layers[target.num_layers - L + i]) for i in range(L)]
    if target.final_norm is not None:
        pairs.append(("norm.", target.final_norm))
    own = dict(tree_flatten(drafter.parameters()))
    weights = {}
    for prefix, module in pairs:
        if any(isinstance(m, nn.QuantizedLinear) for _, m in module.named_modules()):
            raise ValueError("--init-from-target needs a target with float weights; load it unquantized")
        for name, value in tree_flatten(module.parameters()):
            if own.get(prefix + name) is not None and own[prefix + name].shape == value.shape:
                weights[prefix + name] = value.astype(own[prefix + name].dtype)
    if not any(k.startswith("layers.") for k in weights):
        raise ValueError(f"--init-from-target: no weight of the target's layers ({type(pairs[0][1]).__name__}) "
                         "matches the drafter's names and shapes")
    drafter.load_weights(list(weights.items()), strict=False)
    mx.eval(drafter.parameters())


def _identity_selector(drafter: DFlashDraftModel) -> None:
    """Zero successor codes: every pair score is the unary one, so a new DFlash 2 drafter drafts as its v1
    core does (its convolutions start as identity too) and learns the pairwise term from there."""
    sel = drafter.candidate_selector
    table = sel.successor_projection if sel.factorized else sel.successor_codebook
    table.weight = mx.zeros_like(table.weight)


class Trainer:
    def __init__(self, model, out: str | Path, settings: TrainSettings):
        self.out = Path(out)
        self._read_data(settings)
        self.settings, config = settle(settings, model)
        self._make_drafter(model, config)
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
        """The training samples, the first `eval_samples` held-out ones, and `train_probe`: as many training
        samples, spread over the data, evaluated like the held-out ones (the gap between the two is what the
        drafter memorized rather than learned)."""
        self.train_samples = read_shards(settings.data, heldout=False)
        self.heldout = read_shards(settings.data, heldout=True)[: settings.eval_samples]
        spread = max(1, len(self.train_samples) // max(1, settings.eval_samples))
        self.train_probe = list(range(0, len(self.train_samples), spread))[: settings.eval_samples]
        if len(self.train_samples) < settings.sequences_per_step:
            raise ValueError(f"{settings.data} has {len(self.train_samples)} training samples; need at least "
                             f"{settings.sequences_per_step} (run `dflash2 data` first)")

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
            _identity_selector(self.drafter)
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
            [optim.linear_schedule(0.0, settings.learning_rate, warm),
             optim.cosine_decay(settings.learning_rate, max(1, settings.steps - warm), settings.learning_rate * 0.1)],
            [warm],
        )
        self.optimizer = optim.AdamW(learning_rate=schedule, weight_decay=settings.weight_decay)
        self.optimizer.init(self.drafter.trainable_parameters())
        state = [self.drafter.state, self.optimizer.state]
        value_and_grad = nn.value_and_grad(self.drafter, loss_fn)

        @partial(mx.compile, inputs=state, outputs=state)
        def train_step(blocks, context, anchors, labels, prev_gold, soft_idx, soft_p):
            loss, grads = value_and_grad(self.drafter, blocks, context, TrainingBlocks(anchors), labels,
                                         self.weights, prev_gold, self.vocab, self.head_rows,
                                         Soft(soft_idx, soft_p, settings.distill))
            grads, norm = optim.clip_grad_norm(grads, settings.grad_clip)
            self.optimizer.update(self.drafter, grads)
            return loss, norm

        self._train_step = train_step

    def _make_features(self) -> None:
        """The feature caches (`cache_features`: the target's features computed once, kept in the data
        folder) and the features' channel scale (see `_feature_scale`)."""
        settings = self.settings
        self.caches = {}
        if settings.cache_features:
            self.caches = {"train": FeatureCache(settings.data, self.train_samples, self.target,
                                                 teacher=bool(settings.distill)),
                           "heldout": FeatureCache(settings.data, self.heldout, self.target)}
        self.feature_scale = mx.array(self._feature_scale())

    def _warm_start(self, folder: str) -> None:
        """Start from a drafter folder's weights: fine-tune a published drafter on your target's own
        outputs, or continue training a bundled one."""
        weights = dict(tree_flatten(load_drafter(folder, dtype="float32").parameters()))
        weights["fc.weight"] = weights["fc.weight"] / self.feature_scale  # folders take raw features
        # a v1 folder warm-starting a DFlash 2 drafter lacks the DFlash 2 modules, which keep their identity init
        upgrading = self.drafter.config.is_dflash2 and not any(k.startswith("candidate_selector.") for k in weights)
        self.drafter.load_weights(list(weights.items()), strict=not upgrading)
        mx.eval(self.drafter.parameters())

    def _feature_scale(self) -> np.ndarray:
        """1 / RMS of each feature channel. Targets have "massive activation" channels (SmolLM2: three of
        them hold 93-99% of the energy of its deeper layers), which drown every other channel in
        fc + hidden_norm and made the drafter learn almost nothing from its context. Training sees
        features with unit-RMS channels; `export` folds the scale into fc, so a drafter folder takes the
        target's raw features like any other."""
        if self.caches:
            rows = self.caches["train"].row_sample(20000)
        else:
            rows = np.concatenate([np.array(self.target.sequence_features(mx.array(s.tokens[None]))[0])
                                   for s in self.train_samples[:16]])
        return (1 / np.maximum(np.sqrt(np.mean(rows**2, axis=0)), 1e-3)).astype(np.float32)

    def context(self, batch: Batch, split: str) -> mx.array:
        """The target's features of the batch's sequences (from the cache when there is one), scaled
        channel by channel (see `_feature_scale`)."""
        if split in self.caches:
            features = self.caches[split].context(batch.picked, batch.tokens.shape[1])
        else:
            features = self.target.sequence_features(batch.tokens)
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
        (tmp / "state.json").write_text(json.dumps({"step": self.step, "settings": asdict(self.settings),
                                                    "averaged_steps": self.averaged_steps, "log": self.log},
                                                   indent=2))
        if self.checkpoint.exists():
            shutil.rmtree(self.checkpoint)
        tmp.rename(self.checkpoint)

    def resume(self) -> bool:
        if not (self.checkpoint / "state.json").exists():
            return False
        state = json.loads((self.checkpoint / "state.json").read_text())
        differ = self.settings.changes_from(state["settings"])
        if differ:
            raise ValueError(f"{self.checkpoint} was made with other settings ("
                             + ", ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in differ.items())
                             + "); use the same settings to continue it, or another --out")
        self.drafter.load_weights(list(mx.load(str(self.checkpoint / "drafter.safetensors")).items()))
        # in place: the compiled step holds this very tree as one of its inputs
        for name, value in mx.load(str(self.checkpoint / "optimizer.safetensors")).items():
            *path, last = name.split(".")
            node = self.optimizer.state
            for part in path:
                node = node[int(part)] if isinstance(node, list) else node[part]
            node[int(last) if isinstance(node, list) else last] = value
        self.step, self.log = state["step"], state["log"]
        if self.settings.ema and (self.checkpoint / AVERAGE_FILE).exists():
            self.average, self.averaged_steps = mx.load(str(self.checkpoint / AVERAGE_FILE)), state["averaged_steps"]
        mx.eval(self.drafter.parameters(), self.optimizer.state, self.average)
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
        for s, sample in enumerate(batch.picked):
            n = len((self.train_samples if split == "train" else self.heldout)[sample].tokens)
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
        if self.settings.distill and "train" not in self.caches:
            features, *teacher = self.target.teacher(batch.tokens, TEACHER_TOP_K)
            context = features.astype(mx.float32) * self.feature_scale
            soft = self.soft_targets(batch, "train", teacher)
        else:
            context = self.context(batch, "train")
            soft = self.soft_targets(batch, "train") if self.settings.distill else NO_SOFT
        labels = mx.where(batch.labels >= 0, self.vocab_index[mx.maximum(batch.labels, 0)], -1)
        loss, _ = self._train_step(batch.blocks, context, batch.where.anchors, labels, gold_predecessors(batch), *soft)
        if self.settings.ema:
            self._update_average()
        mx.eval(loss, self.drafter.state, self.optimizer.state, self.average)
        self.step += 1
        return loss.item()

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

    def evaluate(self, split: str = "heldout") -> Evaluation:
        """Acceptance on the held-out samples (`evaluate.evaluate`); split="train": the same on `train_probe`,
        training samples the drafter has learned from."""
        samples, indices = ((self.heldout, range(len(self.heldout))) if split == "heldout"
                            else (self.train_samples, self.train_probe))
        return evaluate(self.drafter, samples, indices, self.settings, lambda batch: self.context(batch, split))

    def run(self, progress: bool = True, until: int | None = None) -> dict:
        """Train (from the last checkpoint, if any) to `settings.steps`, or stop early with a checkpoint: at
        step `until`, at the time budget, or at the end of the step during which Ctrl-C was pressed.
        A longer --steps on resume stretches the cosine schedule's tail."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        resumed = self.resume()
        s = self.settings
        stop = min(until or s.steps, s.steps)
        tic = time.perf_counter()
        budget = None if s.time_budget is None else tic + 60 * s.time_budget
        with Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("loss {task.fields[loss]:.3f}  tau {task.fields[tau]}"), TimeRemainingColumn(),
                      disable=not progress) as bar, interrupt_requested() as interrupted:
            task = bar.add_task("train", total=s.steps, completed=self.step, loss=float("nan"),
                                tau=self.log[-1].get("tau", "-") if self.log else "-")
            while self.step < stop:
                loss = self.train_step()
                entry = {"step": self.step, "loss": loss, "seconds": time.perf_counter() - tic}
                stopping = interrupted.is_set() or (budget is not None and time.perf_counter() > budget)
                last = stopping or self.step == stop
                # every run ends on an evaluation, so the card's tau is that of the weights it describes
                if self.step % s.eval_every == 0 or last:
                    if self.average is not None:  # the raw weights' numbers beside the average's
                        tau, first, _ = self.evaluate()
                        entry.update(raw_tau=round(tau, 4), raw_first_draft=round(first, 4))
                    with self.averaged():
                        tau, first, by_position = self.evaluate()
                        seen_tau = self.evaluate("train").tau
                    entry.update(tau=round(tau, 4), first_draft=round(first, 4), train_tau=round(seen_tau, 4),
                                 by_position=list(by_position))
                    write_curve(self.out / CURVE_FILE, self.log + [entry])
                self.log.append(entry)
                bar.update(task, completed=self.step, loss=loss, tau=entry.get("tau", bar.tasks[0].fields["tau"]))
                if self.step % s.checkpoint_every == 0 or last:
                    self.save_checkpoint()
                if stopping:
                    break
        return {"resumed": resumed, "step": self.step, "log": self.log}

    def export(self, folder: str | Path) -> Path:
        """The trained drafter (its moving average, if any) as a drafter folder (Hugging Face layout) that
        `load` reads."""
        with self.averaged():
            weights = dict(tree_flatten(self.drafter.parameters()))
        return write_drafter(folder, self.drafter.config, weights, self.feature_scale, self.drafter.draft_vocab,
                             self.train_samples)


@contextmanager
def interrupt_requested():
    """An event that Ctrl-C (SIGINT) sets instead of raising, so that a training run stops at the end of its
    step with a checkpoint, as at its time budget; a second Ctrl-C raises KeyboardInterrupt as usual. Signal
    handlers belong to the main thread: elsewhere the event is never set. A process that ignores SIGINT (started
    with `nohup ... &`) keeps ignoring it."""
    requested = threading.Event()
    previous = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or previous in (signal.SIG_IGN, None):
        yield requested
        return

    def handler(signum, frame):
        requested.set()
        signal.signal(signal.SIGINT, previous)
        logger.info("stopping after this step with a checkpoint (Ctrl-C again stops at once, losing the steps "
                    "since the last checkpoint)")

    signal.signal(signal.SIGINT, handler)
    try:
        yield requested
    finally:
        signal.signal(signal.SIGINT, previous)


def evaluate_folder(model, data: str | Path, folder: str | Path, eval_samples: int | None = None) -> Evaluation:
    """The held-out evaluation of a drafter folder trained by `dflash2 train`, with its card's settings (the same
    draft vocabulary, anchors and held-out samples; `eval_samples` of them if given). E.g. the acceptance by
    position for the card of a drafter trained before cards had it:
    `card[ACCEPTANCE_FIELD] = list(evaluate_folder(target, data, folder).by_position)`."""
    st = json.loads((Path(folder) / CARD_FILE).read_text())["settings"]
    keep = ("draft_vocab", "reduced_vocabulary", "anchors_per_sequence", "seed", "eval_samples",
            "selector_factorized", "selector_rank", "selector_top_k")
    fields = {k: st[k] for k in keep if k in st} | ({} if eval_samples is None else {"eval_samples": eval_samples})
    settings = TrainSettings(data=str(data), init_from=str(folder), cache_features=False, ema=0.0, **fields)
    with tempfile.TemporaryDirectory() as out:
        return Trainer(model, out, settings).evaluate()
