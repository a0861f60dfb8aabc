"""The DFlash drafter: a few Qwen3-style layers that denoise a block of mask tokens in one pass.

It has no embedding table or LM head of its own; `bind` lends it the target's. The target's features
(outputs of the layers in `target_layer_ids`) are fused by `fc` + `hidden_norm` into one context row per
committed token, and every layer attends to that context through its own k/v projections ("KV injection")
in front of the block's keys and values. Only context K/V are cached: the block is recomputed every cycle.

DFlash 2 (`DFlash2DraftModel`, with `DFlash2DecoderLayer`s) is the same model with two additions: a dynamic
short convolution around every attention and MLP sublayer (`short_conv.py`), and a path selector that picks
the drafts from the top-k candidates of each row (`selector.py`). `DFlashDraftModel.from_config` builds the
class a config names.
"""

from __future__ import annotations

from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from mlx_lm.models.rope_utils import initialize_rope

from . import kernel_check
from .formats.config import DraftConfig
from .sampling import Proposal, SamplingParams, probabilities
from .selector import WALKS, CandidateSelector, Lattice, lattice_of, scored_path, walk_greedy_blocks, walk_sampled
from .short_conv import DynamicShortConv


class TrainingBlocks(NamedTuple):
    """Where the blocks of a training batch sit: anchors [S, A] int, block s*A + a is drafted from position
    anchors[s, a] of sequence s."""

    anchors: mx.array


