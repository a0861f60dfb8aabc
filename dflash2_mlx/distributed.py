"""A target sharded over several processes: MLX distributed, the processes started by `mlx.launch` (one per
Mac, or several on one machine), the target split by mlx-lm itself (`mlx_lm.utils.sharded_load`): pipeline
parallel (`model.model.pipeline`: each process runs a run of consecutive layers, rank 0 the last ones) or tensor
parallel (`model.shard`: each process holds a slice of every layer). Dense qwen3 and llama targets, which mlx-lm
does not pipeline, get mlx-lm's pipeline from `patches.pipeline_stage` and are loaded as `sharded_load` loads a
pipeline (`_pipeline_load`).

Every process runs every target forward (mlx-lm's sharded models exchange activations inside it); rank 0
alone runs the decode loop (`decode.py`, as in one process): it drafts, samples and accepts, and the other ranks
follow it (`follow`). Before each target operation rank 0 broadcasts one message: the operation, the cache it
is on, a count and the tokens fed (a cycle's anchor and drafts; a prompt chunk longer than the message follows
in a second one); a rollback's count is the rows kept (the accepted drafts and the anchor). Each process rolls
back its own caches, recurrent layers included; a cache rank 0 copies (a prompt-cache slot shared in part) is
copied in every process. A broadcast is an `all_sum` to which the other ranks give
zeros. Every collective runs in the same order in every process: rank 0 finishes each operation (its logits
and the drafter's context) before it announces the next, as the other ranks do.

The drafter's context is its `fc` (a linear map) of the outputs of a few target layers, concatenated. In a
pipeline those layers live in different processes, so each applies its columns of `fc` to the layers it holds
and the processes sum the [rows, hidden] results: `fc` of the whole concatenation, for a fraction of the
traffic of gathering the features. Tensor parallel: every layer's output is whole in every process and rank 0
applies `fc` alone. Either way the drafter is handed its context through `fc` already
(`DFlashDraftModel.context_projected`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import itertools
import json
import re
import weakref
from enum import IntEnum
from importlib.metadata import version

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model, load_tokenizer, sharded_load

from . import patches
from .drafter import DFlashDraftModel
from .formats.quantize import DraftQuant
from .loading import DTYPES, bind_drafter, load_drafter, resolve_path
from .process_group import DEFAULT_TIMEOUT, connect, deadline, progress_watch
from .target import Capture, Target

MODES = ("pipeline", "tensor")
CONNECT_TIMEOUT = 60.0  # seconds to reach the other processes and agree on what they loaded


class Op(IntEnum):
    """What rank 0 asks of the others: the first number of each announcement (`ShardedTarget.lead`)."""

    START = 1  # a new cache
    FREE = 2  # drop the caches whose keys follow
    FORWARD = 3  # a forward over the ids that records the drafter's layers (`Capture.forward`)
    VERIFY = 4  # a forward over the ids (anchor and drafts) that a rollback can undo (`Capture.verify`)
    ROLLBACK = 5  # keep the first `count` rows of the cache's last verify pass
    TRIM = 6  # forget the cache's last `count` tokens (`Target._trim`)
    PLAIN = 7  # a plain forward over the ids
    STOP = 8  # stop following
    COPY = 9  # copy the cache into a new one, whose key is `count`


_FED = (Op.FREE, Op.FORWARD, Op.VERIFY, Op.PLAIN)  # operations that broadcast ids
STOP_TIMEOUT = 10.0  # seconds rank 0, ending on an error, waits for the others to take its stop
MESSAGE_IDS = 64  # ids sent within the announcement (a cycle's block); more follow in a second broadcast


def init_group(backend: str = "any", timeout: float = CONNECT_TIMEOUT) -> mx.distributed.Group:
    """The group of the processes `mlx.launch` started (at least two). A process that cannot reach the others
    within `timeout` seconds ends with a message naming the hostfile."""
    group = connect(timeout, backend, command="generate")
    if group.size() < 2:
        raise ValueError(
            "a sharded target needs at least two processes, and this one is alone: start them with "
            "mlx.launch (--hostfile hosts.json, or -n 2 on one machine)"
        )
    return group


def check_same(group: mx.distributed.Group, items: dict[str, str], timeout: float = CONNECT_TIMEOUT) -> None:
    """Every rank must hold the same `items` (name -> text, e.g. a checksum): a rank that differs from rank 0 is
    an error, raised on every rank."""
    digests = b"".join(hashlib.sha256(text.encode()).digest() for text in items.values())
    mine = mx.array(np.frombuffer(digests, np.uint8).astype(np.int32))[None]
    with deadline(
        timeout,
        f"dflash2: error: the other processes did not answer within {timeout:g} s while comparing what each loaded",
    ):
        every = np.array(mx.distributed.all_gather(mine, group=group))
    every = every.reshape(group.size(), len(items), 32)
    for j, name in enumerate(items):
        differ = [r for r in range(group.size()) if (every[r, j] != every[0, j]).any()]
        if differ:
            raise ValueError(
                f"rank{'s' if len(differ) > 1 else ''} {', '.join(map(str, differ))} loaded a different "
                f"{name} from rank 0's: every process must load the same files"
            )


def drafter_checksum(drafter: DFlashDraftModel) -> str:
    """The drafter's config, weights (as loaded, names included) and draft vocabulary, hashed."""
    h = hashlib.sha256(json.dumps(drafter.config.to_hf_dict(), sort_keys=True).encode())
    for name, weight in sorted(tree_flatten(drafter.parameters()), key=lambda item: item[0]):
        h.update(name.encode())
        h.update(np.array(weight.astype(mx.float32) if weight.dtype == mx.bfloat16 else weight).tobytes())
    if drafter.draft_vocab is not None:
        h.update(np.asarray(drafter.draft_vocab, np.int64).tobytes())
    return h.hexdigest()


