"""A target's responses (greedy, or sampled for the prompts it writes) and its features, computed by PyTorch for
`dflash2 data` and `dflash2 train` on x86-64 CPUs, where it outruns MLX: in bfloat16 where the CPU multiplies it in
hardware (avx512_bf16 or AMX), else float32.

The weights come from the loaded mlx-lm model, so the file formats stay MLX's. Matmuls run in the engine's dtype
with float32 accumulation; the residual stream, norms, RoPE and attention scores stay float32. Continuous batching
over fixed slots with a preallocated key/value cache: a finished response's slot takes the next prompt at once.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
from mlx.utils import tree_flatten

ARCHITECTURES = ("llama", "qwen2")


def cpu_has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware (x86 avx512_bf16 or AMX; Linux only).

    Args:
        cpuinfo (str, optional): the text of /proc/cpuinfo; read from the machine when None.
    """
    if cpuinfo is None:
        path = Path("/proc/cpuinfo")
        if not path.exists():
            return False
        cpuinfo = path.read_text()
    return re.search(r"\b(avx512_bf16|amx_bf16)\b", cpuinfo) is not None


def machine_dtype() -> str:
    """The engine's dtype on this machine: bfloat16 where the CPU multiplies it in hardware, else float32 (without
    avx512_bf16 or AMX, PyTorch multiplies bfloat16 matrices ~100x slower than float32: 1.1 against 136 GFLOPS on a
    2-core AVX2 EPYC)."""
    return "bfloat16" if cpu_has_fast_bf16() else "float32"


def openblas_loaded(maps: str | None = None) -> bool:
    """Whether OpenBLAS is loaded into this process (Linux: `dflash2` preloads it for MLX's float32 matmuls).

    Args:
        maps (str, optional): the text of /proc/self/maps; read from the process when None.
    """
    if maps is None:
        path = Path("/proc/self/maps")
        if not path.exists():
            return False
        maps = path.read_text()
    return "libopenblas" in maps


def _import_torch():
    """PyTorch, its OpenMP threads told to sleep rather than spin while they wait for each other.

    Spinning threads on a machine with more runnable processes than cores made a decode step 40 s instead of 0.8 s.
    """
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    return torch


def torch_available() -> bool:
    """Whether PyTorch can be imported."""
    try:
        _import_torch()
    except ImportError:
        return False
    return True


def supported(model) -> bool:
    """Whether `TorchTarget` runs this mlx-lm model: llama or qwen2, full attention, plain RoPE, not quantized."""
    args = getattr(model, "args", None)
    quantized = any(name.endswith(".scales") for name, _ in tree_flatten(model.parameters()))
    return (
        getattr(args, "model_type", None) in ARCHITECTURES
        and not quantized
        and not getattr(args, "rope_scaling", None)
        and not getattr(args, "sliding_window", None)
        and all(t == "full_attention" for t in getattr(args, "layer_types", None) or [])
    )


