"""The PyTorch data engine: its logits and greedy responses against mlx-lm's, and how `dflash2 data` picks it."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import chi_square, make_target, mlx_lm_probabilities, slow_except
from mlx_lm.generate import generate_step

from dflash2_mlx.sampling import SamplingParams
from dflash2_mlx.target import Target
from dflash2_mlx.train.data import DataSettings, build, pick_engine, read_shards
from dflash2_mlx.train.features import FeatureCache
from dflash2_mlx.train.torch_engine import TorchTarget, _by_length, cpu_has_fast_bf16, generate, supported

torch = pytest.importorskip("torch")

ZEN4 = "flags\t\t: fpu sse2 avx2 avx512f avx512_bf16 avx512_vnni\n"
XEON_AMX = "flags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n"
ZEN2 = "flags\t\t: fpu sse2 avx2 fma\n"


def test_fast_bf16_is_read_off_the_cpu_flags():
    assert cpu_has_fast_bf16(ZEN4) and cpu_has_fast_bf16(XEON_AMX)
    assert not cpu_has_fast_bf16(ZEN2)
    assert not cpu_has_fast_bf16("flags\t\t: avx512_bf16x\n")  # a whole flag, not a prefix


def mlx_greedy(model, prompt: list[int], max_new: int, eos: int) -> list[int]:
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_new):
        out.append(int(token))
        if token == eos:
            break
    return out


@pytest.mark.parametrize("arch", slow_except(["llama", "qwen2"], "llama"))
def test_float32_responses_are_mlx_lms_greedy_ones(arch):
    """Continuous batching over fewer slots than prompts, prompts of different lengths: each response is mlx-lm's
    greedy continuation token for token (float32), so the cache, masks, positions and slot refills are right."""
    model = make_target(arch, seed=5)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (5, 17, 9, 30, 3)]
    eos = 7
    got = dict(generate(model, prompts, 24, [eos], slots=2, max_prompt_tokens=32, dtype="float32"))
    assert sorted(got) == list(range(len(prompts)))
    for i, prompt in enumerate(prompts):
        assert got[i] == mlx_greedy(model, prompt, 24, eos), f"prompt {i}"


@pytest.mark.parametrize("arch", slow_except(["llama", "qwen2"], "qwen2"))
def test_float32_sequence_features_are_the_targets(arch):
    """Whole right-padded sequences: the tapped layers' outputs (the last layer's after the final norm) and the
    top-k next tokens are `Target.teacher`'s, row for row (float32)."""
    model = make_target(arch, seed=7)
    target = Target(model, (0, 2, 3))  # 3 is the last layer: taken after the final norm
    tokens = np.random.default_rng(2).integers(3, 256, size=(3, 21))
    want, want_ids, want_logprobs = (np.array(a) for a in target.teacher(mx.array(tokens), 8))
    got, ids, logprobs = TorchTarget(model, 0, 0, "float32").sequences(tokens, target.layer_ids, 8)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert (ids == want_ids).mean() > 0.99  # near-ties among the 8 may swap
    np.testing.assert_allclose(np.sort(logprobs, -1), np.sort(want_logprobs, -1), atol=1e-4)
    first, _, _ = TorchTarget(model, 0, 0, "float32").sequences(tokens[1:2, :9], target.layer_ids)
    np.testing.assert_allclose(first[0], got[1, :9], rtol=1e-4, atol=1e-4)  # causal: later tokens change nothing