def check_shardable(model: nn.Module, mode: str) -> None:
    """Refuse a model that cannot be sharded the way asked (by mlx-lm, or for a pipeline by
    `patches.pipeline_stage`), naming the way it can."""
    inner = getattr(model, "model", None)
    pipeline = inner is not None and (hasattr(inner, "pipeline") or patches.pipeline_forward(inner) is not None)
    tensor = hasattr(model, "shard")
    kind = getattr(model, "model_type", type(model).__module__.rsplit(".", 1)[-1])
    if mode not in MODES:
        raise ValueError(f"sharding must be one of {MODES}, got {mode!r}")
    if (mode == "pipeline" and pipeline) or (mode == "tensor" and tensor):
        return
    other = ("--tensor-parallel" if tensor else None) if mode == "pipeline" else ("--pipeline" if pipeline else None)
    how = (
        "no model.model.pipeline(), and its forward is not qwen3's or llama's, which dflash2 pipelines"
        if mode == "pipeline"
        else "no model.shard()"
    )
    raise ValueError(
        f"mlx-lm {version('mlx-lm')} cannot shard {kind} models {mode}-parallel ({how}); "
        + (f"use {other} instead" if other else "it cannot shard this architecture at all")
    )


def _pipeline_load(model: str, group: mx.distributed.Group):
    """(this process's stage, tokenizer) of a target whose mlx-lm model has no pipeline: what mlx-lm's
    `sharded_load` does for a pipeline (only the files of this stage's layers fetched and read), with
    `patches.pipeline_stage` applied before `model.model.pipeline(group)`."""
    path = resolve_path(
        model,
        allow_patterns=[
            "*.json",
            "*.py",
            "tokenizer.model",
            "*.tiktoken",
            "tiktoken.model",
            "*.txt",
            "*.jsonl",
            "*.jinja",
        ],
    )

    def stage():
        lazy, config = load_model(path, lazy=True, strict=False)
        patches.pipeline_stage(lazy)
        lazy.model.pipeline(group)
        return lazy, config

    lazy, config = stage()
    start, end = lazy.model.start_idx, lazy.model.end_idx
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    files = set()
    for name, file in index.items():  # layers by number, as sharded_load matches them; the rest on every stage
        m = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if m is None or start <= int(m.group(1)) < end:
            files.add(file)
    resolve_path(model, allow_patterns=sorted(files))
    stage_model, _ = stage()  # now with this stage's weights
    mx.eval(stage_model.parameters())
    tokenizer = load_tokenizer(path, {"trust_remote_code": True}, eos_token_ids=config.get("eos_token_id", None))
    mx.eval(mx.distributed.all_sum(mx.array(1.0), stream=mx.cpu, group=group))  # as sharded_load: in step
    return stage_model, tokenizer


