"""The fused Metal kernels: each one, emulated on the CPU (tests/metal_emulation) in both thread orders,
equals its pure-MLX op on fresh random inputs; deliberately broken copies fail there (so the emulator can
fail); a drafter's kernels setting reaches every op of the decode loop (through the emulator); and, on a Mac,
the real kernels against the same ops."""

from __future__ import annotations

import json
from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from helpers import make_dflash2_drafter, make_target
from metal_emulation import EmulationError, compiler, emulate

from dflash2_mlx import generate, kernels
from dflash2_mlx.sampling import SamplingParams, accept_greedy
from dflash2_mlx.selector import LatticeInputs, lattice_of, scored_path, walk_greedy, walk_viterbi
from dflash2_mlx.short_conv import dynamic_conv, dynamic_conv_mlx

emulated = pytest.mark.skipif(
    compiler() is None,
    reason="no C++20 compiler (g++ or clang++), so the Metal kernels cannot be emulated; apps/install.sh installs g++",
)
on_metal = pytest.mark.skipif(
    not mx.metal.is_available(), reason="needs Metal (a Mac); elsewhere the kernels are emulated"
)
DTYPES = [mx.float32, mx.bfloat16, mx.float16]
# the pure-MLX conv rounds every partial sum to its dtype, the kernel only the result
CONV_TOLERANCE = {mx.float32: 1e-5, mx.bfloat16: 3e-2, mx.float16: 4e-3}
WALKS = {"greedy": walk_greedy, "viterbi": walk_viterbi}


def numpy(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32) if x.dtype in (mx.bfloat16, mx.float16) else x)


def in_both_orders(launch: kernels.Launch) -> list[list[mx.array]]:
    return [emulate(launch, reverse) for reverse in (False, True)]


def assert_conv_close(got: mx.array, want: mx.array) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    tolerance = CONV_TOLERANCE[want.dtype]
    scale = float(mx.max(mx.abs(want.astype(mx.float32))))
    np.testing.assert_allclose(numpy(got), numpy(want), rtol=tolerance, atol=tolerance * scale)


def path_launch_for(inputs: LatticeInputs, walk: str) -> kernels.Launch:
    return kernels.path_launch(inputs.unary, inputs.pred_rows, inputs.h, inputs.succ, walk)


# -- inputs and the pure-MLX answers -------------------------------------------------------------------------


