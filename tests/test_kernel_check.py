"""The Metal kernels' self-check under `--kernels auto`: a kernel that fails to build or disagrees with its
pure-MLX op is switched off (one warning naming it and `--kernels mlx`), the others stay on, and decoding is
unchanged. There is no Metal here, so "Metal" is stood in for where the real kernels launch
(`kernels.Launch.run`): by the pure-MLX ops behind a launch, with one kernel made to fail to build or to give
wrong numbers; and, where a C++ compiler is, by the CPU emulator running the real kernel bodies."""

from __future__ import annotations

import json
import warnings

import mlx.core as mx
import pytest
from helpers import make_dflash2_drafter, make_target
from metal_emulation import compiler, emulate

from dflash2_mlx import generate, kernel_check, kernels
from dflash2_mlx.sampling import SamplingParams, accept_greedy
from dflash2_mlx.selector import LatticeInputs, lattice_of, walk_greedy, walk_viterbi
from dflash2_mlx.short_conv import dynamic_conv_mlx

# every (kernel, dtype) the check runs: the conv and acceptance in each float dtype, the selector in float32
# (its inputs are float32 whatever the drafter's)
CHECKED = (
    [("dynamic_conv", d) for d in ("float32", "bfloat16", "float16")]
    + [("lattice_path", "float32")]
    + [("accept_greedy", d) for d in ("float32", "bfloat16", "float16")]
)
BUILD_ERROR = "[metal_kernel] Unable to build metal library from source\nprogram_source:12:5: error: use of undeclared"


def pure_launch(launch: kernels.Launch) -> list[mx.array]:
    """What a launch computes, by the pure-MLX ops: a kernel that is right by construction."""
    if launch.name == "dynamic_conv":
        return [dynamic_conv_mlx(*launch.inputs)]
    if launch.name == "lattice_path":
        lattice = lattice_of(LatticeInputs(None, *launch.inputs))
        walk = walk_viterbi if dict(launch.template)["VITERBI"] else walk_greedy
        return [lattice.scores, walk(lattice).astype(mx.uint32)]
    return list(accept_greedy(*launch.inputs))


def wrong(launch: kernels.Launch) -> list[mx.array]:
    """A kernel that builds but computes something else."""
    out = pure_launch(launch)
    if launch.name == "dynamic_conv":
        return [2 * out[0]]
    if launch.name == "lattice_path":  # every row picks the next candidate
        return [out[0], (out[1] + 1) % launch.inputs[0].shape[1]]
    drafts = launch.inputs[0]  # one more draft accepted than the target agrees with (when one is rejected)
    return [mx.minimum(out[0] + 1, drafts.size).astype(out[0].dtype), out[1]]


class FakeMetal:
    """Stands in for Metal: every launch runs as `pure_launch`, but `broken` fails to build ('build') or gives
    wrong numbers ('wrong'). Records the kernels launched."""

    def __init__(self, monkeypatch, broken: str | None = None, fault: str | None = None):
        self.broken, self.fault, self.launched = broken, fault, []
        monkeypatch.setattr(mx.metal, "is_available", lambda: True)
        monkeypatch.setattr(kernels.Launch, "run", lambda launch: self.run(launch))

    def run(self, launch: kernels.Launch) -> list[mx.array]:
        self.launched.append(launch.name)
        if launch.name == self.broken:
            if self.fault == "build":
                raise RuntimeError(BUILD_ERROR)
            return wrong(launch)
        return pure_launch(launch)


def check_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, kernel_check.KernelCheckWarning)]


def drafts(drafter, walk: str) -> list[int]:
    block = mx.array([[7] + [drafter.config.mask_token_id] * 7])
    width = len(drafter.config.target_layer_ids) * drafter.config.hidden_size
    context = mx.random.normal((1, 6, width), key=mx.random.key(4))
    return drafter.propose(block, context, drafter.make_cache(), SamplingParams(), walk).tokens.tolist()


