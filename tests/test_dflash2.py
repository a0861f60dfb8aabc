"""DFlash 2: the dynamic short convolution and the path selector against independent NumPy versions
written from the formulas, the walks against brute force, and lossless decoding with both walks."""

from __future__ import annotations

import itertools
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from helpers import (
    DFLASH2,
    drafter_config,
    make_dflash2_drafter,
    make_drafter,
    make_target,
    save_drafter,
    slow_except,
    synthetic_checkpoint,
)
from mlx.utils import tree_flatten

from dflash2_mlx import DFlashDraftModel, generate, load_drafter
from dflash2_mlx.generate import resolve_block_size
from dflash2_mlx.loading import bind_drafter
from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.selector import CandidateSelector, Lattice, path_score, walk_greedy, walk_viterbi
from dflash2_mlx.short_conv import DynamicShortConv

FIXTURES = Path(__file__).parent / "fixtures"
RNG = np.random.default_rng(0)


# -- dynamic short convolution ---------------------------------------------------------------------------


def conv_reference(x, base, dyn, G):
    """out[t, c] = sum_o (base[o, c] + dyn[t, o, c // G]) * x[t - o, c], zero before row 0."""
    L, D = x.shape
    out = np.zeros_like(x, dtype=np.float64)
    for t in range(L):
        for o in range(base.shape[0]):
            if t - o >= 0:
                for c in range(D):
                    out[t, c] += (base[o, c] + dyn[t, o, c // G]) * x[t - o, c]
    return out


def random_conv(D=48, K=2, G=16, seed=0) -> DynamicShortConv:
    conv = DynamicShortConv(D, K, G)
    key = mx.random.key(seed)
    conv.base_kernel = mx.random.normal(conv.base_kernel.shape, key=key)
    conv.kernel_projection.weight = 0.2 * mx.random.normal(
        conv.kernel_projection.weight.shape, key=mx.random.key(seed + 1)
    )
    return conv


@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-5), (mx.bfloat16, 3e-2)])
@pytest.mark.parametrize("L, K", [(5, 2), (16, 2), (3, 3), (1, 2)])
def test_conv_matches_reference(dtype, tol, L, K):
    conv = random_conv(K=K)
    conv.set_dtype(dtype)
    xn = mx.array(RNG.normal(size=(L, 48)).astype(np.float32)).astype(dtype)
    y = mx.array(RNG.normal(size=(L, 48)).astype(np.float32)).astype(dtype)
    taps = conv.coefficients(xn)
    taps_np = np.array(taps.astype(mx.float32))
    base = np.array(conv.base_kernel.astype(mx.float32))

    def x64(a):
        return np.array(a.astype(mx.float32)).astype(np.float64)

    for half, inp in ((0, xn), (1, y)):
        got = np.array(conv(inp, half, taps).astype(mx.float32))
        want = conv_reference(x64(inp), base[half], taps_np[:, half], 16)
        np.testing.assert_allclose(got, want, atol=tol * max(1, np.abs(want).max()), rtol=tol)


def test_conv_is_block_local_and_stateless():
    conv = random_conv()
    x = mx.array(RNG.normal(size=(8, 48)).astype(np.float32))
    taps = conv.coefficients(x)
    ref = np.array(conv(x, 0, taps))
    for t in range(8):
        x2 = x.at[t].add(3.0)
        out = np.array(conv(x2, 0, taps))
        np.testing.assert_array_equal(out[:t], ref[:t])  # earlier rows never see a later row
        assert np.abs(out[t] - ref[t]).max() > 0
    np.testing.assert_array_equal(np.array(conv(x, 0, taps)), ref)  # same call, same answer


def test_identity_initialisation_reduces_to_dflash_v1():
    """A new DFlash 2 drafter (identity convs) computes exactly what its v1 twin computes."""
    target = make_target("qwen3")
    v1 = make_drafter(target, seed=4)
    v2 = DFlashDraftModel.from_config(drafter_config(target, **DFLASH2))
    v2.load_weights([(k, v) for k, v in tree_flatten(v1.parameters())], strict=False)
    bind_drafter(v2, target)
    block, ctx = mx.array([[5, 255, 255, 255]]), mx.random.normal((1, 6, 128), key=mx.random.key(2))
    np.testing.assert_allclose(
        np.array(v2.hidden(block, ctx, v2.make_cache())),
        np.array(v1.hidden(block, ctx, v1.make_cache())),
        atol=1e-5,
    )


# -- path selector -------------------------------------------------------------------------------------------