def test_sampled_responses_follow_mlx_lms_sampler():
    """At T > 0 (the prompts `dflash2 data` has the target write) the first token of each response, drawn when its
    slot is filled, and the second, drawn in a batched step, follow mlx-lm's sampler at the same temperature and
    top-p: chi-square over 600 responses against probabilities from the MLX model's own logits (float32)."""
    model = make_target("llama", seed=5)
    params = SamplingParams(temperature=0.7, top_p=0.9)
    prompt, n = [3, 14, 15, 92, 65], 600
    drawn = dict(
        generate(
            model,
            [prompt] * n,
            2,
            [],
            slots=64,
            max_prompt_tokens=8,
            dtype="float32",
            temperature=0.7,
            top_p=0.9,
            seed=1,
        )
    )
    assert len(drawn) == n
    first = mlx_lm_probabilities(model(mx.array([prompt]))[:, -1], params)[0]
    then = mlx_lm_probabilities(model(mx.array([prompt + [a] for a in range(len(first))]))[:, -1], params)
    second = first @ then  # P(second = b) = sum over a of P(a) P(b | a)
    for k, law in ((0, first), (1, second)):
        stat, critical = chi_square(Counter(r[k] for r in drawn.values()), dict(enumerate(law)), n)
        assert stat < critical, f"token {k + 1}: chi2 {stat:.1f} >= {critical:.1f}"
    assert all(first[r[0]] > 0 for r in drawn.values()), "a token outside the nucleus"
    greedy = dict(generate(model, [prompt] * 3, 2, [], slots=2, max_prompt_tokens=8, dtype="float32"))
    assert all(r[0] == int(np.argmax(first)) for r in greedy.values())


@pytest.mark.slow
def test_bfloat16_responses_mostly_follow_float32():
    """bfloat16 matmuls change near-ties only: the first tokens of most responses agree with float32's."""
    model = make_target("llama", seed=6)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, 256, size=12).tolist() for _ in range(8)]
    exact = dict(generate(model, prompts, 8, [], slots=4, max_prompt_tokens=16, dtype="float32"))
    fast = dict(generate(model, prompts, 8, [], slots=4, max_prompt_tokens=16))
    same_first = sum(exact[i][:2] == fast[i][:2] for i in range(8))
    assert same_first >= 6, (exact, fast)


def test_unsupported_targets_and_settings_are_refused(monkeypatch):
    assert supported(make_target("llama")) and not supported(make_target("qwen3"))
    assert not supported(make_target("llama_swa"))
    quantized = make_target("llama")
    nn.quantize(quantized, group_size=32, bits=4)
    assert not supported(quantized)  # packed weights are not PyTorch's
    with pytest.raises(ValueError, match="use --engine mlx"):
        list(generate(make_target("qwen3"), [[1, 2]], 4, []))
    with pytest.raises(ValueError, match="greedily"):
        pick_engine("torch", 0.7, make_target("llama"))
    with pytest.raises(ValueError, match="engine must be one of"):
        pick_engine("cuda", 0.0, make_target("llama"))
    import dflash2_mlx.train.data as data
    import dflash2_mlx.train.torch_engine as te

    monkeypatch.setattr(data.platform, "machine", lambda: "x86_64")
    assert pick_engine("auto", 0.0, make_target("llama")) == "torch"
    assert pick_engine("auto", 0.7, make_target("llama")) == "mlx"
    assert pick_engine("auto", 0.0, make_target("qwen3")) == "mlx"
    monkeypatch.setattr(te, "torch_available", lambda: False)
    assert pick_engine("auto", 0.0, make_target("llama")) == "mlx"
    monkeypatch.undo()
    monkeypatch.setattr(data.platform, "machine", lambda: "aarch64")  # unmeasured there: MLX
    assert pick_engine("auto", 0.0, make_target("llama")) == "mlx"
    monkeypatch.setattr(te, "cpu_has_fast_bf16", lambda: True)
    assert te.machine_dtype() == "bfloat16"
    monkeypatch.setattr(te, "cpu_has_fast_bf16", lambda: False)
    assert te.machine_dtype() == "float32"