class ShardedCache(list):
    """One process's cache of a sharded target; `key` names it to the other processes. A copy (`copy.deepcopy`,
    as a prompt-cache slot is copied) made on rank 0 is announced: every process copies its own share."""

    key = -1
    target = None  # rank 0: the ShardedTarget that made it, which announces its copies

    def __deepcopy__(self, memo):
        other = ShardedCache(copy.deepcopy(list(self), memo))
        if self.target is not None:
            self.target._copied(self, other)
        return other


class ShardedCapture(Capture):
    """`Capture` on a sharded target: rank 0 announces each forward and rollback to the other ranks, and the
    features are the drafter's context rows [L, D] (`ShardedTarget.project`)."""

    def forward(self, tokens: mx.array, cache: list):
        return self._forward(self.target.lead(Op.FORWARD, cache, tokens), cache)

    def verify(self, tokens: mx.array, cache: list):
        return super().verify(self.target.lead(Op.VERIFY, cache, tokens), cache)

    def rollback(self, cache: list, verified, keep: int) -> None:
        if not 0 <= keep <= verified.rows:  # refused before the other ranks are told
            raise ValueError(f"cannot keep {keep} rows of a {verified.rows}-row verify pass")
        self.target.lead(Op.ROLLBACK, cache, count=keep)
        super().rollback(cache, verified, keep)

    def _trim(self, cache: list, n: int) -> None:
        Target._trim(cache, n)  # part of the rollback announced

    def _forward(self, tokens: mx.array, cache: list):
        logits = self.target.model(tokens[None], cache=cache)[0]
        features = self.target.project(self._features(), logits)
        self.target._finish_later(logits, features)
        return logits, features


