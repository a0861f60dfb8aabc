"""Training a DFlash v1 or DFlash 2 drafter for a target (the paper's recipe; the authors never released theirs).

Each step takes a few training sequences (prompt + the target's own response), computes the target's
features once for the whole sequences, and drafts from many random anchors in the responses at once: block
`[anchor, mask x (B-1)]` at the anchor's position, attending to the context rows before it and to itself
only. Loss: cross-entropy of the B-1 drafts weighted by exp(-(k-1)/gamma); for DFlash 2 plus the selector's
K-way cross-entropy over the top-K candidates (gold injected when missing, predecessor = the gold previous
token). The target's embedding and LM head are lent, never trained. AdamW, warmup + cosine, clipping, a
compiled step. The batch of step t depends only on (seed, t), so a resumed run is bit-identical.
"""

from __future__ import annotations

import json
import math
import shutil
import time
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from ..config import DraftConfig, default_target_layer_ids
from ..drafter import DFlashDraftModel, TrainingBlocks
from ..loading import bind_drafter, resolve_path
from ..sampling import SamplingParams
from ..target import Target
from ..vocab import COUNTS_FILE, token_counts, write_draft_vocab
from .data import Sample, padded_tokens, read_shards
from .features import FeatureCache


@dataclass
class TrainSettings:
    data: str
    architecture: str = "dflash2"  # or "v1"
    block_size: int = 8
    layers: int = 1
    steps: int = 1000
    sequences_per_step: int = 4
    anchors_per_sequence: int = 32
    learning_rate: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None  # None: the paper's value for the block size (7 @ 16, 5 @ 10, 4 @ 8)
    selector_rank: int = 64
    selector_top_k: int = 16
    selector_factorized: bool = True
    mask_token_id: int | None = None
    seed: int = 0
    eval_every: int = 100
    checkpoint_every: int = 50
    eval_samples: int = 40
    cache_features: bool = True  # the target's features computed once, kept in the data folder
    reduced_vocabulary: bool = True  # the loss's softmax over the tokens of the training data only
    init_from: str | None = None  # a drafter folder to start from (its config fixes the drafter's shape)
    extra: dict = field(default_factory=dict)

    def loss_gamma(self) -> float:
        if self.gamma is not None:
            return self.gamma
        return 7.0 if self.block_size >= 16 else 5.0 if self.block_size >= 10 else 4.0


def drafter_config(target: Target, settings: TrainSettings) -> DraftConfig:
    """A new drafter shaped like the target's own layers."""
    args = target.model.args
    heads = getattr(args, "num_attention_heads", 8)
    n = target.num_layers
    ids = default_target_layer_ids(n) if n >= 8 else tuple(sorted({round(i * (n - 1) / 4) for i in range(5)}))
    dflash2 = settings.architecture == "dflash2"
    return DraftConfig(
        architecture="DFlash2DraftModel" if dflash2 else "DFlashDraftModel",
        hidden_size=target.hidden_size,
        num_hidden_layers=settings.layers,
        num_attention_heads=heads,
        num_key_value_heads=getattr(args, "num_key_value_heads", None) or heads,
        head_dim=getattr(args, "head_dim", None) or target.hidden_size // heads,
        intermediate_size=getattr(args, "intermediate_size", 4 * target.hidden_size),
        rms_norm_eps=getattr(args, "rms_norm_eps", 1e-6),
        rope_theta=float(getattr(args, "rope_theta", 10000.0)),
        block_size=settings.block_size,
        target_layer_ids=ids,
        mask_token_id=settings.mask_token_id if settings.mask_token_id is not None else target.vocab_size - 1,
        vocab_size=target.vocab_size,
        num_target_layers=n,
        is_causal=False,
        conv_kernel_size=2 if dflash2 else 0,
        conv_group_size=16 if dflash2 else 0,
        selector_rank=settings.selector_rank if dflash2 else 0,
        selector_top_k=settings.selector_top_k if dflash2 else 0,
        selector_factorized=settings.selector_factorized and dflash2,
    )


GREEDY = SamplingParams()
EVAL_STEP = 2**31 - 1  # the anchors of the held-out evaluation: the same at every evaluation