def selector_reference(hidden, logits, anchor, A, Bc, W, k):
    """The lattice from the definition, one pair at a time (float64)."""
    T = logits.shape[0]
    cand = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    H = hidden @ W.T

    def score(t, a, b):
        return logits[t, b] + np.sum(A[a] * H[t] * Bc[b])

    first = np.array([score(0, anchor, b) for b in cand[0]])
    edges = np.array([[[score(t, a, b) for b in cand[t]] for a in cand[t - 1]] for t in range(1, T)])
    return cand, first, edges.reshape(T - 1, k, k)


@pytest.mark.parametrize("T", [1, 2, 6, 15])
def test_lattice_matches_reference(T):
    V, D, R, k = 300, 32, 16, 8
    sel = CandidateSelector(D, R, k, V)
    hidden = mx.array(RNG.normal(size=(T, D)).astype(np.float32))
    logits = mx.array(RNG.normal(size=(T, V)).astype(np.float32) * 3)
    lat = sel.lattice(hidden, logits, mx.array(7))
    cand, first, edges = selector_reference(
        np.array(hidden, np.float64),
        np.array(logits, np.float64),
        7,
        np.array(sel.predecessor_codebook.weight, np.float64),
        np.array(sel.successor_codebook.weight, np.float64),
        np.array(sel.hidden_projection.weight, np.float64),
        k,
    )
    np.testing.assert_array_equal(np.array(lat.candidates), cand)
    scores = np.array(lat.scores)
    assert scores.shape == (T, 8, 8)
    np.testing.assert_allclose(scores[0], np.broadcast_to(first, (8, 8)), atol=1e-4, rtol=1e-5)
    np.testing.assert_allclose(scores[1:], edges, atol=1e-4, rtol=1e-5)


def random_lattice(T, k, seed) -> Lattice:
    rng = np.random.default_rng(seed)
    scores = rng.normal(size=(T, k, k)).astype(np.float32)
    scores[0] = scores[0, 0]  # row 0: one predecessor, the anchor
    return Lattice(mx.array(rng.integers(0, 1000, size=(T, k))), mx.array(scores))


@pytest.mark.parametrize("seed", range(20))
def test_walks_against_brute_force(seed):
    T, k = 4, 3
    lat = random_lattice(T, k, seed)
    first, edges = np.array(lat.scores)[0, 0], np.array(lat.scores)[1:]
    # the sequential reference walk
    prev, seq = None, []
    for t in range(T):
        row = first if t == 0 else edges[t - 1][prev]
        prev = int(np.argmax(row))
        seq.append(prev)
    greedy = walk_greedy(lat).tolist()
    assert greedy == seq
    # every one of the k^T paths
    totals = {
        p: first[p[0]] + sum(edges[t - 1][p[t - 1], p[t]] for t in range(1, T))
        for p in itertools.product(range(k), repeat=T)
    }
    best = max(totals, key=totals.get)
    viterbi = walk_viterbi(lat).tolist()
    assert tuple(viterbi) == best
    assert path_score(lat, mx.array(viterbi)).item() == pytest.approx(totals[best], abs=1e-5)
    assert totals[best] >= totals[tuple(greedy)] - 1e-6


def test_viterbi_never_scores_below_greedy():
    gains = []
    for seed in range(200):
        lat = random_lattice(8, 16, seed)
        v = path_score(lat, walk_viterbi(lat)).item()
        g = path_score(lat, walk_greedy(lat)).item()
        assert v >= g - 1e-4
        gains.append(v - g)
    assert max(gains) > 0  # it does find better paths, not only equal ones


# -- decoding with a DFlash 2 drafter --------------------------------------------------------------------


@pytest.mark.parametrize("arch", slow_except(["qwen3", "llama_swa"], "qwen3"))
@pytest.mark.parametrize("walk", ["greedy", "viterbi"])
def test_greedy_lossless_with_both_walks(arch, walk, tokenizer):
    model = make_target(arch, seed=1)
    drafter = make_dflash2_drafter(model, block_size=16)
    for i, prompt in enumerate([[7, 19, 33], list(range(40, 71))]):
        plain = generate(model, tokenizer, prompt, None, verify_mode="off", max_tokens=30, eos_token_ids=[])
        for B in (2, 3, 5, 9, 16):
            spec = generate(
                model,
                tokenizer,
                prompt,
                drafter,
                verify_mode="dflash",
                block_size=B,
                walk=walk,
                max_tokens=30,
                eos_token_ids=[],
            )
            assert spec.tokens == plain.tokens, f"{arch} {walk} prompt {i} B={B}"