class ShardedTarget(Target):
    """This process's part of a sharded target (`load`). On rank 0 it is what `stream_generate` takes as its
    model (with the drafter, bound by `load`); the other ranks `follow` it."""

    def __init__(
        self, model: nn.Module, group: mx.distributed.Group, mode: str, drafter: DFlashDraftModel | None = None
    ):
        super().__init__(model, drafter.config.target_layer_ids if drafter is not None else ())
        if mode not in MODES:
            raise ValueError(f"sharding must be one of {MODES}, got {mode!r}")
        if group.size() < 2:
            raise ValueError("a sharded target needs a group of at least two processes")
        self.group, self.mode, self.rank = group, mode, group.rank()
        self.leader = self.rank == 0
        self.tick = _nothing  # inside `watched`: marks rank 0's progress (each announcement)
        self._keys = itertools.count()
        self._freed: list[int] = []  # keys of rank 0's caches gone, for the others to drop
        self._pending: list[mx.array] = []  # rank 0: the last operation's results, finished before the next
        self._fc, self._dtype = None, None
        if drafter is not None:
            self._fc, self._dtype = self._fc_columns(drafter), drafter.norm.weight.dtype
            drafter.context_projected = True

    def _fc_columns(self, drafter: DFlashDraftModel) -> mx.array | None:
        """The columns of the drafter's `fc` this process applies: those of the tapped layers it holds
        (pipeline), or all of them on rank 0 (tensor parallel); None where it applies none."""
        fc = drafter.fc
        if isinstance(fc, nn.QuantizedLinear):
            weight = mx.dequantize(fc.weight, fc.scales, fc.get("biases"), fc.group_size, fc.bits, mode=fc.mode)
        else:
            weight = fc.weight
        weight, D = weight.astype(drafter.norm.weight.dtype), self.hidden_size
        if self.mode == "tensor":
            return weight if self.leader else None
        columns = [weight[:, j * D : (j + 1) * D] for j, i in enumerate(self.layer_ids) if self.holds(i)]
        return mx.concatenate(columns, axis=1) if columns else None

    def fingerprint(self) -> str:
        h = hashlib.sha256(f"{super().fingerprint()} {self.mode} x{self.group.size()}".encode())
        return h.hexdigest()[:12]

    # -- what rank 0 tells the others ----------------------------------------------------------------------------
    def _broadcast(self, x: mx.array) -> mx.array:
        """Rank 0's `x` on every rank (the others pass an array of its shape)."""
        return mx.distributed.all_sum(x if self.leader else mx.zeros_like(x), group=self.group)

    def lead(self, op: Op, cache: list | None, tokens: mx.array | None = None, count: int = 0) -> mx.array | None:
        """Rank 0: announce `op` on `cache` to the other ranks, with `tokens`; returns the tokens (evaluated).
        Other ranks (which read the announcement in `follow`): `tokens` as they are."""
        if not self.leader:
            return tokens
        key = -1 if cache is None else getattr(cache, "key", None)
        if key is None:
            raise RuntimeError("a sharded target runs on caches it made itself (its make_cache)")
        self.tick()
        if self._pending:  # the last operation's collectives, before this one's (the other ranks ran them)
            pending, self._pending = self._pending, []  # once: after a failed collective, never evaluated again
            mx.eval(pending)
        n = count if tokens is None else tokens.size
        ids = mx.zeros((0,), mx.int32) if tokens is None else tokens.reshape(-1).astype(mx.int32)
        inline = ids if n <= MESSAGE_IDS else ids[:0]
        message = mx.concatenate(
            [mx.array([op, key, n], mx.int32), inline, mx.zeros((MESSAGE_IDS - inline.size,), mx.int32)]
        )
        mx.eval(self._broadcast(message))
        if n > MESSAGE_IDS and tokens is not None:
            mx.eval(self._broadcast(ids))
        return tokens  # computed with the message

    def receive(self) -> tuple[int, int, int, mx.array | None]:
        """Another rank: rank 0's next announcement (op, cache key, count) and the ids it sends with it."""
        message = self._broadcast(mx.zeros((3 + MESSAGE_IDS,), mx.int32))
        op, key, n = message[:3].tolist()
        if op not in _FED:
            return op, key, n, None
        ids = message[3 : 3 + n] if n <= MESSAGE_IDS else self._broadcast(mx.zeros((n,), mx.int32))
        return op, key, n, ids.astype(mx.uint32)

    # -- the target's operations -----------------------------------------------------------------------------------
    def make_cache(self) -> ShardedCache:
        cache = ShardedCache(super().make_cache())
        if self.leader:
            self._announce_freed()
            self._name(cache)
            self.lead(Op.START, cache)
        return cache

    def _name(self, cache: ShardedCache) -> None:
        """Rank 0: give `cache` the next key; once it is gone, the other ranks are told to drop theirs."""
        cache.key, cache.target = next(self._keys), self
        weakref.finalize(cache, self._freed.append, cache.key)

    def _announce_freed(self) -> None:
        freed = []
        while self._freed:  # emptied in place: the finalizers of live caches append to this list
            freed.append(self._freed.pop())
        if freed:
            self.lead(Op.FREE, None, mx.array(freed, mx.int32))

    def _copied(self, cache: ShardedCache, other: ShardedCache) -> None:
        """Rank 0 copied `cache` into `other` (`ShardedCache.__deepcopy__`): the other ranks copy theirs."""
        self._announce_freed()
        self._name(other)
        self.lead(Op.COPY, cache, count=other.key)

    def _trim(self, cache: list, n: int) -> None:
        """`Target._trim`, announced (a prompt cache cut back to the prefix a new prompt shares)."""
        self.lead(Op.TRIM, cache, count=n)
        Target._trim(cache, n)

    def __call__(self, tokens: mx.array, cache: list) -> mx.array:
        logits = super().__call__(self.lead(Op.PLAIN, cache, tokens), cache)
        self._finish_later(logits)
        return logits

    def _finish_later(self, *results) -> None:
        """Rank 0: results of an operation to evaluate before the next one is announced at the latest."""
        if self.leader:
            self._pending += [r for r in results if r is not None]

    def _capture(self) -> Capture:
        return ShardedCapture(self)

    def project(self, features: mx.array | None, logits: mx.array) -> mx.array | None:
        """The drafter's context rows [L, D] of a forward (its `fc` of the whole concatenated features) on
        rank 0, from this process's tapped `features` [1, L, k'*D] and the forward's `logits` [L, V]. Pipeline:
        every rank's share, summed (after the forward's own exchanges, in the same order on every rank)."""
        if self._fc is None and (self.mode == "tensor" or not self.layer_ids):
            return None
        if self.mode == "tensor":
            return features[0].astype(self._dtype) @ self._fc.T
        share = (
            mx.zeros((logits.shape[0], self.hidden_size), self._dtype)
            if features is None
            else features[0].astype(self._dtype) @ self._fc.T
        )
        return mx.distributed.all_sum(mx.depends(share, logits), group=self.group)