def test_dflash2_data_preloads_openblas_only_where_mlx_decodes(monkeypatch, tmp_path):
    """Preloaded OpenBLAS takes over PyTorch's float32 matmuls (2.7x slower on a 2-core AVX2 CPU), so `dflash2 data`
    restarts with it once it knows MLX decodes, and never for the torch engine; other commands restart at once."""
    import sys

    from dflash2_apps import cli
    from dflash2_apps import data as data_command

    restarts = []
    monkeypatch.setattr(cli, "restart_with_openblas", lambda argv: restarts.append(("at start", argv)))
    monkeypatch.setattr(data_command, "restart_with_openblas", lambda argv: restarts.append(("data", argv)))
    monkeypatch.setattr(data_command, "load_target", lambda name: (make_target("llama"), None))
    monkeypatch.setattr(data_command, "build", lambda *a: 1 / 0)  # stop once the engine is picked
    for engine in ("torch", "mlx"):
        restarts.clear()
        argv = ["data", "--out", str(tmp_path), "--engine", engine]
        monkeypatch.setattr(sys, "argv", ["dflash2", *argv])
        assert cli.main() == 1  # the ZeroDivisionError, reported
        assert restarts == ([] if engine == "torch" else [("data", ["-m", "dflash2_apps.cli", *argv])])
    monkeypatch.setattr(sys, "argv", ["dflash2", "convert", "--help"])
    with pytest.raises(SystemExit):
        cli.main()
    assert restarts[-1] == ("at start", ["-m", "dflash2_apps.cli", "convert", "--help"])


def test_a_folder_keeps_its_engine(tmp_path, tokenizer):
    """`dflash2 data` with the torch engine writes shards; resuming with the MLX engine is refused, and a folder
    written before the engine was recorded counts as MLX's."""
    model = make_target("llama", seed=2)
    settings = DataSettings(
        target="tiny", num_prompts=3, max_prompt_tokens=400, max_new_tokens=6, batch_size=2, engine="torch"
    )
    build(tmp_path / "d", settings, model, tokenizer, progress=False)
    samples = read_shards(tmp_path / "d")
    assert len(samples) == 3 and all(len(s.tokens) - s.prompt_len <= 6 for s in samples)
    with pytest.raises(ValueError, match="engine: 'torch' there, 'mlx' here"):
        build(tmp_path / "d", DataSettings(**{**settings.__dict__, "engine": "mlx"}), model, tokenizer, progress=False)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_torch_feature_cache_is_the_targets_in_the_machines_dtype(tmp_path, tokenizer, monkeypatch, dtype):
    """`FeatureCache(engine="torch")` in the machine's dtype: bfloat16's rows within its rounding of the MLX float32
    cache's, in a folder of their own (a run never mixes the two); float32's within float32 rounding, in MLX's
    folder. A target the engine cannot run is refused."""
    import dflash2_mlx.train.torch_engine as te

    monkeypatch.setattr(te, "machine_dtype", lambda: dtype)
    model = make_target("llama", seed=2)
    settings = DataSettings(target="tiny", num_prompts=4, max_prompt_tokens=400, max_new_tokens=12, batch_size=2)
    build(tmp_path, settings, model, tokenizer, progress=False)
    samples = read_shards(tmp_path)
    target = Target(model, (0, 2, 3))
    mlx_cache = FeatureCache(tmp_path, samples, target, max_batch_tokens=64)
    want = np.array(mlx_cache.context(range(len(samples)), max(len(s.tokens) for s in samples)), np.float32)
    if dtype == "float32":
        for path in mlx_cache.folder.iterdir():  # the torch cache must compute them, not read MLX's
            path.unlink()
    torch_cache = FeatureCache(tmp_path, samples, target, max_batch_tokens=64, engine="torch")
    got = np.array(torch_cache.context(range(len(samples)), want.shape[1]), np.float32)
    error = np.linalg.norm(got - want) / np.linalg.norm(want)
    if dtype == "bfloat16":
        assert torch_cache.folder != mlx_cache.folder
        assert 1e-4 < error < 0.02  # bfloat16's own rows, not the float32 cache read twice
    else:
        assert torch_cache.folder == mlx_cache.folder
        assert error < 1e-3  # the cache keeps float16: its rounding, ~3e-4, is the difference's floor
    with pytest.raises(ValueError, match="use the mlx engine"):
        FeatureCache(tmp_path, samples, Target(make_target("qwen3", seed=2), (0, 2, 3)), engine="torch")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_training_without_a_cache_takes_each_steps_features_from_the_engine(tmp_path, tokenizer, monkeypatch, dtype):
    """`--no-feature-cache --feature-engine torch`: every step's context is the torch engine's features in the
    machine's dtype (within its rounding of MLX's float32 ones), each sequence computed at its own length (its padding
    rows zero, as the cache's), scaled as the cached ones are, and the run trains."""
    import dflash2_mlx.train.torch_engine as te
    from dflash2_mlx.train.batches import make_batch
    from dflash2_mlx.train.settings import TrainSettings
    from dflash2_mlx.train.trainer import Trainer

    monkeypatch.setattr(te, "machine_dtype", lambda: dtype)
    model = make_target("llama", seed=2)
    settings = DataSettings(target="tiny", num_prompts=6, max_prompt_tokens=400, max_new_tokens=12, batch_size=3)
    build(tmp_path / "d", settings, model, tokenizer, progress=False)

    def trainer(engine):
        run = TrainSettings(
            data=str(tmp_path / "d"), cache_features=False, feature_engine=engine, steps=2, sequences_per_step=3
        )
        return Trainer(model, tmp_path / engine, run)

    by_torch, by_mlx = trainer("torch"), trainer("mlx")
    batch = make_batch(by_torch.train_samples, 0, by_torch.settings, by_torch.drafter.config.mask_token_id)
    lengths = [len(by_torch.train_samples[i].tokens) for i in batch.picked]
    assert len(set(lengths)) > 1  # some rows padded
    got = np.array(by_torch.context(batch, "train") / by_torch.feature_scale)
    padded = np.array(by_mlx.target.sequence_features(batch.tokens))  # the whole padded batch in one pass
    for row, n in enumerate(lengths):
        want = padded[row, :n]
        error = np.linalg.norm(got[row, :n] - want) / np.linalg.norm(want)
        assert (1e-4 < error < 0.02) if dtype == "bfloat16" else error < 1e-5
        assert not got[row, n:].any()
    mlx_rows = np.array(by_mlx.context(batch, "train") / by_mlx.feature_scale)
    for row, n in enumerate(lengths):  # the MLX engine computes each row at its own length too
        assert np.linalg.norm(mlx_rows[row, :n] - padded[row, :n]) / np.linalg.norm(padded[row, :n]) < 1e-5
        assert not mlx_rows[row, n:].any()
    assert np.isfinite(by_torch.train_step())