def conv_case(lead, L, D, K, G, dtype, seed):
    keys = mx.random.split(mx.random.key(seed), 3)
    x = mx.random.normal((*lead, L, D), key=keys[0]).astype(dtype)
    base = mx.random.normal((K, D), key=keys[1]).astype(dtype)
    dyn = (0.5 * mx.random.normal((*lead, L, K, D // G), key=keys[2])).astype(dtype)
    return (x, base, dyn), dynamic_conv_mlx(x, base, dyn)


def lattice_case(T, k, R, seed, integers=False) -> LatticeInputs:
    """Random float32 inputs; `integers`: small whole numbers, so every score is exact in any summation
    order and ties are everywhere (the tie-breaking is then compared exactly)."""
    keys = mx.random.split(mx.random.key(seed), 4)
    shapes = [(T, k), (T, k, R), (T, R), (T, k, R)]
    if integers:
        fields = [mx.random.randint(-2, 3, s, key=key).astype(mx.float32) for s, key in zip(shapes, keys)]
    else:
        fields = [mx.random.normal(s, key=key) for s, key in zip(shapes, keys)]
    return LatticeInputs(mx.zeros((T, k), mx.uint32), *fields)


def accept_case(B, V, dtype, seed, integers=False):
    """Verify logits [B, V] and drafts that match the target's argmax up to a random row."""
    rng = np.random.default_rng(seed)
    logits = rng.integers(0, 3, (B, V)) if integers else rng.normal(size=(B, V))
    logits = mx.array(logits.astype(np.float32)).astype(dtype)
    choice = np.array(mx.argmax(logits, axis=-1))
    drafts = choice[:-1].copy()
    reject = rng.integers(0, B)  # B - 1: every draft accepted
    if reject < B - 1:
        drafts[reject] = (drafts[reject] + 1 + rng.integers(0, V - 1)) % V
    return mx.array(drafts.astype(np.uint32)), logits


# -- emulated parity --------------------------------------------------------------------------------------------

CONV_SHAPES = [  # (leading dims, L, D, K, group size)
    ((), 2, 48, 2, 16),
    ((3,), 5, 300, 2, 4),  # two threadgroups per row, the second partial
    ((2, 2), 16, 80, 3, 16),
    ((1,), 1, 32, 2, 32),
    ((), 9, 520, 4, 8),  # 256 + 256 + 8 threads
]


@emulated
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CONV_SHAPES, ids=str)
def test_conv_kernel_matches_the_pure_op(shape, dtype):
    inputs, want = conv_case(*shape, dtype, seed=len(shape[0]) + shape[1])
    for (got,) in in_both_orders(kernels.conv_launch(*inputs)):
        assert_conv_close(got, want)


PATH_SHAPES = [(16, 16, 256), (4, 16, 256), (15, 8, 64), (7, 5, 33), (2, 3, 100), (1, 16, 20), (9, 1, 40)]


@emulated
@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("shape", PATH_SHAPES, ids=str)
def test_path_kernel_matches_the_pure_op(shape, walk):
    inputs = lattice_case(*shape, seed=sum(shape))
    want = lattice_of(inputs)
    for scores, path in in_both_orders(path_launch_for(inputs, walk)):
        np.testing.assert_allclose(np.array(scores), np.array(want.scores), rtol=1e-5, atol=1e-4)
        assert path.dtype == mx.uint32
        # the walk is exact on the kernel's own scores, and (no near-ties here) equals the pure walk
        assert path.tolist() == WALKS[walk](want._replace(scores=scores)).tolist() == WALKS[walk](want).tolist()


@emulated
@pytest.mark.parametrize("walk", WALKS)
@pytest.mark.parametrize("seed", range(3))
def test_path_kernel_breaks_ties_like_mlx(walk, seed):
    inputs = lattice_case(8, 16, 64, seed, integers=True)
    want = lattice_of(inputs)
    for scores, path in in_both_orders(path_launch_for(inputs, walk)):
        np.testing.assert_array_equal(np.array(scores), np.array(want.scores))
        assert path.tolist() == WALKS[walk](want).tolist()


@emulated
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B, V", [(2, 1000), (5, 257), (8, 4099), (16, 3000)])
def test_accept_kernel_matches_the_pure_op(B, V, dtype):
    for seed in range(3):
        drafts, logits = accept_case(B, V, dtype, seed=B * V + seed, integers=seed == 2)
        want = accept_greedy(drafts, logits)
        for got in in_both_orders(kernels.accept_launch(drafts, logits)):
            assert [(g.item(), g.dtype) for g in got] == [(w.item(), w.dtype) for w in want], seed


# -- the emulator can fail -------------------------------------------------------------------------------------


def conv_example():
    inputs, want = conv_case((2,), 5, 300, 2, 4, mx.float32, seed=0)
    return kernels.conv_launch(*inputs), [want]


def path_example():
    inputs = lattice_case(6, 16, 64, seed=0)
    lattice = lattice_of(inputs)
    return path_launch_for(inputs, "greedy"), [lattice.scores, walk_greedy(lattice)]


def accept_example():
    drafts, logits = accept_case(8, 5000, mx.float32, seed=1)
    return kernels.accept_launch(drafts, logits), list(accept_greedy(drafts, logits))


def same(got: list[mx.array], want: list[mx.array]) -> bool:
    return all(g.shape == w.shape and np.allclose(numpy(g), numpy(w), rtol=1e-5, atol=1e-4) for g, w in zip(got, want))


BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"
BROKEN = {  # a kernel, a line of it, what replaces it, and a launch with the pure-MLX answer
    "selector without its barrier": ("lattice_path", BARRIER, "", path_example),
    "acceptance without its first barrier": ("accept_greedy", BARRIER, "", accept_example),
    "conv leaving the last channel unwritten": (
        "dynamic_conv",
        "out[row * D + c] =",
        "if (c + 1 < D) out[row * D + c] =",
        conv_example,
    ),
    "selector leaving a score unwritten": (
        "lattice_path",
        "scores[row * k + b] = score;",
        "if (row + b > 0) scores[row * k + b] = score;",
        path_example,
    ),
    "selector with a thread skipping the barrier": (
        "lattice_path",
        "const uint simd = simdgroup_index_in_threadgroup;",
        "const uint simd = simdgroup_index_in_threadgroup;\nif (lane == 31) return;",
        path_example,
    ),
}


@pytest.mark.slow
@emulated
@pytest.mark.parametrize("case", BROKEN)
def test_broken_kernels_fail_in_the_emulator(case):
    name, line, replacement, make = BROKEN[case]
    body = kernels.source(f"{name}.metal")
    assert line in body
    launch, want = make()
    assert all(same(got, want) for got in in_both_orders(launch))  # the intact kernel passes
    failed = []
    for reverse in (False, True):
        try:
            failed.append(not same(emulate(launch, reverse, body.replace(line, replacement, 1)), want))
        except EmulationError:  # e.g. a barrier some threads never reach
            failed.append(True)
    assert any(failed), f"the emulator passed a broken kernel ({case})"


# -- the kernels setting ---------------------------------------------------------------------------------------


def test_kernels_setting():
    assert kernels.use_metal("mlx") is False and kernels.use_metal("auto") == mx.metal.is_available()
    assert kernels.backend_name(True) == "Metal" and kernels.backend_name(False) == "pure-MLX"
    with pytest.raises(ValueError, match="unknown kernels setting 'cuda'"):
        kernels.use_metal("cuda")
    drafter = make_dflash2_drafter(make_target())
    assert drafter.metal == mx.metal.is_available()  # a new drafter is 'auto'
    if not mx.metal.is_available():
        with pytest.raises(ValueError, match="needs Metal.*use --kernels auto or --kernels mlx"):
            drafter.use_kernels("metal")
    drafter.use_kernels("mlx")
    flags = [drafter.metal] + [m.metal for layer in drafter.layers for m in (layer, *layer.convs())]
    assert flags == [False] * 7 and drafter.metal_kernels == frozenset()
    assert kernels.backend_name(frozenset(kernels.NAMES)) == "Metal"
    assert kernels.backend_name(frozenset({"dynamic_conv"})) == "Metal (lattice_path, accept_greedy: pure-MLX)"
    assert kernels.backend_name(frozenset()) == "pure-MLX"


@pytest.mark.slow
@emulated
def test_a_drafters_kernels_setting_reaches_every_op_of_the_decode_loop(tokenizer, monkeypatch):
    """A drafter set to 'metal' launches the conv, selector and acceptance kernels from the decode loop (run
    here by the CPU emulator), drafts what its pure-MLX self drafts, and decodes losslessly; set to 'mlx' it
    launches none. Two drafters in one process keep their own settings (no global switch)."""
    model = make_target()
    metal, pure = make_dflash2_drafter(model), make_dflash2_drafter(model)
    with monkeypatch.context() as m:
        m.setattr(mx.metal, "is_available", lambda: True)
        metal.use_kernels("metal")  # every kernel, unchecked
    assert metal.metal_kernels == {"dynamic_conv", "lattice_path", "accept_greedy"}
    pure.use_kernels("mlx")
    launched = []
    monkeypatch.setattr(kernels.Launch, "run", lambda launch: launched.append(launch.name) or emulate(launch))
    plain = generate(model, tokenizer, [3, 4, 5], None, verify_mode="off", max_tokens=10, eos_token_ids=[]).tokens
    for walk in WALKS:
        runs = {}
        for name, drafter in (("mlx", pure), ("metal", metal)):
            launched.clear()
            runs[name] = generate(
                model,
                tokenizer,
                [3, 4, 5],
                drafter,
                walk=walk,
                block_size=8,
                max_tokens=10,
                eos_token_ids=[],
                verify_mode="dflash",
            )  # drafts every cycle, whatever it costs
            assert set(launched) == (set() if name == "mlx" else {"dynamic_conv", "lattice_path", "accept_greedy"})
        assert runs["metal"].tokens == runs["mlx"].tokens == plain
    # the drafts themselves: the same block and context through both drafters
    block = mx.array([[7] + [pure.config.mask_token_id] * 7])
    context = mx.random.normal(
        (1, 6, len(pure.config.target_layer_ids) * pure.config.hidden_size), key=mx.random.key(4)
    )
    for walk in WALKS:
        got, want = (d.propose(block, context, d.make_cache(), SamplingParams(), walk) for d in (metal, pure))
        assert got.tokens.tolist() == want.tokens.tolist()


def test_cli_kernels_flag(tiny_pair, capsys):
    from dflash2_apps.cli import main

    target, drafter = tiny_pair
    args = [
        "generate",
        "--model",
        str(target),
        "--draft-model",
        str(drafter),
        "--prompt",
        "w1",
        "--max-tokens",
        "4",
        "--json",
    ]
    assert main([*args, "--kernels", "mlx"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["runtime"]["kernels"] == "pure-MLX"
    if not mx.metal.is_available():
        assert main([*args, "--kernels", "metal"]) == 2
        assert "needs Metal" in capsys.readouterr().err


def test_conv_gradients_go_through_the_pure_op(monkeypatch):
    """With kernels on, training differentiates the pure op (a Metal kernel has no autodiff). Here the
    kernel's forward is stood in for by one without gradients: only the custom vjp can give them."""
    monkeypatch.setattr(kernels, "dynamic_conv", lambda *a: mx.stop_gradient(dynamic_conv_mlx(*a)))
    (x, base, dyn), _ = conv_case((2,), 5, 32, 2, 16, mx.float32, seed=3)

    def loss(f):
        return lambda *a: mx.sum(f(*a) ** 2)

    got = mx.grad(loss(partial(dynamic_conv, metal=True)), argnums=(0, 1, 2))(x, base, dyn)
    want = mx.grad(loss(dynamic_conv_mlx), argnums=(0, 1, 2))(x, base, dyn)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, atol=1e-5)


def test_kernel_bench_runs(capsys, monkeypatch):
    from dflash2_apps.kernel_bench import main

    monkeypatch.setenv("COLUMNS", "150")  # the table's width follows $COLUMNS, which a test runner may set narrow
    assert main(["--iterations", "1"]) == 0
    out = capsys.readouterr().out
    assert "D=5120 L=16" in out and "T=15 k=16 R=256" in out and "B=16 V=151936" in out
    assert mx.metal.is_available() or "Metal is not available here" in out


# -- on a Mac: the real kernels ---------------------------------------------------------------------------------


@on_metal
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_metal_kernels_match_the_pure_ops(dtype):
    for shape in CONV_SHAPES:
        inputs, want = conv_case(*shape, dtype, seed=1)
        assert_conv_close(kernels.dynamic_conv(*inputs), want)
    for B, V in [(2, 1000), (16, 151936)]:
        drafts, logits = accept_case(B, V, dtype, seed=B)
        got, want = kernels.accept_greedy(drafts, logits), accept_greedy(drafts, logits)
        assert [g.item() for g in got] == [w.item() for w in want]


@on_metal
@pytest.mark.parametrize("walk", WALKS)
def test_metal_path_kernel_matches_the_pure_op(walk):
    for shape in PATH_SHAPES:
        inputs = lattice_case(*shape, seed=2)
        want = lattice_of(inputs)
        scores, path = kernels.scored_path(inputs.unary, inputs.pred_rows, inputs.h, inputs.succ, walk)
        np.testing.assert_allclose(np.array(scores), np.array(want.scores), rtol=1e-5, atol=1e-4)
        assert path.tolist() == WALKS[walk](want._replace(scores=scores)).tolist()
        integer = lattice_case(*shape, seed=2, integers=True)
        assert scored_path(integer, walk, metal=True)[1].tolist() == WALKS[walk](lattice_of(integer)).tolist()


@on_metal
@pytest.mark.parametrize("walk", WALKS)
def test_metal_kernels_keep_decoding_lossless(walk, tokenizer):
    model = make_target()
    drafter = make_dflash2_drafter(model)
    runs = {}
    for choice in ("mlx", "metal"):
        drafter.use_kernels(choice)
        runs[choice] = generate(
            model, tokenizer, [3, 4, 5], drafter, walk=walk, block_size=8, max_tokens=24, eos_token_ids=[]
        ).tokens
    assert runs["metal"] == runs["mlx"]