@contextlib.contextmanager
def leading(target: ShardedTarget):
    """Rank 0's generations, inside the block; on leaving it (also on an error) the other ranks stop following."""
    if not target.leader:
        raise RuntimeError("only rank 0 leads; the other ranks follow (distributed.follow)")
    try:
        yield target
    except BaseException as e:
        # the others may be gone (the error itself may say so): a collective then fails, or never returns
        with contextlib.suppress(RuntimeError), deadline(STOP_TIMEOUT, f"dflash2: error: {e}"):
            stop(target)
        raise
    stop(target)


def stop(target: ShardedTarget) -> None:
    """Rank 0: the other ranks stop following (their `follow` returns). Call it once no operation runs."""
    if not target.leader:
        raise RuntimeError("only rank 0 stops the others; the other ranks follow (distributed.follow)")
    target.lead(Op.STOP, None)


def _nothing() -> None:
    pass


@contextlib.contextmanager
def watched(target: ShardedTarget, timeout: float | None = DEFAULT_TIMEOUT):
    """Rank 0, around generations consumed without pauses (a CLI run, a server request): if it announces no target
    operation for `timeout` seconds it is stuck in a collective with a process that died or hangs (MLX's ring
    all_gather, inside mlx-lm's pipelined forward, never returns when a peer dies), and it ends with a message
    (exit 3) instead of hanging. None: no bound."""
    if timeout is None:
        yield target
        return
    message = (
        f"dflash2: error: rank 0 of {target.group.size()} got no answer from the other processes for "
        f"{timeout:g} s while generating: one died or hangs; start them all again (--peer-timeout sets "
        "this bound)"
    )
    with progress_watch(timeout, message) as tick:
        target.tick = tick
        try:
            yield target
        finally:
            target.tick = _nothing


