"""Training a DFlash v1 or DFlash 2 drafter for a target (the paper's recipe; the authors never released theirs).

Each step takes a few training sequences (prompt + the target's own response), computes the target's
features once for the whole sequences, and drafts from many random anchors in the responses at once: block
`[anchor, mask x (B-1)]` at the anchor's position, attending to the context rows before it and to itself
only. Loss: cross-entropy of the B-1 drafts weighted by exp(-(k-1)/gamma); for DFlash 2 plus the selector's
K-way cross-entropy over the top-K candidates (gold injected when missing, predecessor = the gold previous
token). The target's embedding and LM head are lent, never trained. AdamW, warmup + cosine, clipping, a
compiled step. The batch of step t depends only on (seed, t), so a resumed run is bit-identical. By default
an exponential moving average of the weights (`ema`) is what gets evaluated and exported.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from functools import partial
from typing import NamedTuple
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
from ..vocab import COUNTS_FILE, most_frequent, response_counts, write_draft_vocab
from .data import Sample, padded_tokens, read_shards
from .features import TEACHER_TOP_K, FeatureCache

logger = logging.getLogger(__name__)


@dataclass
class TrainSettings:
    data: str
    architecture: str | None = None  # "dflash2" or "v1"; None: dflash2, or the shape of `init_from`
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
    draft_vocab: int | None = None  # train (and draft) over the N most frequent tokens of the training responses
    init_from: str | None = None  # a drafter folder to start from (its config fixes the drafter's shape;
    # a v1 folder with architecture "dflash2" warm-starts a DFlash 2 drafter: its DFlash 2 modules start as identity)
    init_from_target: bool = False  # the drafter's layers and final norm start as the target's last layers
    distill: float = 0.0  # weight of the soft loss to the target's top-k next tokens (1 - it: the hard labels')
    time_budget: float | None = None  # minutes of wall time per run: stop there with a checkpoint (rerun to go on)
    ema: float = 0.999  # decay of an exponential moving average of the weights, which is what is evaluated and
    # exported (the raw weights' tau is logged beside it); 0: off. Switching it on in a resumed run starts the
    # average at that run's weights. On the full-data runs the average read +0.036 (DFlash 2, 11 of 11
    # evaluations) and +0.015 (v1, 11 of 13) held-out tau over the raw weights (runs/smollm2/recipes/README.md)
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
    dflash2 = settings.architecture != "v1"
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


def _upgraded(config: DraftConfig, settings: TrainSettings) -> DraftConfig:
    """A v1 drafter's config as a DFlash 2 one (the modules DFlash 2 adds shaped by `settings`)."""
    if config.is_dflash2:
        return config
    return replace(config, architecture="DFlash2DraftModel", conv_kernel_size=2, conv_group_size=16,
                   selector_rank=settings.selector_rank, selector_top_k=settings.selector_top_k,
                   selector_factorized=settings.selector_factorized, vocab_size=config.vocab_size)


def _identity_selector(drafter: DFlashDraftModel) -> None:
    """Zero successor codes: every pair score is the unary one, so a new DFlash 2 drafter drafts as its v1
    core does (its convolutions start as identity too) and learns the pairwise term from there."""
    sel = drafter.candidate_selector
    table = sel.successor_projection if sel.factorized else sel.successor_codebook
    table.weight = mx.zeros_like(table.weight)


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


GREEDY = SamplingParams()
EVAL_STEP = 2**31 - 1  # the anchors of the held-out evaluation: the same at every evaluation
_NO_SOFT = (mx.zeros((1, 1, 0), mx.int32), mx.zeros((1, 1, 0)))  # hard labels only


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


class Soft(NamedTuple):
    """Distillation targets: the target's top-k next tokens as indices into the training vocabulary
    [N, B-1, k] (-1: outside it) and their probabilities renormalized over the kept ones; `weight` of
    the soft loss (0: hard labels only, and k = 0)."""

    index: mx.array
    probs: mx.array
    weight: float