class TorchTarget:
    """A llama-family mlx-lm model's weights in PyTorch, with a slotted key/value cache.

    Args:
        model: the loaded mlx-lm model (`llama` or `qwen2`, full attention).
        slots (int): responses decoded at once.
        max_len (int): prompt plus response tokens a slot holds.
        dtype (str, optional): the matmuls' weights and inputs and the key/value cache: "bfloat16" (as the target
            runs in bfloat16 on a Mac) or "float32" (MLX's CPU dtype); `machine_dtype()` when None.

    In float32 with OpenBLAS loaded, PyTorch runs on one thread: OpenBLAS's sgemm_ takes the place of the MKL one
    PyTorch calls and spreads each matmul over its own threads, with which PyTorch's would contend for the cores
    (the features of 4 x 448 tokens on a 2-core EPYC: 94 tokens/s on two PyTorch threads, 600 on one).
    """

    def __init__(self, model, slots: int, max_len: int, dtype: str | None = None):
        import mlx.core as mx
        from mlx.utils import tree_flatten

        torch = _import_torch()

        args = model.args
        if not supported(model):
            raise ValueError(
                f"the torch engine runs {', '.join(ARCHITECTURES)} targets with full attention and no RoPE scaling, "
                f"not this {args.model_type!r} target: use --engine mlx"
            )
        self.torch = torch
        dtype = dtype or machine_dtype()
        if dtype == "float32" and openblas_loaded():
            torch.set_num_threads(1)
        w = {k: torch.from_numpy(np.array(v.astype(mx.float32))) for k, v in tree_flatten(model.parameters())}
        bf = getattr(torch, dtype)
        self.heads, self.kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = getattr(args, "head_dim", None) or args.hidden_size // self.heads
        self.eps = args.rms_norm_eps
        self.embed = w["model.embed_tokens.weight"]
        self.head = w.get("lm_head.weight", self.embed).to(bf)
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(args.num_hidden_layers):
            p = f"model.layers.{i}."
            qkv = torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).to(bf)
            bias = (
                torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"])
                if p + "self_attn.q_proj.bias" in w
                else None
            )
            gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).to(bf)
            self.layers.append(
                (
                    w[p + "input_layernorm.weight"],
                    qkv,
                    bias,
                    w[p + "self_attn.o_proj.weight"].to(bf),
                    w[p + "post_attention_layernorm.weight"],
                    gate_up,
                    w[p + "mlp.down_proj.weight"].to(bf),
                )
            )
        half = self.head_dim // 2
        self.inv_freq = 1.0 / (args.rope_theta ** (torch.arange(0, half, dtype=torch.float32) / half))
        shape = (len(self.layers), slots, self.kv_heads, max_len, self.head_dim)
        self.keys = torch.zeros(shape, dtype=bf)
        self.values = torch.zeros(shape, dtype=bf)

    def _rms(self, x, weight):
        return x * self.torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * weight

    def _rope(self, x, positions):
        """x: [N, heads, S, d]; positions: [N, S]."""
        angles = positions[:, None, :, None].float() * self.inv_freq
        cos, sin = angles.cos(), angles.sin()
        a, b = x[..., : self.head_dim // 2], x[..., self.head_dim // 2 :]
        return self.torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    def _attend(self, q, keys, values, mask):
        """Grouped-query attention in the keys' dtype, float32 out: q [N, H, S, d], keys/values [N, Hkv, L, d],
        mask [N, 1, S, L] (True: seen)."""
        F = self.torch.nn.functional
        return F.scaled_dot_product_attention(q.to(keys.dtype), keys, values, attn_mask=mask, enable_gqa=True).float()

    def _layer(self, i: int, x, positions, context):
        """Decoder layer `i` on x [N, S, D] at `positions` [N, S]; `context(i, k, v)` gives the keys, values and
        mask [N, 1, S, L] the queries attend to, given the rows' own keys and values [N, Hkv, S, d]."""
        F = self.torch.nn.functional
        ln1, qkv_w, qkv_b, o_w, ln2, gate_up_w, down_w = self.layers[i]
        n, s, _ = x.shape
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        h = F.linear(self._rms(x, ln1).to(qkv_w.dtype), qkv_w).float()
        if qkv_b is not None:
            h = h + qkv_b
        q = h[..., :q_size].view(n, s, self.heads, self.head_dim).transpose(1, 2)
        k = h[..., q_size : q_size + kv_size].view(n, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = h[..., q_size + kv_size :].view(n, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = self._rope(q, positions), self._rope(k, positions)
        a = self._attend(q, *context(i, k, v))
        x = x + F.linear(a.transpose(1, 2).reshape(n, s, q_size).to(o_w.dtype), o_w).float()
        gate, up = F.linear(self._rms(x, ln2).to(gate_up_w.dtype), gate_up_w).float().chunk(2, -1)
        return x + F.linear((F.silu(gate) * up).to(down_w.dtype), down_w).float()

    def forward(self, tokens, positions, slots, length: int):
        """Next-token logits after `tokens`, writing their keys and values into the cache.

        Args:
            tokens: [N, S] token ids, row n for cache slot `slots[n]` at positions `positions[n]`.
            positions: [N, S] their positions (contiguous per row).
            slots: [N] cache slots.
            length (int): attention reads cache positions [0, length) (masked per row beyond its position).
        Returns: [N, vocab] float32 logits at each row's last token.
        """
        torch, F = self.torch, self.torch.nn.functional
        n, s = tokens.shape
        mask = torch.arange(length)[None, None, None, :] <= positions[:, None, :, None]
        rows = slots[:, None].expand(n, s)
        leading = bool((slots == torch.arange(n)).all())  # the first n slots: read the cache as a view

        def cached(i, k, v):
            self.keys[i][rows, :, positions] = k.transpose(1, 2).to(self.keys.dtype)
            self.values[i][rows, :, positions] = v.transpose(1, 2).to(self.values.dtype)
            if leading:
                return self.keys[i][:n, :, :length], self.values[i][:n, :, :length], mask
            return self.keys[i][slots, :, :length], self.values[i][slots, :, :length], mask

        x = self.embed[tokens]
        for i in range(len(self.layers)):
            x = self._layer(i, x, positions, cached)
        last = self._rms(x[:, -1], self.norm).to(self.head.dtype)
        return F.linear(last, self.head).float()

    def sequences(self, tokens: np.ndarray, layer_ids, top_k: int = 0):
        """What training learns from whole right-padded sequences, as `Target.teacher` computes it.

        Args:
            tokens: [S, L] token ids.
            layer_ids: the layers whose outputs are the features, in the drafter's order (the last layer's
                after the final norm, as Hugging Face's hidden states).
            top_k (int): next-token candidates per row (0: none, and the output head is not run).
        Returns: features [S, L, k*D] float32, and the ids [S, L, top_k] int32 and log-probabilities float32 of
        the target's top_k next tokens (descending).
        """
        torch, F = self.torch, self.torch.nn.functional
        torch.set_grad_enabled(False)
        tokens = torch.from_numpy(np.asarray(tokens, np.int64))
        s, length = tokens.shape
        positions = torch.arange(length)[None].expand(s, length)
        causal = (torch.arange(length)[None, :] <= torch.arange(length)[:, None])[None, None]
        last = len(self.layers) - 1
        needed = last if top_k else max(layer_ids)
        outputs, x = {}, self.embed[tokens]
        for i in range(needed + 1):
            x = self._layer(i, x, positions, lambda i, k, v: (k, v, causal))
            if i in layer_ids:
                outputs[i] = self._rms(x, self.norm) if i == last else x
        features = torch.cat([outputs[i] for i in layer_ids], -1).numpy()
        if not top_k:
            empty = np.zeros((s, length, 0), np.float32)
            return features, empty.astype(np.int32), empty
        logits = F.linear(self._rms(x, self.norm).to(self.head.dtype), self.head).float()
        values, ids = logits.topk(top_k, -1)
        logprobs = values - logits.logsumexp(-1, keepdim=True)
        return features, ids.int().numpy(), logprobs.numpy()


SORT_WINDOW = 8  # prompts sorted by length together, in slots' worth


def _by_length(items: Iterator[tuple[int, list[int]]], window: int) -> Iterator[tuple[int, list[int]]]:
    """(index, prompt) pairs, shortest first within each `window` of them."""
    while chunk := list(itertools.islice(items, window)):
        yield from sorted(chunk, key=lambda item: len(item[1]))


def generate(
    model,
    prompts: Iterable[list[int]],
    max_new_tokens: int,
    eos_ids: Iterable[int],
    slots: int = 64,
    max_prompt_tokens: int = 512,
    dtype: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
) -> Iterator[tuple[int, list[int]]]:
    """Responses to `prompts`, by continuous batching over `slots` in PyTorch: greedy at temperature 0,
    else sampled (nucleus sampling; `dflash2 data`'s answers are greedy, the prompts the target writes sampled).

    Prompts are taken in windows of `SORT_WINDOW` slots' worth, shortest first within each: a step attends over
    its longest row, so rows of like lengths waste less (1.14x the tokens/s on `data-384`'s mix of first turns and
    later turns with their context), while an interrupted run has answered the prompts of its first windows.

    Args:
        model: the loaded mlx-lm target (see `TorchTarget`).
        prompts: token ids of each prompt (already formatted with the chat template).
        max_new_tokens (int): a response's most tokens.
        eos_ids: tokens that end a response (kept as its last token).
        slots (int): responses decoded at once.
        max_prompt_tokens (int): the longest prompt the cache holds.
        dtype (str, optional): see `TorchTarget`; `machine_dtype()` when None.
        temperature (float): 0 for the most likely token, else the softmax temperature.
        top_p (float): sample from the fewest most likely tokens whose probability reaches `top_p`.
        seed (int): seeds the sampling.
    Yields: (prompt index, response token ids), in the order responses finish.
    """
    torch = _import_torch()
    torch.set_grad_enabled(False)
    target = TorchTarget(model, slots, max_prompt_tokens + max_new_tokens, dtype)
    generator = torch.Generator().manual_seed(seed)

    def pick(logits) -> list[int]:
        if temperature == 0:
            return logits.argmax(-1).tolist()
        logits = logits.float()
        ranked, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
        outside = ranked.cumsum(-1) - ranked >= top_p  # the mass before it reaches top_p (at T = 1, as mlx-lm)
        weights = torch.softmax(logits / temperature, dim=-1).gather(-1, order).masked_fill(outside, 0)
        chosen = torch.multinomial(weights, 1, generator=generator)
        return order.gather(-1, chosen)[:, 0].tolist()

    eos = set(eos_ids)
    queue = _by_length(enumerate(prompts), SORT_WINDOW * slots)
    owner = [None] * slots  # prompt index per slot
    response = [[] for _ in range(slots)]
    position = torch.zeros(slots, dtype=torch.long)  # of each slot's last token

    def fill(slot: int) -> None:
        item = next(queue, None)
        if item is None:
            owner[slot] = None
            return
        index, ids = item
        if len(ids) > max_prompt_tokens:
            raise ValueError(f"prompt {index} has {len(ids)} tokens, over max_prompt_tokens={max_prompt_tokens}")
        tokens = torch.tensor([ids], dtype=torch.long)
        logits = target.forward(tokens, torch.arange(len(ids))[None], torch.tensor([slot]), len(ids))
        owner[slot], response[slot], position[slot] = index, pick(logits[:1]), len(ids)

    def finished(slot: int) -> bool:
        r = response[slot]
        return r[-1] in eos or len(r) >= max_new_tokens

    for slot in range(slots):
        fill(slot)
    while True:
        for slot in range(slots):
            while owner[slot] is not None and finished(slot):
                yield owner[slot], response[slot]
                fill(slot)
        active = [s for s in range(slots) if owner[s] is not None]
        if not active:
            return
        idx = torch.tensor(active)
        pos = position[idx]
        last = torch.tensor([[response[slot][-1]] for slot in active])
        logits = target.forward(last, pos[:, None], idx, int(pos.max()) + 1)
        for slot, token in zip(active, pick(logits)):
            response[slot].append(token)
        position[idx] += 1