def test_factorised_selector(tokenizer):
    model = make_target("qwen3", seed=2)
    full = make_dflash2_drafter(model)
    small = make_dflash2_drafter(model, selector_factorized=True)

    def count(d):
        return sum(v.size for k, v in tree_flatten(d.parameters()) if "candidate_selector" in k)

    assert count(small) < count(full) / 2  # 3*D*R instead of D*R + 2*V*R
    plain = generate(model, tokenizer, [9, 8, 7], None, verify_mode="off", max_tokens=20, eos_token_ids=[])
    spec = generate(model, tokenizer, [9, 8, 7], small, walk="viterbi", block_size=6, max_tokens=20, eos_token_ids=[])
    assert spec.tokens == plain.tokens


def test_default_block_size_is_capped_at_5():
    model = make_target("qwen3")
    assert resolve_block_size(make_dflash2_drafter(model, block_size=16), None) == 5
    assert resolve_block_size(make_dflash2_drafter(model, block_size=4), None) == 4
    assert resolve_block_size(make_dflash2_drafter(model, block_size=16), 12) == 12
    assert resolve_block_size(make_drafter(model, block_size=16), None) == 16  # v1: the trained size


def test_viterbi_needs_a_selector(tokenizer):
    model = make_target("qwen3")
    with pytest.raises(ValueError, match="'viterbi' walk needs a DFlash 2 drafter"):
        generate(model, tokenizer, [1, 2], make_drafter(model), walk="viterbi", max_tokens=4)


@pytest.mark.parametrize("sampling", [{}, dict(temp=0.8, top_k=1)], ids=["greedy", "sampled-top1"])
def test_non_finite_drafts_fall_back_to_plain_decoding(tokenizer, sampling):
    """Both acceptance paths; top-k 1 makes T > 0 deterministic, so the outputs compare token by token."""
    model = make_target("qwen3", seed=3)
    drafter = make_dflash2_drafter(model)
    drafter.layers[0].mlp.down_proj.weight = drafter.layers[0].mlp.down_proj.weight * mx.nan
    plain = generate(model, tokenizer, [4, 5, 6], None, verify_mode="off", max_tokens=12, eos_token_ids=[])
    with pytest.warns(RuntimeWarning, match="non-finite logits"):
        spec = generate(
            model, tokenizer, [4, 5, 6], drafter, verify_mode="dflash", max_tokens=12, eos_token_ids=[], **sampling
        )
    assert spec.tokens == plain.tokens
    assert spec.draft_failures == spec.cycles == 11 and spec.accepted == [0] * 11


# -- the published DFlash 2 layout, shrunk ----------------------------------------------------------------


def test_published_layout_loads_and_decodes(tmp_path, tokenizer):
    folder = synthetic_checkpoint(tmp_path / "d2", "dflash2")
    drafter = load_drafter(str(folder))
    assert drafter.config.is_dflash2 and drafter.config.final_logit_softcapping == 20.0
    assert drafter.norm.weight.dtype == mx.float32  # bf16 on disk, float32 compute on a CPU
    model = make_target("qwen3", layers=6)
    plain = generate(model, tokenizer, [3, 4, 5], None, verify_mode="off", max_tokens=20, eos_token_ids=[])
    for walk in ("greedy", "viterbi"):
        spec = generate(model, tokenizer, [3, 4, 5], drafter, walk=walk, block_size=8, max_tokens=20, eos_token_ids=[])
        assert spec.tokens == plain.tokens


def test_saved_dflash2_round_trip(tmp_path):
    model = make_target("qwen3")
    drafter = make_dflash2_drafter(model, block_size=8)
    cfg = drafter.config.to_hf_dict()
    assert "block_size" not in cfg and cfg["dflash_config"]["block_size"] == 8  # DFlash 2 layout
    folder = save_drafter(tmp_path / "d", drafter)
    assert "candidate_selector.successor_codebook" in mx.load(str(folder / "model.safetensors"))
    loaded = load_drafter(str(folder))
    bind_drafter(loaded, model)
    assert loaded.config == drafter.config
    block, ctx = mx.array([[5, 255, 255, 255]]), mx.random.normal((1, 3, 128), key=mx.random.key(0))
    a = loaded.propose(block, ctx, loaded.make_cache(), SamplingParams(), "viterbi")
    b = drafter.propose(block, ctx, drafter.make_cache(), SamplingParams(), "viterbi")
    assert a.tokens.tolist() == b.tokens.tolist()