@dataclass
class Batch:
    tokens: mx.array  # [S, L] padded sequences
    blocks: mx.array  # [N, B] anchor + masks
    labels: mx.array  # [N, B-1] the tokens the drafts should be; -1 past a sequence's end
    where: TrainingBlocks
    picked: list[int]  # the samples, one per sequence row


def make_batch(samples: list[Sample], step: int, settings: TrainSettings, mask_id: int,
               sequences: int | None = None) -> Batch:
    """The batch of `step`: a pure function of (seed, step), which makes resumed runs exact."""
    rng = np.random.default_rng([settings.seed, step])
    picked = rng.choice(len(samples), size=sequences or settings.sequences_per_step, replace=False)
    length = max(len(samples[i].tokens) for i in picked)
    length = int(math.ceil(length / 64) * 64)  # few distinct shapes, few recompilations
    tokens = padded_tokens(samples, picked, length)
    anchors, labels = [], []
    B = settings.block_size
    for i in picked:
        s = samples[i]
        first, last = s.prompt_len, len(s.tokens) - 2  # anchors are response tokens with a next token
        if last < first:
            first = last = max(len(s.tokens) - 2, 0)
        a = rng.integers(first, last + 1, size=settings.anchors_per_sequence)
        for anchor in a:
            nxt = s.tokens[anchor + 1 : anchor + B]
            labels.append(np.concatenate([nxt, -np.ones(B - 1 - len(nxt), np.int32)]))
        anchors.append(a)
    anchors = np.stack(anchors)  # [S, A]
    blocks = np.full((anchors.size, B), mask_id, np.int32)
    blocks[:, 0] = np.take_along_axis(tokens, anchors, axis=1).reshape(-1)
    return Batch(mx.array(tokens), mx.array(blocks), mx.array(np.stack(labels)),
                 TrainingBlocks(mx.array(anchors)), [int(i) for i in picked])


def training_vocabulary(samples: list[Sample]) -> np.ndarray:
    """Every token id the training samples contain (prompts and responses), sorted."""
    return np.unique(np.concatenate([s.tokens for s in samples])).astype(np.int32)


def loss_fn(drafter: DFlashDraftModel, blocks, context, where, labels, weights, prev_gold, vocab, head_rows):
    """Weighted draft cross-entropy (+ the selector's K-way cross-entropy for DFlash 2), over the training
    vocabulary `vocab` (token ids [n] with LM-head rows `head_rows`): the softmax over the 5-10k tokens a
    data set uses costs a fraction of one over the full vocabulary, and a token the data never shows
    gets no positive signal either way. `labels` are indices into `vocab`."""
    hidden = drafter.hidden(blocks, context, None, where)[:, 1:]
    logits = drafter.logits(hidden, head_rows).astype(mx.float32)  # [N, B-1, n]
    valid = labels >= 0
    gold = mx.maximum(labels, 0)
    w = weights[None, :] * valid
    ce = nn.losses.cross_entropy(logits, gold, reduction="none")
    loss = mx.sum(ce * w) / mx.maximum(mx.sum(w), 1)
    if not drafter.config.is_dflash2:
        return loss
    sel = drafter.candidate_selector
    k = min(sel.top_k, logits.shape[-1])
    cand = mx.stop_gradient(mx.argpartition(-logits, k - 1, axis=-1)[..., :k])
    has_gold = mx.any(cand == gold[..., None], axis=-1, keepdims=True)
    cand = mx.where(has_gold, cand, mx.concatenate([cand[..., :-1], gold[..., None]], axis=-1))  # inject gold
    unary = mx.take_along_axis(logits, cand, axis=-1)
    h = sel.hidden_projection(hidden).astype(mx.float32)
    pred = sel.predecessor_codes(prev_gold, drafter._target.embed)
    succ = sel.successor_codes(vocab[cand], drafter._target.embed)
    scores = unary + mx.sum((pred.astype(mx.float32) * h)[..., None, :] * succ.astype(mx.float32), axis=-1)
    target_index = mx.argmax(cand == gold[..., None], axis=-1)
    sel_ce = nn.losses.cross_entropy(scores, target_index, reduction="none")
    return loss + mx.sum(sel_ce * w) / mx.maximum(mx.sum(w), 1)