@pytest.mark.parametrize("fault", ["build", "wrong"])
@pytest.mark.parametrize("broken", kernels.NAMES)
def test_a_failing_kernel_is_switched_off_alone(broken, fault, tokenizer, monkeypatch):
    model = make_target()
    pure = make_dflash2_drafter(model).use_kernels("mlx")  # before Metal is stood in for: no check
    metal = FakeMetal(monkeypatch, broken, fault)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        drafter = make_dflash2_drafter(model)  # a new drafter is 'auto': the check runs here
        again = make_dflash2_drafter(model, seed=2).use_kernels("auto")  # checked once per process
    messages = check_warnings(caught)
    assert len(messages) == 1, messages
    assert broken in messages[0] and "--kernels mlx" in messages[0]
    assert not any(other in messages[0] for other in kernels.NAMES if other != broken)
    on = set(kernels.NAMES) - {broken}
    assert drafter.metal_kernels == again.metal_kernels == on
    assert kernels.backend_name(drafter.metal_kernels) == f"Metal ({broken}: pure-MLX)"
    results = kernel_check.results()
    assert [(r.kernel, r.dtype) for r in results] == CHECKED
    assert all(r.ok == (r.kernel != broken) for r in results)
    assert all(("did not build" if fault == "build" else "disagrees") in r.reason for r in results if not r.ok)

    # decoding: the other kernels still launch, and the tokens and drafts are the pure-MLX ones
    plain = generate(model, tokenizer, [3, 4, 5], None, verify_mode="off", max_tokens=12, eos_token_ids=[]).tokens
    for walk in ("greedy", "viterbi"):
        metal.launched.clear()
        got = generate(
            model,
            tokenizer,
            [3, 4, 5],
            drafter,
            walk=walk,
            block_size=8,
            max_tokens=12,
            eos_token_ids=[],
            verify_mode="dflash",
        ).tokens
        assert set(metal.launched) == on
        assert (
            got
            == generate(
                model,
                tokenizer,
                [3, 4, 5],
                pure,
                walk=walk,
                block_size=8,
                max_tokens=12,
                eos_token_ids=[],
                verify_mode="dflash",
            ).tokens
            == plain
        )
        assert drafts(drafter, walk) == drafts(pure, walk)

    # the fault bites: with every kernel on, unchecked ('metal'), decoding fails or drafts / decodes wrongly
    unchecked = make_dflash2_drafter(model).use_kernels("metal")
    assert unchecked.metal_kernels == set(kernels.NAMES)
    if fault == "build":
        with pytest.raises(RuntimeError, match="Unable to build"):
            generate(
                model,
                tokenizer,
                [3, 4, 5],
                unchecked,
                block_size=8,
                max_tokens=12,
                eos_token_ids=[],
                verify_mode="dflash",
            )
    elif broken == "accept_greedy":
        assert (
            generate(
                model,
                tokenizer,
                [3, 4, 5],
                unchecked,
                block_size=8,
                max_tokens=12,
                eos_token_ids=[],
                verify_mode="dflash",
            ).tokens
            != plain
        )
    else:
        assert drafts(unchecked, "greedy") != drafts(pure, "greedy")


def test_every_kernel_that_passes_stays_on_without_a_warning(monkeypatch):
    metal = FakeMetal(monkeypatch)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernel_check.enabled("auto") == set(kernels.NAMES)
        assert kernel_check.enabled("auto") == set(kernels.NAMES)
    assert check_warnings(caught) == []
    # once per process: 3 conv launches, 2 walks of the selector, 2 acceptance cases in 3 dtypes
    assert sorted(metal.launched) == sorted(["dynamic_conv"] * 3 + ["lattice_path"] * 2 + ["accept_greedy"] * 6)
    results = kernel_check.results()
    assert all(r.ok and r.reason == "" for r in results)
    assert [r.max_diff for r in results if r.kernel == "dynamic_conv"] == [0.0] * 3  # the same op: no difference
    kernel_check.clear()
    kernel_check.results()
    assert len(metal.launched) == 2 * 11  # cleared: checked again


def test_the_check_leaves_the_global_random_state_alone(monkeypatch):
    FakeMetal(monkeypatch)
    mx.random.seed(7)
    want = mx.random.uniform(shape=(4,)).tolist()
    mx.random.seed(7)
    kernel_check.results()
    assert mx.random.uniform(shape=(4,)).tolist() == want


