"""DFlash 2's dynamic short convolution: a content-adaptive causal two-tap filter inside the block.

Around every attention and MLP sublayer: "prepare" filters the normed sublayer input, "finish" filters
the sublayer output, both with coefficients predicted from the normed input. Each tap is a static
per-channel weight (`base_kernel`) plus a dynamic correction shared by every `group_size` channels:

    conv(x, base, dyn)[t, c] = sum_o (base[o, c] + dyn[t, o, c // G]) * x[t - o, c],   x[t - o] = 0 before row 0

It is block-local and stateless: rows never see the previous block, so nothing is cached.
With kernels on (`metal`, the drafter's setting), the forward pass is one fused Metal kernel; gradients still go
through the pure-MLX op, so training works either way.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import kernels


def dynamic_conv(x: mx.array, base: mx.array, dyn: mx.array, metal: bool = False) -> mx.array:
    """x [..., L, D]; base [K, D]; dyn [..., L, K, D/G] -> [..., L, D]; `metal`: as one Metal kernel."""
    if metal:
        return _fused_conv(x, base, dyn)
    return dynamic_conv_mlx(x, base, dyn)


def dynamic_conv_mlx(x: mx.array, base: mx.array, dyn: mx.array) -> mx.array:
    """The pure-MLX op (the reference for the kernel)."""
    *lead, L, D = x.shape
    K, groups = base.shape[0], dyn.shape[-1]
    out = None
    for o in range(K):
        if o == 0:
            shifted = x
        elif o >= L:
            shifted = mx.zeros_like(x)
        else:
            shifted = mx.pad(x[..., : L - o, :], [(0, 0)] * len(lead) + [(o, 0), (0, 0)])
        grouped = (shifted.reshape(*lead, L, groups, D // groups) * dyn[..., o, :, None]).reshape(x.shape)
        term = base[o].astype(x.dtype) * shifted + grouped
        out = term if out is None else out + term
    return out


@mx.custom_function
def _fused_conv(x, base, dyn):
    return kernels.dynamic_conv(x, base, dyn)


@_fused_conv.vjp
def _fused_conv_vjp(primals, cotangent, output):
    """A Metal kernel has no autodiff: differentiate the pure-MLX op instead."""
    return mx.vjp(dynamic_conv_mlx, list(primals), [cotangent])[1]


class DynamicShortConv(nn.Module):
    """Hugging Face names: `layers.N.attention_conv` / `layers.N.mlp_conv`."""

    def __init__(self, dim: int, kernel_size: int, group_size: int):
        super().__init__()
        if dim % group_size:
            raise ValueError(f"hidden size {dim} is not a multiple of the conv group size {group_size}")
        self.kernel_size, self.groups = kernel_size, dim // group_size
        # Identity at initialisation (tap 0 = 1 for both prepare and finish, no dynamic part), so a new
        # DFlash 2 drafter starts out as its DFlash v1 twin.
        self.base_kernel = mx.zeros((2, kernel_size, dim)).at[:, 0, :].add(1.0)
        self.kernel_projection = nn.Linear(dim, 2 * kernel_size * self.groups, bias=False)
        self.kernel_projection.weight = mx.zeros_like(self.kernel_projection.weight)
        self.metal = False  # the fused kernel; the drafter sets it (`DFlashDraftModel.use_kernels`)

    def coefficients(self, xn: mx.array) -> mx.array:
        """Dynamic taps from the normed sublayer input: [..., L, 2, K, D/G] (0: prepare, 1: finish)."""
        return self.kernel_projection(xn).reshape(*xn.shape[:-1], 2, self.kernel_size, self.groups)

    def __call__(self, x: mx.array, half: int, coefficients: mx.array) -> mx.array:
        return dynamic_conv(x, self.base_kernel[half], coefficients[..., half, :, :], self.metal)