class Attention(nn.Module):
    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__()
        dim, head_dim = config.hidden_size, config.head_dim
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim, self.scale = head_dim, head_dim**-0.5
        self.is_causal = config.layer_is_causal(layer_idx)
        sliding = config.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None
        self.q_proj = nn.Linear(dim, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, dim, bias=False)
        self.q_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.rope = initialize_rope(
            head_dim,
            base=config.rope_theta,
            traditional=False,
            scaling_config=config.rope_scaling,
            max_position_embeddings=config.max_position_embeddings,
        )

    def _heads(self, x: mx.array, n: int) -> mx.array:
        B, L, _ = x.shape
        return x.reshape(B, L, n, -1).transpose(0, 2, 1, 3)

    def __call__(
        self, x: mx.array, ctx, cache: KVCache | list[KVCache] | None, training: TrainingBlocks | None = None
    ) -> mx.array:
        """x: block rows [N, B, D]. Decoding (`cache`): ctx holds the context rows committed since the last
        call ([1, S, D]); they join the cache and the block starts right after them. Decoding N requests' blocks
        at once: ctx and cache are lists, request n's context rows and cache. Training (`training`): ctx holds
        whole sequences ([S, L, D]) and the blocks sit as `training` says."""
        N, L, _ = x.shape
        if training is not None:
            return self._training_blocks(x, ctx, training.anchors)
        if isinstance(cache, list):
            return self._decode_batch(x, ctx, cache)
        ctx_k, ctx_v, block_pos = self._context(ctx, cache)
        q, k, v = self._block_qkv(x, block_pos)
        keys = mx.concatenate([ctx_k, k], axis=2)
        values = mx.concatenate([ctx_v, v], axis=2)
        ctx_pos = block_pos - ctx_k.shape[2] + mx.arange(ctx_k.shape[2])
        mask = None
        if self.is_causal or self.sliding_window is not None:
            rows = mx.arange(L)[:, None]
            ctx_visible = mx.broadcast_to(self._context_visible(ctx_pos, block_pos, rows), (L, ctx_pos.size))
            mask = mx.concatenate([ctx_visible, self._block_visible(L, rows)], axis=-1)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, L, -1))

    def _decode_batch(self, x: mx.array, ctxs: list[mx.array], caches: list[KVCache]) -> mx.array:
        """N requests' blocks [N, B, D] in one pass: each block attends to its own request's context (the
        contexts, of different lengths, left-padded and masked) and to itself, at its own positions."""
        N, L, _ = x.shape
        parts = [self._context(ctx, cache) for ctx, cache in zip(ctxs, caches)]
        q, k, v = self._block_qkv(x, mx.array([block_pos for _, _, block_pos in parts]))
        P, rows = max(ctx_k.shape[2] for ctx_k, _, _ in parts), mx.arange(L)[:, None]
        ctx_keys, ctx_values, masks = [], [], []
        for ctx_k, ctx_v, block_pos in parts:
            n = ctx_k.shape[2]
            pad = [(0, 0), (0, 0), (P - n, 0), (0, 0)]
            ctx_keys.append(mx.pad(ctx_k, pad))
            ctx_values.append(mx.pad(ctx_v, pad))
            visible = self._context_visible(block_pos - n + mx.arange(n), block_pos, rows)
            masks.append(mx.concatenate([mx.zeros((L, P - n), mx.bool_), mx.broadcast_to(visible, (L, n))], -1))
        mask = mx.concatenate(
            [mx.stack(masks)[:, None], mx.broadcast_to(self._block_visible(L, rows), (N, 1, L, L))], axis=-1
        )
        keys = mx.concatenate([mx.concatenate(ctx_keys), k], axis=2)
        values = mx.concatenate([mx.concatenate(ctx_values), v], axis=2)
        out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(N, L, -1))

    def _context(self, ctx: mx.array, cache: KVCache) -> tuple[mx.array, mx.array, int]:
        """A request's context keys and values [1, Hkv, P, d] (its new rows `ctx` [1, S, D] put into its
        `cache` first), and the position of its block's anchor."""
        start = cache.offset  # position of the first new context row
        block_pos = start + ctx.shape[1]  # position of the anchor
        if ctx.shape[1] > 0:
            ctx_k = self.rope(self.k_norm(self._heads(self.k_proj(ctx), self.n_kv_heads)), offset=start)
            ctx_v = self._heads(self.v_proj(ctx), self.n_kv_heads)
            ctx_k, ctx_v = cache.update_and_fetch(ctx_k, ctx_v)
        elif cache.keys is not None:  # no new rows: the cached ones (the buffer may run past them)
            ctx_k, ctx_v = cache.keys[:, :, :start], cache.values[:, :, :start]
        else:
            ctx_k = ctx_v = mx.zeros((1, self.n_kv_heads, 0, self.head_dim), ctx.dtype)
        if self.sliding_window is not None:
            # Row j of the block (position P+j) sees context key k iff P+j-k < window: at most the last
            # window-1 context rows matter, so older ones never enter the attention.
            keep = self.sliding_window - 1
            ctx_k, ctx_v = ctx_k[:, :, -keep:], ctx_v[:, :, -keep:]
        return ctx_k, ctx_v, block_pos

    def _block_qkv(self, x: mx.array, block_pos) -> tuple[mx.array, mx.array, mx.array]:
        q = self.rope(self.q_norm(self._heads(self.q_proj(x), self.n_heads)), offset=block_pos)
        k = self.rope(self.k_norm(self._heads(self.k_proj(x), self.n_kv_heads)), offset=block_pos)
        return q, k, self._heads(self.v_proj(x), self.n_kv_heads)

    def _context_visible(self, ctx_pos: mx.array, anchor, rows: mx.array) -> mx.array:
        """Context rows before the anchor (within the window for sliding layers)."""
        visible = ctx_pos < anchor
        if self.sliding_window is not None:
            visible = visible & (anchor + rows - ctx_pos < self.sliding_window)
        return visible

    def _block_visible(self, L: int, rows: mx.array) -> mx.array:
        """The whole block, or its prefix when causal."""
        return mx.arange(L)[None, :] <= rows if self.is_causal else mx.ones((L, L), dtype=mx.bool_)

    def _training_blocks(self, x: mx.array, ctx: mx.array, anchors: mx.array) -> mx.array:
        """All A blocks of a sequence at once, each block row seeing the context before its anchor and its own
        block only. One softmax over two score sets: every block's rows against its sequence's context rows
        (the context K/V computed once per sequence, never copied per block) and each block against itself.
        Scoring the blocks against each other and masking (A*L x A*L per sequence) would make a step's cost
        grow with the square of the anchors."""
        S, A = anchors.shape
        N, L, _ = x.shape
        kv, rep, hd = self.n_kv_heads, self.n_heads // self.n_kv_heads, self.head_dim
        q, k, v = self._block_qkv(x, anchors.reshape(N))  # [N, heads, L, hd], [N, kv, L, hd] x 2
        q = q.reshape(N, kv, rep, L, hd) * self.scale  # query head h reads key head h // rep
        ctx_k = self.rope(self.k_norm(self._heads(self.k_proj(ctx), kv)))[:, :, None]  # [S, kv, 1, C, hd]
        ctx_v = self._heads(self.v_proj(ctx), kv)[:, :, None]

        def per_seq(t):  # [N, ..., L, d] -> [S, ..., A*L, d]
            return (
                t.reshape(S, A, *t.shape[1:-2], -1, t.shape[-1])
                .moveaxis(1, 3)
                .reshape(S, *t.shape[1:-2], A * L, t.shape[-1])
            )

        def per_block(t):  # the inverse
            return (
                t.reshape(S, *t.shape[1:-2], A, L, t.shape[-1])
                .moveaxis(3, 1)
                .reshape(N, *t.shape[1:-2], L, t.shape[-1])
            )

        rows = mx.tile(mx.arange(L), A)[:, None]  # row within its block, for each of the A*L query rows
        anchor = mx.repeat(anchors, L, axis=1)[:, None, None, :, None]  # [S, 1, 1, A*L, 1]
        ctx_scores = per_seq(q) @ ctx_k.swapaxes(-1, -2)  # [S, kv, rep, A*L, C]
        ctx_scores = mx.where(self._context_visible(mx.arange(ctx.shape[1]), anchor, rows), ctx_scores, -mx.inf)
        own_scores = q @ k[:, :, None].swapaxes(-1, -2)  # [N, kv, rep, L, L]
        own_scores = mx.where(self._block_visible(L, mx.arange(L)[:, None]), own_scores, -mx.inf)
        probs = mx.softmax(mx.concatenate([ctx_scores, per_seq(own_scores)], axis=-1), axis=-1, precise=True)
        C = ctx.shape[1]
        out = per_block(probs[..., :C] @ ctx_v) + per_block(probs[..., C:]) @ v[:, :, None]  # [N, kv, rep, L, hd]
        return self.o_proj(out.reshape(N, self.n_heads, L, hd).transpose(0, 2, 1, 3).reshape(N, L, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """A DFlash v1 layer: attention with KV injection, then an MLP, each pre-normed with a residual."""

    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__()
        dim = config.hidden_size
        self.self_attn = Attention(config, layer_idx)
        self.mlp = MLP(dim, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(dim, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps=config.rms_norm_eps)
        self.metal = False  # the conv kernel on (`DFlashDraftModel.use_kernels`)

    def convs(self) -> list[DynamicShortConv]:
        """The layer's short convolutions (DFlash 2), whose kernel setting follows the drafter's."""
        return []

    def __call__(self, x: mx.array, ctx: mx.array, cache: KVCache | None, training=None) -> mx.array:
        # Decoding on the pure-MLX ops runs the two halves around the attention compiled (the conv's elementwise
        # ops fused, one trace per block size): ~1 ms of a 15 ms drafter pass on a CPU. Training keeps them as
        # they are, and with Metal kernels the conv is one kernel already.
        compiled = training is None and cache is not None and not self.metal
        before, after = self._compiled() if compiled else (self._attention_input, self._attention_output)
        attention_input, taps = before(x)
        return after(x, self.self_attn(attention_input, ctx, cache, training), taps)

    def _attention_input(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(the attention's input, the attention conv's taps: empty without a conv) of the layer input x."""
        xn = self.input_layernorm(x)
        return xn, xn[..., :0]

    def _attention_output(self, x: mx.array, attended: mx.array, taps: mx.array) -> mx.array:
        """The layer output from its input x and the attention's output."""
        h = x + attended
        return h + self.mlp(self.post_attention_layernorm(h))

    def _compiled(self):
        """The two halves compiled, reading the layer's current weights at each call."""
        if "_compiled_halves" not in self.__dict__:
            self.__dict__["_compiled_halves"] = (
                mx.compile(self._attention_input, inputs=self.state),
                mx.compile(self._attention_output, inputs=self.state),
            )
        return self.__dict__["_compiled_halves"]


class DFlash2DecoderLayer(DecoderLayer):
    """A DFlash 2 layer: each sublayer's input and output pass through a dynamic short convolution whose two
    taps per channel group come from the sublayer's normed input."""

    def __init__(self, config: DraftConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        dim = config.hidden_size
        self.attention_conv = DynamicShortConv(dim, config.conv_kernel_size, config.conv_group_size)
        self.mlp_conv = DynamicShortConv(dim, config.conv_kernel_size, config.conv_group_size)

    def convs(self) -> list[DynamicShortConv]:
        return [self.attention_conv, self.mlp_conv]

    def _attention_input(self, x: mx.array) -> tuple[mx.array, mx.array]:
        xn = self.input_layernorm(x)
        taps = self.attention_conv.coefficients(xn)
        return self.attention_conv(xn, 0, taps), taps

    def _attention_output(self, x: mx.array, attended: mx.array, taps: mx.array) -> mx.array:
        h = x + self.attention_conv(attended, 1, taps)
        hn = self.post_attention_layernorm(h)
        taps = self.mlp_conv.coefficients(hn)  # both halves from the normed input
        return h + self.mlp_conv(self.mlp(self.mlp_conv(hn, 0, taps)), 1, taps)


class _TargetParts:
    """The target's embedding and LM head, held outside the module tree so they are never saved,
    trained or quantized as part of the drafter; with the logit settings in force (see `bind`)."""

    def __init__(
        self,
        embed,
        lm_head,
        embed_scale: float,
        multiplier: float,
        softcap: float | None,
        vocab_ids: mx.array | None = None,
        vocab_rows: mx.array | None = None,
    ):
        self.embed, self.lm_head, self.embed_scale = embed, lm_head, embed_scale
        self.multiplier, self.softcap = multiplier, softcap
        self.vocab_ids, self.vocab_rows = vocab_ids, vocab_rows  # the draft vocabulary and its LM-head rows


class DFlashDraftModel(nn.Module):
    """The DFlash (v1) drafter: it drafts each row's most likely token (or samples each row)."""

    kind = "v1"
    walks: tuple[str, ...] = ("greedy",)  # how it may pick a block's path (DFlash 2 adds the selector's walks)
    default_block_cap: int | None = None  # the runtime block size when none is asked for: the trained one
    layer_class = DecoderLayer

    @staticmethod
    def from_config(config: DraftConfig) -> DFlashDraftModel:
        """The drafter class the config describes (DFlash 2 or v1), built with fresh weights."""
        return (DFlash2DraftModel if config.is_dflash2 else DFlashDraftModel)(config)

    def __init__(self, config: DraftConfig):
        super().__init__()
        self.config = config
        dim = config.hidden_size
        self.fc = nn.Linear(len(config.target_layer_ids) * dim, dim, bias=False)
        self.hidden_norm = nn.RMSNorm(dim, eps=config.rms_norm_eps)
        self.layers = [self.layer_class(config, i) for i in range(config.num_hidden_layers)]
        self.norm = nn.RMSNorm(dim, eps=config.rms_norm_eps)
        self._target: _TargetParts | None = None
        self.draft_vocab = None  # token ids [n] (numpy) the drafter may propose; None: the whole vocabulary
        # its card's held-out P(draft i accepted | drafts before it accepted) (numpy), adaptive mode's prior
        self.acceptance_prior = None
        # True when the context it is given has been through `fc` already: a target sharded over several
        # processes sums each process's share of `fc` over the layers it holds (`distributed.py`)
        self.context_projected = False
        self.use_kernels("auto")

    def use_kernels(self, choice: str = "auto") -> DFlashDraftModel:
        """Run the hot ops of the DFlash 2 cycle (the short convolution, the path selector, greedy acceptance)
        as fused Metal kernels or as pure MLX, with the same results: 'auto' (where Metal is available, the
        kernels that pass their one-time self-check, `kernel_check`), 'metal' (every kernel, or an error without
        Metal) or 'mlx'. `self.metal_kernels` names the kernels on; `self.metal` says whether any is."""
        self.metal_kernels = kernel_check.enabled(choice)
        self.metal = bool(self.metal_kernels)
        conv_kernel = "dynamic_conv" in self.metal_kernels
        for layer in self.layers:
            layer.metal = conv_kernel
            for conv in layer.convs():
                conv.metal = conv_kernel
        return self

    def bind(
        self,
        embed,
        lm_head,
        embed_scale: float = 1.0,
        output_multiplier: float = 1.0,
        final_logit_softcapping: float | None = None,
        draft_vocab: tuple[mx.array, mx.array] | None = None,
    ) -> DFlashDraftModel:
        """Use the target's embedding and LM head (both stay frozen and owned by the target). `embed_scale`,
        `output_multiplier` and `final_logit_softcapping` are the target's own (see `target.output_head`):
        the block's embeddings are scaled as the target scales its own (times the config's
        `input_embedding_scale`), and a logit setting the drafter's config leaves unset is the target's.
        `draft_vocab`: (token ids [n], their LM-head rows [n, D]) when drafts come from a draft vocabulary."""
        cfg = self.config
        multiplier = cfg.output_multiplier if cfg.output_multiplier is not None else output_multiplier
        softcap = cfg.final_logit_softcapping if cfg.final_logit_softcapping is not None else final_logit_softcapping
        self._target = _TargetParts(
            embed,
            lm_head,
            embed_scale * cfg.input_embedding_scale,
            float(multiplier),
            softcap or None,
            *(draft_vocab or (None, None)),
        )
        return self

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]

    def hidden(
        self, block: mx.array, context: mx.array, cache: list[KVCache] | None, training: TrainingBlocks | None = None
    ) -> mx.array:
        """Normed final hidden rows of the block.

        block: [1, B] token ids (anchor, then mask ids); context: [1, S, k*D] target features of the
        committed rows not yet seen by `cache` (appended to it here; [1, S, D] when `context_projected`). For
        training, block is [N, B], context the features of whole sequences [S, L, k*D], and `training` says
        where each block sits.
        """
        if self._target is None:
            raise RuntimeError("drafter is not bound to a target: call bind() (load() does it)")
        dtype = self.norm.weight.dtype  # the drafter's compute dtype, whatever the target's
        h = (self._target.embed(block) * self._target.embed_scale).astype(dtype)
        context = context.astype(dtype)
        ctx = self.hidden_norm(context if self.context_projected else self.fc(context))
        for layer, c in zip(self.layers, cache or [None] * len(self.layers)):
            h = layer(h, ctx, c, training)
        return self.norm(h)

    def hidden_batch(self, blocks: mx.array, contexts: list[mx.array], caches: list[list[KVCache]]) -> mx.array:
        """`hidden` of N requests' blocks in one pass: blocks [N, B]; contexts[n] and caches[n] request n's, as
        `hidden` takes them (contexts of any lengths). Each layer's weights are read once for all N."""
        if self._target is None:
            raise RuntimeError("drafter is not bound to a target: call bind() (load() does it)")
        dtype = self.norm.weight.dtype
        h = (self._target.embed(blocks) * self._target.embed_scale).astype(dtype)
        ctxs = [
            self.hidden_norm(c.astype(dtype) if self.context_projected else self.fc(c.astype(dtype))) for c in contexts
        ]
        for i, layer in enumerate(self.layers):
            h = layer(h, ctxs, [cache[i] for cache in caches])
        return self.norm(h)

    def logits(self, hidden: mx.array, head_rows: mx.array | None = None) -> mx.array:
        """Draft logits over the whole vocabulary, or over the tokens whose LM-head rows are `head_rows`
        [n, D] (training's reduced vocabulary)."""
        head = self._target.lm_head(hidden) if head_rows is None else hidden @ head_rows.T
        logits = head * self._target.multiplier
        cap = self._target.softcap
        if cap:
            logits = mx.tanh(logits / cap) * cap
        return logits

    def input_block(self, anchor: mx.array | int, B: int) -> mx.array:
        """The block a pass drafts from [1, B]: the anchor (the last committed token), then B-1 mask tokens."""
        anchor = mx.array(anchor) if isinstance(anchor, int) else anchor
        return mx.concatenate([anchor.reshape(1), mx.full((B - 1,), self.config.mask_token_id, anchor.dtype)])[None]

    def draft_rows(self, block: mx.array, context: mx.array, cache: list[KVCache]) -> tuple[mx.array, mx.array]:
        """(normed hidden [B-1, D], logits [B-1, V]) of the draft rows 1..B-1 of `block` [1, B]; with a draft
        vocabulary, logits [B-1, n] over its n tokens (`draft_ids` maps their indices to token ids)."""
        hidden = self.hidden(block, context, cache)[0, 1:]
        return hidden, self.draft_logits(hidden)

    def draft_logits(self, hidden: mx.array) -> mx.array:
        """Logits of `hidden` over what the drafter may propose: its draft vocabulary, else every token."""
        return self.logits(hidden, self._target.vocab_rows)

    def draft_ids(self, indices: mx.array) -> mx.array:
        """Token ids of indices into `draft_rows`' logits (themselves without a draft vocabulary)."""
        return indices if self._target.vocab_ids is None else self._target.vocab_ids[indices]

    def __call__(self, block: mx.array, context: mx.array, cache: list[KVCache]) -> mx.array:
        """Draft logits for rows 1..B-1 of the block: [1, B-1, V]."""
        return self.draft_rows(block, context, cache)[1][None]

    def check_walk(self, walk: str) -> None:
        if walk not in WALKS:
            raise ValueError(f"unknown path walk {walk!r}; choose one of {WALKS}")
        if walk not in self.walks:
            raise ValueError(f"the {walk!r} walk needs a DFlash 2 drafter (v1 drafters have no path selector)")

    def propose(
        self,
        block: mx.array,
        context: mx.array,
        cache: list[KVCache],
        params: SamplingParams,
        walk: str = "greedy",
    ) -> Proposal:
        """Draft tokens for rows 1..B-1 of `block` [1, B] (see `hidden` for the other arguments), with each
        row's confidence (`Proposal.confidence`)."""
        self.check_walk(walk)
        hidden, logits = self.draft_rows(block, context, cache)
        confidence = mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1)).astype(mx.float32)
        return self.choose(hidden, logits, block[0, 0], params, walk)._replace(confidence=confidence)

    def propose_batch(
        self,
        blocks: mx.array,
        contexts: list[mx.array],
        caches: list[list[KVCache]],
        params: list[SamplingParams],
        walk: str = "greedy",
    ) -> list[Proposal]:
        """`propose` for N requests' blocks [N, B] in one drafter pass (`hidden_batch`), each block's drafts
        chosen with its request's sampling settings `params[n]`."""
        self.check_walk(walk)
        hidden = self.hidden_batch(blocks, contexts, caches)[:, 1:]
        logits = self.draft_logits(hidden)
        confidence = mx.exp(mx.max(logits, axis=-1) - mx.logsumexp(logits, axis=-1)).astype(mx.float32)
        return [
            self.choose(hidden[n], logits[n], blocks[n, 0], p, walk)._replace(confidence=confidence[n])
            for n, p in enumerate(params)
        ]

    def choose(
        self, hidden: mx.array, logits: mx.array, anchor: mx.array, params: SamplingParams, walk: str = "greedy"
    ) -> Proposal:
        """The drafts of one block from its rows' hidden [B-1, D] and logits [B-1, V] (over the draft
        vocabulary, if any: `draft_logits`): argmax or samples (v1), or a walk over the path selector's lattice
        (DFlash 2)."""
        finite = mx.all(mx.isfinite(logits))
        if params.greedy:
            return Proposal(self.draft_ids(mx.argmax(logits, axis=-1)), None, None, finite)
        q = probabilities(logits, params)  # dense: its candidates are every token it may draft
        candidates = mx.broadcast_to(self.draft_ids(mx.arange(q.shape[-1])), q.shape)
        return Proposal(self.draft_ids(mx.random.categorical(mx.log(q))), candidates, q, finite)

    def greedy_drafts(self, hidden: mx.array, logits: mx.array, anchors: mx.array) -> mx.array:
        """The T = 0 greedy drafts [N, B-1] of N blocks at once, from their rows' hidden [N, B-1, D], logits
        [N, B-1, V] (as for `choose`) and anchors [N]: what `choose` with the greedy walk drafts block by
        block, in one MLX walk over all of them (the held-out evaluation's hundreds of blocks)."""
        return self.draft_ids(mx.argmax(logits, axis=-1))

    def tree_lattice(self, hidden: mx.array, logits: mx.array, anchor: mx.array, v1_top_k: int) -> Lattice:
        """What a token tree is built from (`tree.py`), arguments as for `choose`: DFlash 2's selector lattice;
        for v1 drafters each row's top `v1_top_k` draft logits, the same whatever the predecessor."""
        k = min(v1_top_k, logits.shape[-1])
        top = mx.argpartition(-logits, k - 1, axis=-1)[:, :k]
        unary = mx.take_along_axis(logits, top, axis=-1).astype(mx.float32)
        return Lattice(self.draft_ids(top), mx.broadcast_to(unary[:, None, :], (top.shape[0], k, k)))


class DFlash2DraftModel(DFlashDraftModel):
    """The DFlash 2 drafter: short convolutions in every layer and a path selector that scores pairs of
    consecutive candidates, walked greedily, by sampling or by the target's rejection rule."""

    kind = "dflash2"
    walks = WALKS
    default_block_cap = 5  # min(5, trained), as oMLX's MLX engine runs DFlash 2
    layer_class = DFlash2DecoderLayer

    def __init__(self, config: DraftConfig):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(
            config.hidden_size,
            config.selector_rank,
            config.selector_top_k,
            config.vocab_size,
            config.selector_factorized,
        )

    def _lattice_inputs(self, hidden: mx.array, logits: mx.array, anchor: mx.array):
        return self.candidate_selector.lattice_inputs(
            hidden, logits, anchor, self._target.embed, self._target.vocab_ids
        )

    def choose(
        self, hidden: mx.array, logits: mx.array, anchor: mx.array, params: SamplingParams, walk: str = "greedy"
    ) -> Proposal:
        finite = mx.all(mx.isfinite(logits))
        inputs = self._lattice_inputs(hidden, logits, anchor)
        if params.greedy:
            idx, q = scored_path(inputs, walk, "lattice_path" in self.metal_kernels)[1], None
        else:
            idx, q = walk_sampled(lattice_of(inputs), params)
        tokens = mx.take_along_axis(inputs.candidates, idx[:, None], axis=-1)[:, 0]
        return Proposal(tokens, None if q is None else inputs.candidates, q, finite)

    def greedy_drafts(self, hidden: mx.array, logits: mx.array, anchors: mx.array) -> mx.array:
        inputs = self._lattice_inputs(hidden, logits, anchors)
        idx = walk_greedy_blocks(lattice_of(inputs).scores)
        return mx.take_along_axis(inputs.candidates, idx[..., None], axis=-1)[..., 0]

    def tree_lattice(self, hidden: mx.array, logits: mx.array, anchor: mx.array, v1_top_k: int) -> Lattice:
        return lattice_of(self._lattice_inputs(hidden, logits, anchor))