def follow(target: ShardedTarget) -> None:
    """The other ranks' loop: run each target operation rank 0 announces, on this process's share of the
    target, until rank 0 leaves `leading`."""
    if target.leader:
        raise RuntimeError("rank 0 leads (distributed.leading); follow() is for the other ranks")
    caches: dict[int, ShardedCache] = {}
    verified: dict = {}  # cache key -> its last verify pass
    with target.capture() as tap:
        while True:
            op, key, n, ids = target.receive()
            if op == Op.STOP:
                return
            if op == Op.START:
                caches[key] = target.make_cache()
            elif op == Op.FREE:
                for k in ids.tolist():
                    caches.pop(k, None)
                    verified.pop(k, None)
            elif op == Op.FORWARD:
                mx.eval([a for a in tap.forward(ids, caches[key]) if a is not None])
            elif op == Op.VERIFY:
                verified[key] = v = tap.verify(ids, caches[key])
                mx.eval([a for a in (v.logits, v.features) if a is not None])
            elif op == Op.PLAIN:
                mx.eval(target(ids, caches[key]))
            elif op == Op.ROLLBACK:
                tap.rollback(caches[key], verified[key], n)
            elif op == Op.TRIM:
                target._trim(caches[key], n)
            elif op == Op.COPY:  # n: the copy's key
                caches[n] = copy.deepcopy(caches[key])
            else:
                raise RuntimeError(
                    f"rank 0 asked for operation {op}, which this version does not know: run the same "
                    "version of dflash2 in every process"
                )


def load(
    model: str,
    draft_model: str | None,
    group: mx.distributed.Group,
    mode: str = "pipeline",
    dtype: str | None = None,
    draft_dtype: str | None = None,
    draft_quant=None,
    draft_vocab: int | None = None,
    draft_vocab_counts: str | None = None,
    kernels: str = "auto",
    timeout: float = CONNECT_TIMEOUT,
):
    """(this process's `ShardedTarget`, tokenizer, drafter or None), arguments as `loading.load`'s: the target
    (an mlx-lm folder or hub id) sharded `mode`-parallel over `group` by mlx-lm's `sharded_load` (qwen3 and llama
    pipelines: `_pipeline_load`), and the drafter (every process loads it whole: rank 0 runs it, every rank applies
    its share of `fc`). The processes first
    check that they load the same drafter and target config (within `timeout` seconds)."""
    if model is None or str(model).endswith(".gguf"):
        raise ValueError(
            "a sharded target is an mlx-lm model folder or hub id (mlx-lm's sharded_load); "
            f"got {model or 'none (--model)'}: convert a GGUF file with mlx_lm.convert first"
        )
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    config_path = resolve_path(model, allow_patterns=["*.json"])
    lazy, config = load_model(config_path, lazy=True, strict=False)
    check_shardable(lazy, mode)
    patched = mode == "pipeline" and not hasattr(lazy.model, "pipeline")
    del lazy
    if mode == "pipeline" and not (config_path / "model.safetensors.index.json").exists():
        raise ValueError(
            f"{model} has no model.safetensors.index.json, which mlx-lm's pipeline loading reads to "
            "find each process's layers; save the model with mlx_lm.convert (or write the index)"
        )
    drafter = None
    if draft_model is not None:
        if isinstance(draft_quant, str):
            draft_quant = DraftQuant.parse(draft_quant)
        drafter = load_drafter(draft_model, draft_dtype, draft_quant, draft_vocab, draft_vocab_counts, kernels)
    check_same(
        group,
        {
            "drafter": drafter_checksum(drafter) if drafter is not None else "no drafter",
            "target config": json.dumps(config, sort_keys=True),
            "sharding": f"{mode} {dtype}",
        },
        timeout,
    )
    if patched:
        target_model, tokenizer = _pipeline_load(model, group)
    else:
        target_model, tokenizer = sharded_load(
            model,
            pipeline_group=group if mode == "pipeline" else None,
            tensor_group=group if mode == "tensor" else None,
        )
    if dtype is not None:
        target_model.set_dtype(getattr(mx, dtype))
    if drafter is not None:
        bind_drafter(drafter, target_model)
    return ShardedTarget(target_model, group, mode, drafter), tokenizer, drafter