def test_float32_torch_leaves_the_threads_to_a_loaded_openblas(monkeypatch):
    """OpenBLAS, where loaded, takes PyTorch's float32 matmuls and threads them itself: PyTorch then runs on one
    thread (its own would contend with OpenBLAS's); bfloat16 matmuls are PyTorch's own and keep its threads."""
    import dflash2_mlx.train.torch_engine as te

    assert te.openblas_loaded("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libopenblas.so.0\n")
    assert not te.openblas_loaded("7f00-7f10 r-xp 0 08:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    threads = torch.get_num_threads()
    try:
        for loaded, dtype, want in ((False, "float32", 2), (True, "bfloat16", 2), (True, "float32", 1)):
            torch.set_num_threads(2)
            monkeypatch.setattr(te, "openblas_loaded", lambda loaded=loaded: loaded)
            TorchTarget(make_target("llama"), 0, 0, dtype)
            assert torch.get_num_threads() == want, (loaded, dtype)
    finally:
        torch.set_num_threads(threads)


def test_prompts_are_taken_shortest_first_within_each_window():
    prompts = [[1] * n for n in (5, 2, 9, 1, 7, 3, 8)]
    order = [i for i, _ in _by_length(iter(enumerate(prompts)), 3)]
    assert order == [1, 0, 2, 3, 5, 4, 6]  # lengths (5, 2, 9) (1, 7, 3) (8), each window sorted
