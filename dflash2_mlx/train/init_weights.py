"""How a new drafter's weights start: its layers from the target's last layers (`--init-from-target`), a DFlash 2
selector that starts as the identity (the drafter drafts as its v1 core until it learns otherwise), and layers
added to a warm-started drafter that start as the identity."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..drafter import DFlashDraftModel
from ..target import Target


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
        raise ValueError(
            f"--init-from-target: no weight of the target's layers ({type(pairs[0][1]).__name__}) "
            "matches the drafter's names and shapes"
        )
    drafter.load_weights(list(weights.items()), strict=False)
    mx.eval(drafter.parameters())


def identity_selector(drafter: DFlashDraftModel) -> None:
    """Zero successor codes: every pair score is the unary one, so a new DFlash 2 drafter drafts as its v1
    core does (its convolutions start as identity too) and learns the pairwise term from there."""
    sel = drafter.candidate_selector
    table = sel.successor_projection if sel.factorized else sel.successor_codebook
    table.weight = mx.zeros_like(table.weight)


def identity_layer(layer) -> None:
    """Zero a drafter layer's attention and MLP output projections: with the residual around each (and DFlash 2's
    convolutions, linear in what they convolve), the layer passes its input through unchanged. A drafter grown
    from a shallower one (`--init-from` with more `--layers`) drafts as it did at step 0; the zeroed projections
    take the first gradients, the rest of the layer follows."""
    layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    layer.mlp.down_proj.weight = mx.zeros_like(layer.mlp.down_proj.weight)