def _prev_gold(batch: Batch) -> mx.array:
    """The predecessor of each draft row's gold token: the anchor, then the gold drafts before it."""
    return mx.concatenate([batch.blocks[:, :1], mx.maximum(batch.labels[:, :-1], 0)], axis=1)


class Trainer:
    def __init__(self, model, out: str | Path, settings: TrainSettings):
        self.settings = settings
        self.out = Path(out)
        self.train_samples = read_shards(settings.data, heldout=False)
        self.heldout = read_shards(settings.data, heldout=True)[: settings.eval_samples]
        if len(self.train_samples) < settings.sequences_per_step:
            raise ValueError(f"{settings.data} has {len(self.train_samples)} training samples; need at least "
                             f"{settings.sequences_per_step} (run `dflash2 data` first)")
        if settings.init_from:
            # the drafter's shape is the folder's: record it so the loss, the card and resume agree
            config = DraftConfig.from_path(resolve_path(settings.init_from))
            settings = self.settings = replace(
                settings, architecture="dflash2" if config.is_dflash2 else "v1", block_size=config.block_size,
                layers=config.num_hidden_layers, mask_token_id=config.mask_token_id)
        else:
            config = drafter_config(Target(model), settings)
        self.target = Target(model, config.target_layer_ids)
        mx.random.seed(settings.seed)
        self.drafter = DFlashDraftModel(config)
        B = settings.block_size
        ids = training_vocabulary(self.train_samples) if settings.reduced_vocabulary else np.arange(config.vocab_size)
        # Trained over its training vocabulary, the drafter drafts over the same one (its draft vocabulary): a
        # token the loss never pushed down could otherwise win a draft.
        self.drafter.draft_vocab = ids if settings.reduced_vocabulary else None
        bind_drafter(self.drafter, model)
        index = np.full(config.vocab_size, -1, np.int32)
        index[ids] = np.arange(len(ids))
        self.vocab, self.vocab_index = mx.array(ids, mx.int32), mx.array(index)
        self.head_rows = mx.stop_gradient(self.target.head_rows(self.vocab).astype(mx.float32))
        self.weights = mx.exp(-mx.arange(B - 1, dtype=mx.float32) / settings.loss_gamma())
        warm = max(1, int(settings.warmup * settings.steps))
        schedule = optim.join_schedules(
            [optim.linear_schedule(0.0, settings.learning_rate, warm),
             optim.cosine_decay(settings.learning_rate, max(1, settings.steps - warm), settings.learning_rate * 0.1)],
            [warm],
        )
        self.optimizer = optim.AdamW(learning_rate=schedule, weight_decay=settings.weight_decay)
        self.optimizer.init(self.drafter.trainable_parameters())
        self.step = 0
        self.log: list[dict] = []
        state = [self.drafter.state, self.optimizer.state]
        value_and_grad = nn.value_and_grad(self.drafter, loss_fn)

        @partial(mx.compile, inputs=state, outputs=state)
        def train_step(blocks, context, anchors, labels, prev_gold):
            loss, grads = value_and_grad(self.drafter, blocks, context, TrainingBlocks(anchors), labels,
                                         self.weights, prev_gold, self.vocab, self.head_rows)
            grads, norm = optim.clip_grad_norm(grads, settings.grad_clip)
            self.optimizer.update(self.drafter, grads)
            return loss, norm

        self._train_step = train_step
        self.caches = {}
        if settings.cache_features:
            self.caches = {"train": FeatureCache(settings.data, self.train_samples, self.target),
                           "heldout": FeatureCache(settings.data, self.heldout, self.target)}
        self.feature_scale = mx.array(self._feature_scale())
        if settings.init_from:
            self._warm_start(settings.init_from)

    def _warm_start(self, folder: str) -> None:
        """Start from a drafter folder's weights: fine-tune a published drafter on your target's own
        outputs, or continue training a bundled one in a later session."""
        from ..loading import load_drafter

        weights = dict(tree_flatten(load_drafter(folder, dtype="float32").parameters()))
        weights["fc.weight"] = weights["fc.weight"] / self.feature_scale  # folders take raw features
        self.drafter.load_weights(list(weights.items()))
        mx.eval(self.drafter.parameters())

    def _feature_scale(self) -> np.ndarray:
        """1 / RMS of each feature channel. Targets have "massive activation" channels (SmolLM2: three of
        them hold 93-99% of the energy of its deeper layers), which drown every other channel in
        fc + hidden_norm and made the drafter learn almost nothing from its context. Training sees
        features with unit-RMS channels; `export` folds the scale into fc, so a drafter folder takes the
        target's raw features like any other."""
        if self.caches:
            rows = self.caches["train"].rows
            rows = np.asarray(rows[:: max(1, len(rows) // 20000)], np.float32)
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
        (tmp / "state.json").write_text(json.dumps({"step": self.step, "settings": asdict(self.settings),
                                                    "log": self.log}, indent=2))
        if self.checkpoint.exists():
            shutil.rmtree(self.checkpoint)
        tmp.rename(self.checkpoint)

    def resume(self) -> bool:
        if not (self.checkpoint / "state.json").exists():
            return False
        state = json.loads((self.checkpoint / "state.json").read_text())
        free = ("steps", "eval_every", "checkpoint_every")
        # settings added after a checkpoint was written take their defaults, which is what it ran with
        defaults = {f.name: f.default for f in fields(TrainSettings) if f.default is not MISSING}
        recorded = {k: v for k, v in {**defaults, **state["settings"]}.items() if k not in free}
        current = {k: v for k, v in asdict(self.settings).items() if k not in free}
        if recorded != current:
            raise ValueError(f"{self.checkpoint} was made with other settings ({recorded}); use another --out")
        self.drafter.load_weights(list(mx.load(str(self.checkpoint / "drafter.safetensors")).items()))
        # in place: the compiled step holds this very tree as one of its inputs
        for name, value in mx.load(str(self.checkpoint / "optimizer.safetensors")).items():
            *path, last = name.split(".")
            node = self.optimizer.state
            for part in path:
                node = node[int(part)] if isinstance(node, list) else node[part]
            node[int(last) if isinstance(node, list) else last] = value
        self.step, self.log = state["step"], state["log"]
        mx.eval(self.drafter.parameters(), self.optimizer.state)
        return True

    # -- training ------------------------------------------------------------------------------------------
    def train_step(self) -> float:
        batch = make_batch(self.train_samples, self.step, self.settings, self.drafter.config.mask_token_id)
        context = self.context(batch, "train")
        labels = mx.where(batch.labels >= 0, self.vocab_index[mx.maximum(batch.labels, 0)], -1)
        loss, _ = self._train_step(batch.blocks, context, batch.where.anchors, labels, _prev_gold(batch))
        mx.eval(loss, self.drafter.state, self.optimizer.state)
        self.step += 1
        return loss.item()

    def evaluate(self) -> float:
        """Acceptance length tau on held-out samples, teacher-forced: with greedy-regenerated data the
        response IS the target's greedy continuation, so the leading matches of each block's greedy drafts
        are exactly what verification would accept. tau = mean(accepted + 1)."""
        if not self.heldout:
            return float("nan")
        accepted = []
        for start in range(0, len(self.heldout), 4):
            chunk = self.heldout[start : start + 4]
            batch = make_batch(chunk, EVAL_STEP, self.settings, self.drafter.config.mask_token_id, sequences=len(chunk))
            batch.picked = [start + i for i in batch.picked]  # indices into the held-out list
            context = self.context(batch, "heldout")
            hidden = self.drafter.hidden(batch.blocks, context, None, batch.where)[:, 1:]
            logits = self.drafter.draft_logits(hidden)
            drafts = mx.stack([
                self.drafter.choose(hidden[n], logits[n], batch.blocks[n, 0], GREEDY).tokens
                for n in range(logits.shape[0])
            ])
            match = np.array((drafts == batch.labels) & (batch.labels >= 0))
            accepted += list(np.cumprod(match, axis=1).sum(axis=1))
        return float(np.mean(accepted) + 1) if accepted else float("nan")

    def run(self, progress: bool = True, until: int | None = None) -> dict:
        """Train (from the last checkpoint, if any) to `settings.steps`, or stop early at step `until`
        with a checkpoint. A longer --steps on resume stretches the cosine schedule's tail."""
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

        resumed = self.resume()
        s = self.settings
        stop = min(until or s.steps, s.steps)
        tic = time.perf_counter()
        with Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                      TextColumn("loss {task.fields[loss]:.3f}  tau {task.fields[tau]}"), TimeRemainingColumn(),
                      disable=not progress) as bar:
            task = bar.add_task("train", total=s.steps, completed=self.step, loss=float("nan"),
                                tau=self.log[-1].get("tau", "-") if self.log else "-")
            while self.step < stop:
                loss = self.train_step()
                entry = {"step": self.step, "loss": loss, "seconds": time.perf_counter() - tic}
                if self.step % s.eval_every == 0 or self.step == s.steps:
                    entry["tau"] = round(self.evaluate(), 4)
                self.log.append(entry)
                bar.update(task, completed=self.step, loss=loss, tau=entry.get("tau", bar.tasks[0].fields["tau"]))
                if self.step % s.checkpoint_every == 0 or self.step == stop:
                    self.save_checkpoint()
        return {"resumed": resumed, "step": self.step, "log": self.log}

    def export(self, folder: str | Path) -> Path:
        """The trained drafter as a drafter folder (Hugging Face layout) that `load` reads."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        from ..checkpoints.hf import hf_names, write_weights

        config = self.drafter.config.to_hf_dict()
        config["dtype"] = "float32"
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        weights = dict(tree_flatten(self.drafter.parameters()))
        weights["fc.weight"] = weights["fc.weight"] * self.feature_scale  # takes raw target features
        write_weights(folder, hf_names(weights, self.drafter.config))
        if self.drafter.draft_vocab is not None:
            write_draft_vocab(folder, self.drafter.draft_vocab)
        np.save(folder / COUNTS_FILE, token_counts(self.settings.data, self.drafter.config.vocab_size))
        return folder


def run_seconds(log: list[dict]) -> list[float]:
    """Wall time of each run of a resumed training, read off the step log (each run's clock starts at 0)."""
    runs = [0.0]
    for entry in log:
        if entry["seconds"] < runs[-1]:
            runs.append(0.0)
        runs[-1] = entry["seconds"]
    return runs


def write_card(folder: str | Path, trainer: Trainer, target_name: str) -> None:
    """A short training card next to the drafter: data, steps, time, held-out acceptance."""
    folder = Path(folder)
    evals = [e for e in trainer.log if "tau" in e]
    runs = run_seconds(trainer.log)
    data = read_shards(trainer.settings.data)
    card = {
        "target": target_name,
        "architecture": trainer.drafter.config.architecture,
        "settings": asdict(trainer.settings),
        "data": {"train_samples": len(trainer.train_samples), "heldout_samples": sum(s.heldout for s in data),
                 "response_tokens": int(sum(len(s.tokens) - s.prompt_len for s in data))},
        "steps": trainer.step,
        "runs": len(runs),
        "train_seconds": round(sum(runs), 1),
        "heldout_tau": evals[-1]["tau"] if evals else None,
        "heldout_tau_history": [(e["step"], e["tau"]) for e in evals],
        "parameters": int(sum(v.size for _, v in tree_flatten(trainer.drafter.parameters()))),
    }
    (folder / "card.json").write_text(json.dumps(card, indent=2))
    lines = [
        f"# {card['architecture']} drafter for {target_name}",
        "",
        f"- data: {card['data']['train_samples']} training / {card['data']['heldout_samples']} held-out samples "
        f"({card['data']['response_tokens']} response tokens regenerated by the target) from {trainer.settings.data}",
        f"- {trainer.step} steps of {trainer.settings.sequences_per_step} sequences x "
        f"{trainer.settings.anchors_per_sequence} anchors, block {trainer.settings.block_size}, "
        f"{trainer.settings.layers} layer(s), {card['parameters']:,} parameters",
        f"- held-out acceptance length tau (teacher-forced, T = 0): {card['heldout_tau']}",
        f"- training time: {card['train_seconds']} s of wall time over {card['runs']} run(s)",
    ]
    (folder / "README.md").write_text("\n".join(lines) + "\n")