def test_nan_and_slightly_wrong_numbers_fail(monkeypatch):
    """The tolerance is per dtype: a conv off by 1% fails in float32 and float16 but passes in bfloat16 (whose
    rounding alone is up to 3%); a NaN output fails in every dtype."""
    FakeMetal(monkeypatch)
    monkeypatch.setattr(kernels.Launch, "run", lambda launch: [pure_launch(launch)[0] * 1.01])
    assert [kernel_check.check("dynamic_conv", d).ok for d in kernel_check.DTYPES] == [False, True, False]
    monkeypatch.setattr(kernels.Launch, "run", lambda launch: [pure_launch(launch)[0] * float("nan")])
    for dtype in kernel_check.DTYPES:
        result = kernel_check.check("dynamic_conv", dtype)
        assert not result.ok and "non-finite" in result.reason and result.max_diff is None


def test_without_metal_auto_is_pure_mlx_and_metal_a_clear_error():
    assert not mx.metal.is_available()  # what this test is about (a Linux CI machine)
    assert kernel_check.enabled("auto") == kernel_check.enabled("mlx") == frozenset()
    with pytest.raises(ValueError, match="--kernels metal needs Metal.*--kernels mlx"):
        kernel_check.enabled("metal")
    assert kernel_check._results is None  # nothing was checked


def test_info_self_check_without_metal(capsys):
    from dflash2_apps.cli import main

    assert main(["info", "--self-check"]) == 0
    out = capsys.readouterr().out
    assert "Metal is not available here" in out and "--kernels auto runs the pure-MLX ops" in out
    assert main(["info", "--self-check", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["metal_available"] is False and record["checks"] == []
    assert record["runtime"]["kernels"] == "pure-MLX"
    assert main(["info"]) == 2
    assert "--self-check" in capsys.readouterr().err


def test_info_self_check_names_the_failing_kernel(monkeypatch, capsys):
    from dflash2_apps.cli import main

    FakeMetal(monkeypatch, "lattice_path", "build")
    with pytest.warns(kernel_check.KernelCheckWarning, match="lattice_path"):
        assert main(["info", "--self-check", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["metal_available"] is True
    assert [(c["kernel"], c["dtype"], c["ok"]) for c in record["checks"]] == [
        (k, d, k != "lattice_path") for k, d in CHECKED
    ]
    failed = record["checks"][3]
    assert "did not build or run" in failed["reason"] and "use of undeclared" in failed["reason"]  # the compiler's
    assert record["runtime"]["kernels"] == "Metal (lattice_path: pure-MLX)"
    assert main(["info", "--self-check"]) == 0  # checked once: no second warning, the same records
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("  ")]
    assert [(r[0], r[1], r[2]) for r in rows] == [
        (k, d, "FAILED" if k == "lattice_path" else "passed") for k, d in CHECKED
    ]
    assert "--kernels auto runs: Metal (lattice_path: pure-MLX)" in lines
    assert any("--kernels mlx" in line for line in lines)


# -- the real kernel bodies, run by the CPU emulator ---------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(
    compiler() is None,
    reason="no C++20 compiler (g++ or clang++) to emulate the Metal kernels; apps/install.sh installs g++",
)
def test_the_real_kernels_pass_and_a_broken_one_fails_in_the_emulator(monkeypatch):
    FakeMetal(monkeypatch)
    monkeypatch.setattr(kernels.Launch, "run", emulate)
    assert all(r.ok for r in kernel_check.results()), kernel_check.results()
    kernel_check.clear()
    body = kernels.source("dynamic_conv.metal")
    broken = body.replace("out[row * D + c] =", "if (c + 1 < D) out[row * D + c] =", 1)
    assert broken != body
    monkeypatch.setattr(
        kernels.Launch, "run", lambda launch: emulate(launch, body=broken if launch.name == "dynamic_conv" else None)
    )
    with pytest.warns(kernel_check.KernelCheckWarning, match="dynamic_conv"):
        assert kernel_check.passed() == {"lattice_path", "accept_greedy"}
    assert all("non-finite" in r.reason for r in kernel_check.results() if r.kernel == "dynamic_conv")