def loss_fn(drafter: DFlashDraftModel, blocks, context, where, labels, weights, prev_gold, vocab, head_rows,
            soft: Soft):
    """Weighted draft cross-entropy (+ the selector's K-way cross-entropy for DFlash 2), over the training
    vocabulary `vocab` (token ids [n] with LM-head rows `head_rows`): the softmax over the 5-10k tokens a
    data set uses costs a fraction of one over the full vocabulary, and a token the data never shows
    gets no positive signal either way. `labels` are indices into `vocab`. With `soft.weight` w > 0 the
    draft loss is (1 - w) * the hard labels' cross-entropy + w * the cross-entropy to the target's own
    top-k distribution (forward KL up to a constant)."""
    hidden = drafter.hidden(blocks, context, None, where)[:, 1:]
    logits = drafter.logits(hidden, head_rows).astype(mx.float32)  # [N, B-1, n]
    valid = labels >= 0
    gold = mx.maximum(labels, 0)
    w = weights[None, :] * valid
    ce = nn.losses.cross_entropy(logits, gold, reduction="none")
    if soft.weight:
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        soft_ce = -mx.sum(soft.probs * mx.take_along_axis(logp, mx.maximum(soft.index, 0), axis=-1), axis=-1)
        ce = (1 - soft.weight) * ce + soft.weight * soft_ce
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
        # as many training samples, spread over the data: evaluated like the held-out ones, the gap between
        # the two is what the drafter memorized rather than learned
        spread = max(1, len(self.train_samples) // max(1, settings.eval_samples))
        self.train_probe = list(range(0, len(self.train_samples), spread))[: settings.eval_samples]
        if not 0 <= settings.ema < 1:
            raise ValueError(f"ema {settings.ema} is not a decay: give one in [0, 1), e.g. 0.999 (0 turns the "
                             "moving average off)")
        if len(self.train_samples) < settings.sequences_per_step:
            raise ValueError(f"{settings.data} has {len(self.train_samples)} training samples; need at least "
                             f"{settings.sequences_per_step} (run `dflash2 data` first)")
        if settings.init_from:
            # the drafter's shape is the folder's: record it so the loss, the card and resume agree
            config = DraftConfig.from_path(resolve_path(settings.init_from))
            config = _upgraded(config, settings) if settings.architecture == "dflash2" else config
            if settings.architecture == "v1" and config.is_dflash2:
                raise ValueError(f"{settings.init_from} is a DFlash 2 drafter; it can be fine-tuned as one (leave out "
                                 "--arch) but not trained as a v1 drafter")
            settings = self.settings = replace(
                settings, architecture="dflash2" if config.is_dflash2 else "v1", block_size=config.block_size,
                layers=config.num_hidden_layers, mask_token_id=config.mask_token_id)
        else:
            settings = self.settings = replace(settings, architecture=settings.architecture or "dflash2")
            config = drafter_config(Target(model), settings)
        self.target = Target(model, config.target_layer_ids)
        mx.random.seed(settings.seed)
        self.drafter = DFlashDraftModel(config)
        if config.is_dflash2:
            _identity_selector(self.drafter)
        B = settings.block_size
        if settings.draft_vocab:  # the loss ignores drafts of the rarer tokens: never drafted, never trained
            ids = most_frequent(response_counts(self.train_samples), settings.draft_vocab, config.vocab_size)
        else:
            reduced = settings.reduced_vocabulary
            ids = training_vocabulary(self.train_samples) if reduced else np.arange(config.vocab_size)
        # Trained over its training vocabulary, the drafter drafts over the same one (its draft vocabulary): a
        # token the loss never pushed down could otherwise win a draft.
        self.drafter.draft_vocab = ids if settings.reduced_vocabulary or settings.draft_vocab else None
        bind_drafter(self.drafter, model)
        index = np.full(config.vocab_size, -1, np.int32)
        index[ids] = np.arange(len(ids))
        self.vocab, self.vocab_index, self._index = mx.array(ids, mx.int32), mx.array(index), index
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
        self.average: dict[str, mx.array] | None = None  # the weights' moving average (settings.ema)
        self.averaged_steps = 0
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
        self.caches = {}
        if settings.cache_features:
            self.caches = {"train": FeatureCache(settings.data, self.train_samples, self.target,
                                                 teacher=bool(settings.distill)),
                           "heldout": FeatureCache(settings.data, self.heldout, self.target)}
        self.feature_scale = mx.array(self._feature_scale())
        if settings.init_from_target:
            layers_from_target(self.drafter, self.target)
        if settings.init_from:
            self._warm_start(settings.init_from)

    def _warm_start(self, folder: str) -> None:
        """Start from a drafter folder's weights: fine-tune a published drafter on your target's own
        outputs, or continue training a bundled one in a later session."""
        from ..loading import load_drafter

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
        free = ("steps", "eval_every", "checkpoint_every", "time_budget", "ema")  # none changes the training path
        # settings added after a checkpoint was written take their defaults, which is what it ran with
        defaults = {f.name: f.default for f in fields(TrainSettings) if f.default is not MISSING}
        recorded = {k: v for k, v in {**defaults, **state["settings"]}.items() if k not in free}
        current = {k: v for k, v in asdict(self.settings).items() if k not in free}
        differ = {k: (recorded.get(k), v) for k, v in current.items() if recorded.get(k) != v}
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
            soft = self.soft_targets(batch, "train") if self.settings.distill else _NO_SOFT
        labels = mx.where(batch.labels >= 0, self.vocab_index[mx.maximum(batch.labels, 0)], -1)
        loss, _ = self._train_step(batch.blocks, context, batch.where.anchors, labels, _prev_gold(batch), *soft)
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
        """Acceptance on held-out samples, teacher-forced: with greedy-regenerated data the response IS the
        target's greedy continuation, so the leading matches of each block's greedy drafts are exactly what
        verification would accept. tau = mean(accepted + 1); first_draft = how often draft 1 is right;
        by_position[i] = P(draft i+1 accepted | drafts 1..i accepted), what adaptive mode starts from.
        split="train": the same on `train_probe`, training samples the drafter has learned from."""
        samples, indices = ((self.heldout, range(len(self.heldout))) if split == "heldout"
                            else (self.train_samples, self.train_probe))
        if not indices:
            return Evaluation(float("nan"), float("nan"), ())
        accepted, first = [], []
        for start in range(0, len(indices), 4):
            chunk = [samples[i] for i in indices[start : start + 4]]
            batch = make_batch(chunk, EVAL_STEP, self.settings, self.drafter.config.mask_token_id, sequences=len(chunk))
            batch.picked = [indices[start + i] for i in batch.picked]  # indices into the split's samples
            context = self.context(batch, split)
            hidden = self.drafter.hidden(batch.blocks, context, None, batch.where)[:, 1:]
            logits = self.drafter.draft_logits(hidden)
            drafts = mx.stack([
                self.drafter.choose(hidden[n], logits[n], batch.blocks[n, 0], GREEDY).tokens
                for n in range(logits.shape[0])
            ])
            match = np.array((drafts == batch.labels) & (batch.labels >= 0))
            accepted += list(np.cumprod(match, axis=1).sum(axis=1))
            first += list(match[:, 0])
        reached = [np.sum(np.array(accepted) >= i) for i in range(self.settings.block_size)]
        by_position = tuple(round(float(reached[i + 1] / reached[i]), 4) if reached[i] else 0.0
                            for i in range(self.settings.block_size - 1))
        return Evaluation(float(np.mean(accepted) + 1), float(np.mean(first)), by_position)

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
        """The trained drafter as a drafter folder (Hugging Face layout) that `load` reads."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        from ..checkpoints.hf import hf_names, write_weights

        config = self.drafter.config.to_hf_dict()
        config["dtype"] = "float32"
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        with self.averaged():
            weights = dict(tree_flatten(self.drafter.parameters()))
        weights["fc.weight"] = weights["fc.weight"] * self.feature_scale  # takes raw target features
        write_weights(folder, hf_names(weights, self.drafter.config))
        if self.drafter.draft_vocab is not None:
            write_draft_vocab(folder, self.drafter.draft_vocab)
        np.save(folder / COUNTS_FILE, response_counts(self.train_samples, self.drafter.config.vocab_size))
        return folder


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


class Evaluation(NamedTuple):
    tau: float  # mean committed tokens per block, bonus included
    first_draft: float  # fraction of blocks whose first draft is right
    by_position: tuple[float, ...] = ()  # P(draft i accepted | the drafts before it accepted), i = 1..B-1


CURVE_FILE = "curve.csv"
AVERAGE_FILE = "average.safetensors"


def write_curve(path: Path, log: list[dict]) -> None:
    """The learning curve as CSV: per evaluation, the step, the mean training loss since the previous
    evaluation, held-out tau and first-draft accuracy, and the training wall time so far; with a moving
    average of the weights, tau and first-draft accuracy are the average's, and two more columns give the
    raw weights'; the last column is the same tau on training samples (`train_tau`). Columns a row's run did not
    measure are empty."""
    raw = any("raw_tau" in e for e in log)
    header = "step,train_loss,heldout_tau,heldout_first_draft,train_seconds"
    lines, losses = [header + (",raw_tau,raw_first_draft" if raw else "") + ",train_tau"], []
    elapsed, last = 0.0, 0.0
    for entry in log:
        if entry["seconds"] < last:  # a resumed run's clock starts again
            elapsed += last
        last = entry["seconds"]
        losses.append(entry["loss"])
        if "tau" in entry:
            lines.append(f"{entry['step']},{np.mean(losses):.4f},{entry['tau']},{entry.get('first_draft', '')},"
                         f"{elapsed + last:.1f}"
                         + (f",{entry.get('raw_tau', '')},{entry.get('raw_first_draft', '')}" if raw else "")
                         + f",{entry.get('train_tau', '')}")
            losses = []
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def sparkline(values: list[float], lo: float | None = None, hi: float | None = None) -> str:
    """One block character per value, scaled between `lo` and `hi` (default: the values' min and max)."""
    bars = "▁▂▃▄▅▆▇█"
    lo = min(values, default=0) if lo is None else lo
    hi = max(values, default=0) if hi is None else hi
    level = lambda v: 0 if hi == lo else min(len(bars) - 1, max(0, round((v - lo) / (hi - lo) * (len(bars) - 1))))
    return "".join(bars[level(v)] for v in values)


def run_seconds(log: list[dict]) -> list[float]:
    """Wall time of each run of a resumed training, read off the step log (each run's clock starts at 0)."""
    runs = [0.0]
    for entry in log:
        if entry["seconds"] < runs[-1]:
            runs.append(0.0)
        runs[-1] = entry["seconds"]
    return runs


def _draft_vocab_words(trainer: Trainer, size: int | None) -> str:
    if size is None:
        return "the whole vocabulary"
    if trainer.settings.draft_vocab:
        return f"{size} tokens, the most frequent of the training responses"
    return f"{size} tokens, every token of the training data"


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
        "heldout_tau_raw_weights": evals[-1].get("raw_tau") if evals else None,  # with a moving average (ema)
        "train_tau": evals[-1].get("train_tau") if evals else None,  # the same on training samples
        # P(draft i accepted | drafts 1..i-1 accepted), i = 1..B-1: adaptive mode's prior (`adaptive.card_prior`)
        "heldout_acceptance_by_position": evals[-1].get("by_position") if evals else None,
        "heldout_tau_history": [(e["step"], e["tau"]) for e in evals],
        "heldout_first_draft_history": [(e["step"], e["first_draft"]) for e in evals if "first_draft" in e],
        "parameters": int(sum(v.size for _, v in tree_flatten(trainer.drafter.parameters()))),
        "draft_vocab": None if trainer.drafter.draft_vocab is None else len(trainer.drafter.draft_vocab),
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
        f"- draft vocabulary: {_draft_vocab_words(trainer, card['draft_vocab'])}",
        f"- held-out acceptance length tau (teacher-forced, T = 0): {card['heldout_tau']}"
        + (f" (the weights are a moving average, decay {trainer.settings.ema}; the last step's own weights: "
           f"{card['heldout_tau_raw_weights']})" if card["heldout_tau_raw_weights"] is not None else ""),
        *([f"- the same on {len(trainer.train_probe)} training samples: {card['train_tau']} (above the held-out tau "
           "by what the drafter memorized rather than learned)"] if card["train_tau"] is not None else []),
        f"- held-out tau over training (steps {evals[0]['step']}..{evals[-1]['step']}, {len(evals)} evaluations, "
        f"{min(e['tau'] for e in evals)}..{max(e['tau'] for e in evals)}): {sparkline([e['tau'] for e in evals])}"
        if evals else "- no evaluation yet",
        f"- training time: {card['train_seconds']} s of wall time over {card['runs']} run(s)",
    ]
    (folder / "README.md").write_text("\n".join(lines) + "\n")


def evaluate_folder(model, data: str | Path, folder: str | Path, eval_samples: int | None = None) -> Evaluation:
    """The held-out evaluation of a drafter folder trained by `dflash2 train` (its card's settings: the same
    draft vocabulary, anchors and held-out samples, `eval_samples` of them if given), e.g. to add the acceptance
    by position to the card of a drafter trained before the card had it:
    `card["heldout_acceptance_by_position"] = list(evaluate_folder(model, data, folder).by_position)`."""
    import tempfile

    st = json.loads((Path(folder) / "card.json").read_text())["settings"]
    settings = TrainSettings(
        data=str(data), init_from=str(folder), draft_vocab=st["draft_vocab"],
        reduced_vocabulary=st["reduced_vocabulary"], cache_features=False, anchors_per_sequence=st["anchors_per_sequence"], ema=0.0, seed=st["seed"],
        eval_samples=eval_samples or st["eval_samples"], selector_factorized=st["selector_factorized"],
        selector_rank=st["selector_rank"], selector_top_k=st["selector_top_k"])
    with tempfile.TemporaryDirectory() as out:
        return Trainer(model, out, settings).evaluate()
